"""Where one decode step's time goes: attention, FFN block, predictor, with predictors on and off.

    .venv/bin/python benchmarks/decode_breakdown.py --model build/relu_llama_1024x2 --plan build/plan

A plain decode loop (one token per forward, KV cache, greedy), no `generate`: what is left is the
model. Forward hooks time each layer's attention and MLP, the SparseFFN block inside the MLP, and
the block's predictor; per-step medians. One compiled model is timed with predictors="none" and
"all" in turn (the same weights in the same memory), then the dense model. --plan DIR loads a
saved plan (written there by the first run: compiling in predicted mode takes a minute or more).
The hooks themselves cost a few microseconds each.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import picompile
from picompile import corpus
from picompile.runtime.generate import cache_kwarg


@torch.no_grad()
def step_ms(model, prompt: torch.Tensor, steps: int) -> float:
    """Median milliseconds of one greedy decode step after `prompt`."""
    kv = {cache_kwarg(model): DynamicCache(), "use_cache": True}
    nxt = model(prompt, **kv).logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        nxt = model(nxt, **kv).logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def hook_timers(modules: dict[str, list]) -> dict[str, list[float]]:
    """Seconds spent in each call of the modules, by label."""
    spent: dict[str, list[float]] = {label: [] for label in modules}
    for label, mods in modules.items():
        for m in mods:
            m.register_forward_pre_hook(lambda m, a, s=spent[label]: s.append(-time.perf_counter()))
            m.register_forward_hook(lambda m, a, o, s=spent[label]: s.__setitem__(-1, s[-1] + time.perf_counter()))
    return spent


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a local HF Llama-style model directory")
    ap.add_argument("--plan", required=True, help="saved plan directory (made on first use)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dense = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    if pathlib.Path(args.plan).exists():
        cm = picompile.load(copy.deepcopy(dense), args.plan)
    else:
        calib = corpus.token_batches(tok, "calibration", 32768)
        cm = picompile.compile(copy.deepcopy(dense), mode="predicted", calibration=calib, quiet=True)
        cm.save(args.plan)
    prompt = corpus.token_batches(tok, "heldout", 4096)[:1, :32]
    ffns = list(cm.ffns().values())
    layers = cm._orig_mod.model.layers
    spent = hook_timers({"attention": [layer.self_attn for layer in layers],
                         "MLP": [layer.mlp for layer in layers], "FFN block": ffns,
                         "predictor": [f.predictor for f in ffns]})
    print(f"{args.model}: {len(layers)} layers, {torch.get_num_threads()} threads, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; per layer, microseconds")
    print("| round | predictors | step ms | attention | MLP | FFN block | predictor | dense step ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in range(args.rounds):
        rows = []
        for policy in ("none", "all"):
            cm.use_predictors(policy)
            for s in spent.values():
                s.clear()
            ms = step_ms(cm._orig_mod, prompt, args.steps)
            us = {k: statistics.median(v) * 1e6 if v else 0.0 for k, v in spent.items()}
            rows.append(f"| {r + 1} | {policy} | {ms:.3f} | " + " | ".join(f"{v:.0f}" for v in us.values()))
        dense_ms = step_ms(dense, prompt, args.steps)
        for row in rows:
            print(f"{row} | {dense_ms:.3f} |")


if __name__ == "__main__":
    main()
