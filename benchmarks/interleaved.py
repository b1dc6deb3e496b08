"""Decode tokens/s of SmolLM2-135M in interleaved rounds: llama.cpp on the shipped Q4_1 file and
picompile's whole-step decoder on the same file's blocks, dense and at threshold sparsity.

    .venv/bin/python benchmarks/interleaved.py [--rounds 8] [--new-tokens 64] [--sparsity 0.5]

This VM's speed drifts by tens of percent over seconds to minutes (BENCHMARKS.md), so peers.py's
"best of N, one system after the other" can hand one system a slow stretch. Here each round runs
every system once, in turn (llama-bench `-r 1`, picompile's C decode step alone over the same
number of tokens from a 32-token prompt), and the table gives each system's median and best over
the rounds, and the median of the per-round ratios to llama.cpp (both sides of a ratio measured
within seconds of each other). Needs llama.cpp built by benchmarks/peers.py.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import picompile
from picompile import bench, corpus, models


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sparsity", type=float, default=0.5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bins = bench.llama_cpp_bins()
    if bins is None:
        raise SystemExit(bench.not_built())
    gguf = models.default_gguf()
    model, tok = models.load(None)
    prompt = corpus.token_batches(tok, "heldout", 1, seq_len=32)
    calib = corpus.token_batches(tok, "calibration", 16384)
    systems = {"llama.cpp Q4_1": lambda: bench.llama_bench(bins, gguf, args.threads, args.new_tokens, 1)}
    for what, kw in (("dense", {}), (f"threshold @{args.sparsity:.0%}",
                                     dict(sparsity=args.sparsity, calibration=calib))):
        cm = picompile.compile(copy.deepcopy(model), gguf=gguf, quiet=True, **kw)
        dec = cm.decoder()
        if dec is None:
            raise SystemExit(f"picompile {what}: no whole-step decoder ({cm.decoder_reason})")
        systems[f"picompile {what}, gguf, C decode step"] = (
            lambda dec=dec: bench.decoder_tps(dec, prompt, args.new_tokens))
        bench.decoder_tps(dec, prompt, 8)  # warm up
    runs = {name: [] for name in systems}
    for r in range(args.rounds):
        for name, run in systems.items():
            runs[name].append(run())
        bench.log(f"round {r + 1}/{args.rounds}: "
                  + ", ".join(f"{name} {v[-1]:.1f}" for name, v in runs.items()))
    base = runs["llama.cpp Q4_1"]
    print(f"\nSmolLM2-135M-Instruct decode, {args.threads} threads, {args.new_tokens} tokens, "
          f"{args.rounds} interleaved rounds, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| system | median tok/s | best tok/s | median of per-round ratio to llama.cpp Q4_1 |")
    print("|---|---:|---:|---:|")
    for name, v in runs.items():
        ratio = statistics.median(a / b for a, b in zip(v, base))
        print(f"| {name} | {statistics.median(v):.1f} | {max(v):.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
