"""The dense kernel's software prefetch distance (dense.c's PI_PF_BYTES), per weight format.

    .venv/bin/python benchmarks/dense_prefetch.py                     # 0, 1024, 2048, 4096, 8192
    .venv/bin/python benchmarks/dense_prefetch.py --distances 0,4096 --tokens 8

SmolLM2-135M's shapes (its LM head 49152x576, gate / up 1536x576, down 576x1536), one build
per distance (each the same ISA: AVX2 for float weights, AVX-512 for the quantized formats, as
picompile picks them for one token), random weights cycled over copies that together exceed the
last-level cache (so they come from memory, as in decoding). Distances are interleaved in rounds;
reported: GB/s of weight bytes read, the median over rounds, and the streaming-read probe for
scale. codegen/dense.py's default_tuning() is what picompile builds with on this CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from machine import COLD_BYTES, OtherLoad, cpu_name, stream_probe  # benchmarks/machine.py
from picompile import quant
from picompile.codegen import c, dense

SHAPES = [("lm_head", 49152, 576), ("gate / up", 1536, 576), ("down", 576, 1536)]
FORMATS = ["float32", "float16", "q8_0", "q4_1"]


def weight_bytes(fmt: str, O: int, K: int) -> int:
    if fmt in dense.QFORMATS:
        return O * quant.row_bytes(K, fmt)
    return O * K * dense.DTYPES[fmt].itemsize


def kernels(fmt: str, O: int, K: int, distance: int, copies: int) -> list:
    """One build's kernels over `copies` random weight matrices of format `fmt`."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(copies):
        w = torch.randn(O, K, generator=gen) * 0.02
        tuning = {"PF_BYTES": distance}
        if fmt in dense.QFORMATS:
            q = quant.interleave_blocks(quant.quantize(w, fmt), fmt)
            out.append(dense.quant_kernel_for(q, fmt, K, avx512=c.avx512_available(),
                                              tuning=tuning))
        else:
            w = w.to(dense.DTYPES[fmt])
            out.append(dense.dense_kernel_for(w, avx512=False, tuning=tuning))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--distances", default="0,1024,2048,4096,8192")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    distances = [int(v) for v in args.distances.split(",")]
    other = OtherLoad()
    probe = stream_probe(9)
    print(f"# dense kernel prefetch distance: {cpu_name()}, {args.threads} threads, "
          f"T={args.tokens}, default_tuning {dense.default_tuning()}\n")
    print("| format | O x K | layer | " + " | ".join(f"{d} B" for d in distances) + " |")
    print("|---|---|---|" + "---:|" * len(distances))
    for fmt in FORMATS:
        for name, O, K in SHAPES:
            nbytes = weight_bytes(fmt, O, K)
            copies = max(2, -(-COLD_BYTES // nbytes))
            built = {d: kernels(fmt, O, K, d, min(copies, 64)) for d in distances}
            x = torch.randn(args.tokens, K)
            calls = max(len(built[distances[0]]), 20 if O * K >= 1 << 24 else 200)
            times = {d: [] for d in distances}
            for _ in range(args.rounds):
                for d in distances:
                    ks = built[d]
                    t0 = time.perf_counter()
                    for i in range(calls):
                        ks[i % len(ks)](x)
                    times[d].append((time.perf_counter() - t0) / calls)
            print(f"| {fmt} | {O}x{K} | {name} | " + " | ".join(
                f"{nbytes / statistics.median(times[d]) / 1e9:.1f}" for d in distances) + " |",
                flush=True)
    print(f"\nGB/s of weight bytes (medians of {args.rounds} rounds); streaming read at the start: "
          f"{probe:.1f} GB/s")
    print(other.footer(stream_probe(9)))


if __name__ == "__main__":
    main()
