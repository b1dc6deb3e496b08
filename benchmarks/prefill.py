"""Prefill of a long prompt: HF eager against picompile, in interleaved rounds (issue 9's
target: a 512-token prompt no slower than HF eager).

    .venv/bin/python benchmarks/prefill.py [--tokens 512] [--rounds 5] [--dtypes float32 gguf]

Rows: HF eager, dense, in each float dtype; picompile dense and at --sparsity threshold
sparsity on the same weights (float, or "gguf": the shipped file's Q4_1 tensors kept); llama.cpp
`llama-bench -p N -n 0` on the same file when benchmarks/peers.py has built it. One prefill =
one forward of the whole prompt into an empty static cache, as picompile's generate runs it
(logits of the last position only). Each round runs every system once, in turn; the table
gives medians over the rounds and the median per-round ratio to HF eager in the same dtype.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import picompile
from picompile import bench, corpus, models
from picompile.runtime import generate as gen


@torch.no_grad()
def prefill_tps(model, prompt: torch.Tensor) -> float:
    """Prompt tokens per second of one prefill of `prompt` [1, T] into a fresh static cache."""
    cache = gen._new_cache(model, prompt.shape[1])
    kw = {gen.cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": 1}
    t0 = time.perf_counter()
    model(prompt, **kw)
    return prompt.shape[1] / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "gguf"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gguf = models.default_gguf()
    loaded, tok = models.load(None)
    prompt = corpus.token_batches(tok, "heldout", 1, seq_len=args.tokens)  # [1, T]
    calib = corpus.token_batches(tok, "calibration", 16384)
    systems, base_of = {}, {}
    bins = bench.llama_cpp_bins()
    if bins is not None:
        systems[f"llama.cpp {gguf.name}"] = (
            lambda: bench.llama_bench(bins, gguf, args.threads, args.tokens, 1, test="pp"))
    for dtype in args.dtypes:
        float_dtype = torch.float32 if dtype == "gguf" else getattr(torch, dtype)
        quant = dict(gguf=gguf) if dtype == "gguf" else {}
        dense = copy.deepcopy(loaded).to(float_dtype)
        hf = f"HF eager, dense, {float_dtype}".replace("torch.", "")
        systems.setdefault(hf, lambda m=dense: prefill_tps(m, prompt))
        for what, kw in (("dense", {}), (f"threshold @{args.sparsity:.0%}",
                                         dict(sparsity=args.sparsity, calibration=calib))):
            cm = picompile.compile(copy.deepcopy(dense), quiet=True, **kw, **quant)
            name = f"picompile {what}, {dtype}"
            systems[name] = lambda m=cm._orig_mod: prefill_tps(m, prompt)
            base_of[name] = hf
    for run in systems.values():
        run()  # warm up (kernel builds, first-touch allocations)
    runs = {name: [] for name in systems}
    for r in range(args.rounds):
        for name, run in systems.items():
            runs[name].append(run())
        bench.log(f"round {r + 1}/{args.rounds}: "
                  + ", ".join(f"{name} {v[-1]:.0f}" for name, v in runs.items()))
    print(f"\nSmolLM2-135M-Instruct prefill of {args.tokens} tokens, {args.threads} threads, "
          f"{args.rounds} interleaved rounds, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| system | median prompt tok/s | best | median per-round ratio to HF eager |")
    print("|---|---:|---:|---:|")
    for name, v in runs.items():
        base = runs.get(base_of.get(name, name)) if not name.startswith("llama.cpp") else None
        ratio = f"{statistics.median(a / b for a, b in zip(v, base)):.2f}x" if base else "-"
        print(f"| {name} | {statistics.median(v):.0f} | {max(v):.0f} | {ratio} |")


if __name__ == "__main__":
    main()
