"""Decode on the CPU, a Llama-7B-shaped ReLU model with planted ~90% FFN sparsity: picompile
(exact or predicted mode) against llama.cpp on the same weights, float16 and q4_0.

Two targets: picompile decodes at least 2x llama.cpp's tokens/s (exact mode; `--mode predicted`
runs the predictors, which PowerInfer's CPU figure uses)
    (a) with float16 weights, against llama.cpp F16 of the same weights;
    (b) with quantize="q4_0", against llama.cpp Q4_0 of the same weights (llama-quantize of (a)).

    .venv/bin/python benchmarks/planted_cpu.py                        # Llama-7B shape, 4 layers
    .venv/bin/python benchmarks/planted_cpu.py --layers 8 --rounds 12 --new-tokens 64
    .venv/bin/python benchmarks/planted_cpu.py --shape tiny --rounds 2 --new-tokens 8   # smoke
    .venv/bin/python benchmarks/planted_cpu.py --dry-run              # everything but the timing
    .venv/bin/python benchmarks/planted_cpu.py --mode predicted       # predictors skip gate rows
    .venv/bin/python benchmarks/planted_cpu.py --mode predicted --formats q4_0 --layers 32

The model: benchmarks/hybrid.py's ReLU Llama (random float16 weights; gate rows near a rank-64
subspace; gate biases planting a power-law firing distribution, `--sparsity-target` of the
neurons firing per token on average), with llama_offload.py's Llama-7B numbers (d 4096, n_ff
11008, 32 heads), cut to `--layers` (default 4). Memory: the float16 model (13.76 GB at 32
layers) plus, while compiling, each FFN block's transposed down rows and one layer widened to
float32 for calibration (peak 18.5 GB at 32 layers, q4_0 predicted); then picompile's q4_0
model (about 5.5 GB at 32 layers) or its float16 one (about the float16 weights), and
llama-bench maps its file on top. So `--formats q4_0` fits all 32 layers on a 24 GB machine,
float16 (its model and llama.cpp's F16 file both held) about 20. Per-layer speed does not depend on the depth, but the LM head (float16 in both systems at float16; q8_0
in picompile's q4_0 model, Q6_K in llama.cpp's Q4_0 file) weighs more in a short stack. The
vocabulary is the copied tokenizer's (SmolLM2's, 49,152 tokens, llama_offload.py explains why),
in the model as in the file.

The same weights: the Hugging Face model's own tensors are written to a GGUF F16 file
(build/planted-cpu/, git-ignored) with llama_offload.py's tokenizer metadata, q and k rows
permuted as llama.cpp's converter does (convert_hf_to_gguf LlamaModel.permute; checked against
picompile/gguf_weights.py's inverse), the FFN biases as llama.cpp's optional ffn_*.bias
tensors; llama-quantize makes the Q4_0 file from it (output.weight Q6_K, llama.cpp's default).
llama.cpp's llama architecture applies SiLU in the FFN whatever the model's activation is, so
its outputs are not this ReLU model's; its speed is the same: a dense FFN reads every weight
whatever the activation.

Measured: decode tokens/s in interleaved rounds (picompile.bench.llama_bench / decoder_tps): each
round runs `llama-bench -p 0 -n N -r 1` on the F16 file, picompile float16 exact's whole-step
C decoder for N steps, llama-bench on the Q4_0 file, picompile q4_0 exact, in turn; the table
gives each system's median and best, and the median of the per-round ratios to its llama.cpp
peer (both sides measured seconds apart, on this VM whose speed drifts). Also: the FFN sparsity
picompile measured (cm.sparsity() over a greedy generate of the prompt + N tokens), and the
weight bytes each system reads per decoded token: llama.cpp every tensor but token_embd;
picompile the attention and LM head weights, every gate row (exact mode must compute each
gate to know which neurons fire) and the up / down rows of the neurons that fired. Their ratio
is the speed-up where both run at memory speed: at 10% firing a float16 Llama-7B layer reads
242 MB against llama.cpp's 404 MB (1.67x; about 1.5x at 4 layers with the LM head), and a
q4_0 layer about 70 MB against 113 MB (picompile keeps FFN down rows q8_0). 2x then needs
llama.cpp to be slower than memory speed (compute bound on 2 threads), which this measures.
Needs llama.cpp built (`python benchmarks/peers.py --build-only`) and the gguf package.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import shlex
import statistics
import subprocess
import time

import numpy as np
import torch

import picompile
from picompile import bench, gguf_weights
from picompile.passes import predictors
from picompile.runtime.dense_linear import DenseLinear, QuantLinear
from picompile.runtime.sparse_ffn import SparseFFN

# beside this script (python puts its folder first on sys.path)
import hybrid  # the planted ReLU Llama
import llama_offload  # the tokenizer metadata, the GGUF tensor names
from machine import OtherLoad

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "planted-cpu"  # git-ignored
HYBRID_SHAPE = {"llama-7b": "llama-7b", "tiny": "tiny-llama"}  # --shape -> hybrid.SHAPES key
SHAPES = tuple(HYBRID_SHAPE)
PLANTED_RATE = 0.1  # what hybrid.build plants
PROMPT_TOKENS = 32


# ---------------------------------------------------------------- the model

def build(shape: str, layers: int, n_vocab: int, rate: float) -> torch.nn.Module:
    """hybrid.build's float16 ReLU Llama of that shape with the tokenizer's vocabulary, its gate
    biases planted again for `rate` where that is not hybrid's 10%. Deterministic."""
    model = hybrid.build(HYBRID_SHAPE[shape], torch.float16, "cpu", layers, vocab=n_vocab)
    if rate != PLANTED_RATE:
        replant(model, rate)
    return model


@torch.no_grad()
def replant(model, rate: float, seed: int = 0) -> None:
    """Gate biases for a mean firing rate `rate`, as hybrid.build plants 10%: neuron j's
    pre-activation is about N(0, ||w_j||) on normed input, so bias ||w_j|| * Phi^-1(p_j)
    makes it fire with probability p_j (power-law p_j)."""
    gen = torch.Generator().manual_seed(seed)
    normal = torch.distributions.Normal(0.0, 1.0)
    for layer in hybrid.decoder_layers(model):
        gate = layer.mlp.gate_proj
        rates = hybrid.power_law_rates(gate.out_features, rate, gen=gen)
        std = gate.weight.float().norm(dim=1)
        gate.bias.copy_((std * normal.icdf(rates)).to(gate.bias.dtype))


# ---------------------------------------------------------------- the same weights in GGUF

def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q / k row order (convert_hf_to_gguf LlamaModel.permute): each
    head's two rotary halves interleaved. gguf_weights._unpermute_rows is its inverse."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_names(hidden, ffn, layers, heads, vocab):
    """GGUF tensor names in file order: llama_offload.tensor_shapes' weights, each layer's FFN
    biases after its ffn_down."""
    for name in llama_offload.tensor_shapes(hidden, ffn, layers, heads, vocab):
        yield name
        if name.endswith("ffn_down.weight"):
            blk = name.rsplit(".", 2)[0]
            yield from (f"{blk}.ffn_gate.bias", f"{blk}.ffn_up.bias", f"{blk}.ffn_down.bias")


def hf_names(params, layers: int) -> dict[str, str]:
    """{GGUF tensor name: the Hugging Face parameter it holds} ("blk.0.ffn_up.bias" ->
    "model.layers.0.mlp.up_proj.bias"), by the gguf package's name map as gguf_weights reads
    files."""
    to_tensor = gguf_weights.tensor_name("llama", layers)
    out = {}
    for param in params:
        module, kind = param.rsplit(".", 1)
        if (tensor := to_tensor(module)) is not None:
            out[tensor.rsplit(".", 1)[0] + "." + kind] = param
    return out


def gguf_array(name: str, t: torch.Tensor, config) -> np.ndarray:
    """float16 matrices (q / k rows permuted for llama.cpp), float32 vectors."""
    if t.dim() == 1:
        return t.detach().float().numpy()
    a = t.detach().to(torch.float16).numpy()
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    part = name.split(".")[-2]
    return permute(a, heads[part]) if part in heads else a


def write_gguf(model, path: pathlib.Path) -> None:
    """The model's own tensors as a Llama GGUF F16 file (header as llama_offload.write_gguf's,
    with the model's config values; tensors streamed one at a time). Checks that blk.0's q and
    k read back through picompile's inverse permutation are the model's."""
    gguf = llama_offload.import_gguf()
    c = model.config
    fields = llama_offload.tokenizer_fields(llama_offload.vocab_source())
    n_vocab = llama_offload.vocab_size(fields)
    params = dict(model.named_parameters())
    hf_name = hf_names(params, c.num_hidden_layers).__getitem__
    names = list(gguf_names(c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                            c.num_attention_heads, n_vocab))
    head_dim = c.hidden_size // c.num_attention_heads
    rope = getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]
    partial = path.with_name(path.name + ".partial")
    w = gguf.GGUFWriter(partial, "llama")
    w.add_name(f"planted relu llama h{c.hidden_size} f{c.intermediate_size} l{c.num_hidden_layers}")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(rope))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value, vtype, sub in fields:
        w.add_key_value(key, value, vtype, sub_type=sub)
    for name in names:
        t = params[hf_name(name)]
        dtype = np.dtype(np.float32 if t.dim() == 1 else np.float16)
        w.add_tensor_info(name, tuple(t.shape), dtype, t.numel() * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name in names:
        w.write_tensor_data(gguf_array(name, params[hf_name(name)], c))
    w.close()
    os.replace(partial, path)

    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for part, module, heads in (("attn_q", "q_proj", c.num_attention_heads),
                                ("attn_k", "k_proj", c.num_key_value_heads)):
        back = gguf_weights._unpermute_rows(np.asarray(tensors[f"blk.0.{part}.weight"].data), heads)
        want = params[f"model.layers.0.self_attn.{module}.weight"].detach().numpy()
        if not np.array_equal(back, want):
            raise SystemExit(f"{path}: blk.0.{part} does not read back as the model's {module}")


def llama_bytes_per_token(path: pathlib.Path) -> int:
    """Weight bytes llama.cpp reads per decoded token: every tensor but the embedding (one row)."""
    gguf = llama_offload.import_gguf()
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if t.name != "token_embd.weight")


# ---------------------------------------------------------------- picompile

def nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def picompile_bytes_per_token(cm) -> float:
    """Weight bytes picompile reads per decoded token at the sparsity measured since the last
    reset_stats(): attention and LM head whole; exact mode: each FFN's gate rows (up rows of a
    plain block) all, the up and down rows of the share of neurons that fired (a threshold on a
    gated block, |act(gate) * up|: gate and up rows all, the down rows of that share);
    predicted mode: the predictor's kernel (float16 matrices), the first rows of the neurons it
    predicts (its predicted density on held-out calibration samples) and the other rows of the
    share that fired."""
    total = 0.0
    for m in cm._orig_mod.modules():
        if isinstance(m, SparseFFN):
            first = [m.w_gate if m.w_gate is not None else m.w_up]
            if m.threshold > 0 and m.w_gate is not None:
                first.append(m.w_up)  # the threshold reads both to know which neurons pass
            rest = sum(nbytes(t) for t in (m.w_up, m.w_down_t) if all(t is not f for f in first))
            if m.predictor is not None and m.predictor.enabled:
                total += predictors.kernel_bytes(m.predictor.rank, m.d_model, m.n_ff)
                total += (m.block.measured.predicted_density * sum(map(nbytes, first))
                          + (1 - m.sparsity) * rest)
            else:
                total += sum(map(nbytes, first)) + (1 - m.sparsity) * rest
        elif isinstance(m, QuantLinear):
            total += nbytes(m.qweight)
        elif isinstance(m, DenseLinear):
            total += nbytes(m.weight)
    return total


def compiled(label: str, model, prompt: torch.Tensor, new_tokens: int, **kw):
    """(cm, its whole-step decoder, FFN sparsity, bytes read per token); the sparsity over a
    greedy generate of prompt + new_tokens (the decoder runs its steps)."""
    cm = picompile.compile(model, quiet=True, **kw)
    dec = cm.decoder()
    if dec is None:
        raise SystemExit(f"picompile {label}: no whole-step decoder ({cm.decoder_reason})")
    cm.reset_stats()
    cm.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return cm, dec, cm.sparsity(), picompile_bytes_per_token(cm)


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=SHAPES, default="llama-7b")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (Llama-7B has 32)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32, help="decode steps per timed run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sparsity-target", "--firing-rate", dest="rate", type=float, default=PLANTED_RATE,
                    help="planted mean firing rate per token (0.10: 90%% FFN sparsity)")
    ap.add_argument("--mode", choices=["exact", "predicted"], default="exact",
                    help="picompile's mode; predicted trains a predictor per block on random "
                         "token ids (the model's weights are random too) and runs them all")
    ap.add_argument("--formats", nargs="+", choices=["float16", "q4_0"], default=["float16", "q4_0"],
                    help="picompile's weights, each against llama.cpp on the same weights")
    ap.add_argument("--dry-run", action="store_true",
                    help="build, write the GGUF files, compile, measure sparsity; print the "
                         "commands, time nothing")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bins = bench.llama_cpp_bins()
    if bins is None:
        raise SystemExit(bench.not_built())
    t_start = time.perf_counter()
    n_vocab = llama_offload.vocab_size(llama_offload.tokenizer_fields(llama_offload.vocab_source()))
    print(f"{args.shape}, {args.layers} layers, vocab {n_vocab}, planted firing rate "
          f"{args.rate:.0%}, {args.threads} threads, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)

    OUT.mkdir(parents=True, exist_ok=True)
    stem = f"{args.shape}-L{args.layers}-fire{args.rate:g}"
    f16, q4 = OUT / f"{stem}-F16.gguf", OUT / f"{stem}-Q4_0.gguf"
    prompt = torch.randint(0, n_vocab, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1))

    t0 = time.perf_counter()
    model = build(args.shape, args.layers, n_vocab, args.rate)
    print(f"built in {time.perf_counter() - t0:.0f} s: {hybrid.weight_bytes(model) / 1e9:.2f} GB "
          f"float16; {memory()}", flush=True)
    t0 = time.perf_counter()
    write_gguf(model, f16)  # before compile, which rewrites the model in place
    q4.unlink(missing_ok=True)  # made again from this F16 file
    bench.requantized(bins, f16, "Q4_0", q4)
    print(f"wrote {f16.name} ({f16.stat().st_size / 1e9:.2f} GB) and {q4.name} "
          f"({q4.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s; {memory()}", flush=True)

    # q4_0 first, from the model just written: its float weights go as they are quantized, so
    # the float16 model built next is the only float copy held beside it. Calibration (predicted
    # mode) runs layer by layer in float32 (compile's choice for a float16 model on a CPU).
    t0 = time.perf_counter()
    mode = dict(mode=args.mode)
    if args.mode == "predicted":
        mode.update(predictors="all", calibration=torch.randint(
            0, n_vocab, (4, 128), generator=torch.Generator().manual_seed(2)))
    runs = {}  # format -> (decoder, FFN sparsity, bytes per token)
    if "q4_0" in args.formats:
        cmq, *runs["q4_0"] = compiled("q4_0", model, prompt, args.new_tokens, quantize="q4_0", **mode)
        print("q4_0 compiled: weights: "
              + picompile.explain(cmq).split("weights: ", 1)[1].split("\n", 1)[0] + f"; {memory()}",
              flush=True)
    del model
    if "float16" in args.formats:
        cm16, *runs["float16"] = compiled("float16", build(args.shape, args.layers, n_vocab, args.rate),
                                          prompt, args.new_tokens, **mode)
        print(picompile.explain(cm16), flush=True)
    print(f"compiled in {time.perf_counter() - t0:.0f} s; FFN sparsity "
          + ", ".join(f"{f} {sp:.1%}" for f, (_, sp, _) in runs.items())
          + f" (target {1 - args.rate:.0%}); {memory()}", flush=True)

    n = args.new_tokens
    peers = {"float16": ("llama.cpp F16", f16), "q4_0": ("llama.cpp Q4_0", q4)}
    systems = {}  # name -> (one round's tok/s, weight bytes per token, FFN sparsity, llama.cpp peer)
    for fmt, (dec, sparsity, nbytes_) in runs.items():
        peer, path = peers[fmt]
        systems[peer] = (lambda path=path: bench.llama_bench(bins, path, args.threads, n, 1),
                         llama_bytes_per_token(path), None, None)
        systems[f"picompile {fmt}, {args.mode}"] = (lambda dec=dec: bench.decoder_tps(dec, prompt, n),
                                                    nbytes_, sparsity, peer)
    if args.dry_run:
        for path in (f16, q4):
            print("$ " + shlex.join([str(bins / "llama-bench"), "-m", str(path), "-p", "0", "-n",
                                     str(n), "-t", str(args.threads), "-r", "1", "-o", "json"]))
        for name, (_, b, _, _) in systems.items():
            print(f"{name}: {b / 1e6:.0f} MB of weights read per token")
        print(footer(t_start))
        return
    for dec, *_ in runs.values():
        bench.decoder_tps(dec, prompt, 8)  # warm up
    runs = {name: [] for name in systems}
    others = []  # other processes' CPU share while picompile ran (llama-bench's would count as other)
    for r in range(args.rounds):
        for name, (run, *_, peer) in systems.items():
            other = OtherLoad()
            try:
                runs[name].append(run())
            except subprocess.CalledProcessError as e:
                raise SystemExit(f"{name}: {shlex.join(e.cmd)} exited {e.returncode}:\n"
                                 + "\n".join((e.stderr or "").strip().splitlines()[-15:])) from None
            share = other.fraction()
            if peer is not None and share is not None:
                others.append(share)
        bench.log(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in runs.items()))

    print(f"\n{args.shape}-shaped ReLU, {args.layers} layers, planted firing {args.rate:.0%}, decode "
          f"tok/s, {args.threads} threads, {n} tokens, {args.rounds} interleaved rounds, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| system | median tok/s | best tok/s | median per-round ratio to llama.cpp | "
          "weights read / token | FFN sparsity |")
    print("|---|---:|---:|---:|---:|---:|")
    verdicts = []
    for name, (_, b, sparsity, peer) in systems.items():
        v = runs[name]
        ratio = "-"
        if peer is not None:
            med = statistics.median(a / p for a, p in zip(v, runs[peer]))
            ratio = f"{med:.2f}x"
            verdicts.append(f"{name} vs {peer}: {med:.2f}x, target >= 2x: "
                            f"{'met' if med >= 2 else 'not met'} (bytes per token: {peer} reads "
                            f"{systems[peer][1] / b:.2f}x picompile's)")
        sparsity = "dense" if sparsity is None else f"{sparsity:.1%}"
        print(f"| {name} | {statistics.median(v):.2f} | {max(v):.2f} | {ratio} | {b / 1e6:.0f} MB "
              f"| {sparsity} |")
    print("\n".join(verdicts))
    if others:
        print(f"other processes' CPU share while picompile ran (benchmarks/machine.py): median "
              f"{statistics.median(others):.0%}, max {max(others):.0%}: above a few % the 2-thread "
              "timings of both systems are unreliable")
    print(footer(t_start))


def footer(t_start: float) -> str:
    return f"{memory()}; load average {os.getloadavg()[0]:.2f}; total {time.perf_counter() - t_start:.0f} s"


def memory() -> str:
    """This process's resident memory now and at its peak (llama.cpp's processes come on top:
    each maps its GGUF file)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    now = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return f"RSS {now / 1e9:.2f} GB, peak {peak / 1e9:.2f} GB"

if __name__ == "__main__":
    main()
