"""Decode tokens/s of SmolLM2-135M in interleaved rounds: llama.cpp on the shipped Q4_1 file and
picompile's whole-step decoder on the same file's blocks, dense and at threshold sparsity; with
--dtype float32 / float16, both on the file's weights dequantized to that dtype (llama.cpp's
F32 / F16 file made by llama-quantize --allow-requantize, as peers.py does); with --dtype q8_0
both on them quantized to Q8_0 (compile(quantize="q8_0"), rounded to nearest; llama-quantize).

    .venv/bin/python benchmarks/interleaved.py [--rounds 8] [--new-tokens 64] [--sparsity 0.5]
    .venv/bin/python benchmarks/interleaved.py --dtype float16
    .venv/bin/python benchmarks/interleaved.py --dtype float16 --depth 2048
    .venv/bin/python benchmarks/interleaved.py --depth 2048 --kv-cache float32 float16
    .venv/bin/python benchmarks/interleaved.py --gguf build/quant-quality/smollm2-Q4_K_M.gguf

This VM's speed drifts by tens of percent over seconds to minutes (BENCHMARKS.md), so peers.py's
"best of N, one system after the other" can hand one system a slow stretch. Here each round runs
every system once, in turn (llama-bench `-r 1`, picompile's C decode step alone over the same
number of tokens from a 32-token prompt), and the table gives each system's median and best over
the rounds, and the median of the per-round ratios to llama.cpp (both sides of a ratio measured
within seconds of each other). With --depth D the decode steps follow a D-token prompt (held-out
text prefilled once into picompile's cache; llama-bench -d D), so attention reads D positions.
--kv-cache float16 keeps picompile's KV cache in float16 (compile(kv_cache=)), as llama.cpp's is;
several values run picompile once per cache dtype, in the same rounds. --gguf FILE runs both on
another GGUF file of SmolLM2 (a llama-quantize of it, such as benchmarks/quant_quality.py's
Q4_K_M), picompile on the model loaded from that file and its blocks (compile(gguf=FILE)).
Needs llama.cpp built by benchmarks/peers.py.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import time

import torch

import picompile
from picompile import bench, corpus, models


@torch.no_grad()
def prefill(cm, dec, prompt: torch.Tensor, n: int) -> None:
    """The prompt's keys and values into the decoder's cache, through the model (as generate)."""
    from transformers import StaticCache

    from picompile.runtime.generate import cache_kwarg

    model = cm._orig_mod
    cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + n)
    model(prompt, **{cache_kwarg(model): cache}, use_cache=True)
    dec.reserve(prompt.shape[1] + n)
    dec.load_cache(cache, prompt.shape[1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--depth", type=int, default=0, help="positions before the decode steps")
    ap.add_argument("--dtype", choices=["gguf", "q8_0", "float32", "float16"], default="gguf",
                    help="gguf: the file's Q4_1 blocks as they are; else its weights in that dtype")
    ap.add_argument("--kv-cache", nargs="+", choices=["float32", "float16", "bfloat16"],
                    default=[None], help="picompile's KV cache dtype(s) (default: the model's)")
    ap.add_argument("--gguf", default=None, help="another GGUF file of SmolLM2 (with --dtype gguf)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bins = bench.llama_cpp_bins()
    if bins is None:
        raise SystemExit(bench.not_built())
    if args.gguf and args.dtype != "gguf":
        raise SystemExit("--gguf runs a file's own blocks: it goes with --dtype gguf only")
    gguf = models.default_gguf()
    if args.dtype == "gguf":
        gguf = models.check(args.gguf) if args.gguf else gguf
        peer = f"llama.cpp {gguf.name}" if args.gguf else "llama.cpp Q4_1"
        peer_file, dtype, weights = gguf, None, dict(gguf=gguf)
    elif args.dtype == "q8_0":  # both quantize the file's float32 weights again
        peer, dtype, weights = "llama.cpp Q8_0", None, dict(quantize="q8_0")
        peer_file = bench.requantized(bins, gguf, "Q8_0", bench.BUILD / f"{gguf.stem}-Q8_0.gguf")
    else:
        dtype = getattr(torch, args.dtype)
        kind = bench.GGUF_KINDS[dtype]
        peer, weights = f"llama.cpp {kind}", {}
        peer_file = bench.requantized(bins, gguf, kind, bench.BUILD / f"{gguf.stem}-{kind}.gguf")
    model, tok = models.load(args.gguf, dtype=dtype)
    prompt = corpus.token_batches(tok, "heldout", 1, seq_len=max(32, args.depth))
    calib = corpus.token_batches(tok, "calibration", 16384)
    systems = {peer: lambda: bench.llama_bench(bins, peer_file, args.threads, args.new_tokens, 1,
                                               depth=args.depth)}
    for (what, kw), kv in itertools.product(
            (("dense", {}), (f"threshold @{args.sparsity:.0%}",
                             dict(sparsity=args.sparsity, calibration=calib))), args.kv_cache):
        cm = picompile.compile(copy.deepcopy(model), quiet=True, kv_cache=kv, **weights, **kw)
        dec = cm.decoder()
        if dec is None:
            raise SystemExit(f"picompile {what}: no whole-step decoder ({cm.decoder_reason})")
        if args.depth:
            prefill(cm, dec, prompt, args.new_tokens)
        systems[f"picompile {what}, {args.dtype}, {dec.kv_dtype} KV".replace("torch.", "")] = (
            lambda dec=dec: bench.decoder_tps(dec, prompt, args.new_tokens))
        bench.decoder_tps(dec, prompt, 8)  # warm up
    runs = {name: [] for name in systems}
    for r in range(args.rounds):
        for name, run in systems.items():
            runs[name].append(run())
        bench.log(f"round {r + 1}/{args.rounds}: "
                  + ", ".join(f"{name} {v[-1]:.1f}" for name, v in runs.items()))
    base = runs[peer]
    print(f"\nSmolLM2-135M-Instruct decode, {args.threads} threads, {args.new_tokens} tokens "
          f"after {prompt.shape[1]} positions, "
          f"{args.rounds} interleaved rounds, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"| system | median tok/s | best tok/s | median of per-round ratio to {peer} |")
    print("|---|---:|---:|---:|")
    for name, v in runs.items():
        ratio = statistics.median(a / b for a, b in zip(v, base))
        print(f"| {name} | {statistics.median(v):.1f} | {max(v):.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
