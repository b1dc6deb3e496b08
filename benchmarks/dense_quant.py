"""Benchmark the dense kernel on quantized weights (q8_0 / q4_0 / q4_1) against its float16 and
float32 builds, in GB/s of weight bytes read.

    .venv/bin/python benchmarks/dense_quant.py           # SmolLM2 shapes, T=1, 2 threads
    .venv/bin/python benchmarks/dense_quant.py --quick   # fewer calls
    .venv/bin/python benchmarks/dense_quant.py --isa     # quantized rows also forced AVX2 / AVX-512
    .venv/bin/python benchmarks/dense_quant.py --base 8795319  # and that revision's dense.c
    .venv/bin/python benchmarks/dense_quant.py --hot     # one copy of W: the compute ceiling

One token (x [1, K]) through W [O, K] for SmolLM2-135M's LM head (49152x576) and its q/o
(576x576), gate/up (1536x576) and down (576x1536) projections, the build picompile selects for
T=1, cycling over copies of W that together exceed the last-level cache ("cold": the weights
come from memory, as in decoding a model much larger than the caches). Each kernel is timed two
ways: "C" calls it back to back from C (benchmarks/call_timer.c), as the whole-step decoder
does, so the time is the kernel's own; "ctypes" is the bare ctypes call from Python with
preallocated buffers, about a microsecond more per call, which weighs on the small shapes.
Bytes are the weight matrix as stored: O*K*4 (float32), O*K*2 (float16), O*K/32 * 34 / 18 / 20
(q8_0 / q4_0 / q4_1, scales included). Methods are interleaved in rounds so that load from other
processes hits all of them alike; reported are medians ("best": the fastest call) and the share
of CPU time other processes took during the run. "% BW" is from the C timing. With --base REV
each quantized format is also timed with the dense.c and qblocks.h of git revision REV, built
with the same flags ("base" rows), in the same rounds. --hot times one copy of each W, so the
weights come from the caches where they fit: what the kernel computes per second, not a
decoding figure.

Memory bandwidth: benchmarks/gemv.py's streaming-read probe (torch sum of a 1 GB float32 tensor)
at the start and the end of the run; "% BW" is a format's median GB/s over the higher of the two.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pathlib
import statistics

import torch

from gemv import cycler, time_calls  # benchmarks/gemv.py, beside this script
from machine import COLD_BYTES, OtherLoad, cpu_name, kernel_source_at, stream_probe
from picompile import quant
from picompile.codegen import c as c_codegen
from picompile.codegen import dense
from picompile.codegen.decoder import function_pointer

SHAPES = [  # (name, O, K)
    ("lm_head", 49152, 576),
    ("q_proj / o_proj", 576, 576),
    ("gate / up", 1536, 576),
    ("down", 576, 1536),
]
FLOATS = {"float32": torch.float32, "float16": torch.float16}


def base_library(fmt: str, avx512: bool, rev: str) -> ctypes.CDLL:
    """The dense kernel of git revision `rev` for `fmt`, built with this tree's flags."""
    src = kernel_source_at(rev, "dense.c")
    lib = ctypes.CDLL(str(c_codegen.build_library(src, dense.flags(fmt, avx512), "bench-base")))
    lib.pi_dense.argtypes = dense._DENSE_ARGTYPES
    lib.pi_dense.restype = None
    lib.pi_dense_variant.restype = ctypes.c_char_p
    lib.pi_set_num_threads.argtypes = [ctypes.c_int]
    lib._pi_threads = None  # as codegen.dense's loader leaves it (dense._set_threads)
    return lib


class BaseKernel:
    """What bench() needs of a kernel: the library for one token, and the weight."""

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor):
        self.lib, self.weight = lib, weight

    def library_for(self, T: int) -> ctypes.CDLL:
        return self.lib


def methods(O: int, K: int, isa: bool, base: str | None, hot: bool) -> list[tuple[str, str, int, list]]:
    """(format, build, bytes of W, [(kernel, W copy), ...]) for every format (and build)."""
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(O, K, generator=gen) * K**-0.5
    out = []

    def copies_of(w: torch.Tensor) -> list[torch.Tensor]:
        n = 1 if hot else max(2, -(-COLD_BYTES // w.nbytes))
        return [w] + [w.clone() for _ in range(n - 1)]

    for name, dt in FLOATS.items():
        w = W.to(dt)
        copies = copies_of(w)
        out.append((name, "", w.nbytes, [(dense.dense_kernel_for(c), c) for c in copies]))
    for fmt in dense.QFORMATS:
        q = quant.interleave_blocks(quant.quantize(W, fmt), fmt)  # the kernel's layout
        copies = copies_of(q)
        builds = [("", None)]  # the build picompile selects for T=1
        if isa:
            wide = [("forced", True)] if c_codegen.avx512_available() else []
            builds += [("forced", False)] + wide
        for label, avx512 in builds:
            kernels = [(dense.quant_kernel_for(c, fmt, K, avx512=avx512), c) for c in copies]
            out.append((fmt, label, q.nbytes, kernels))
        if base:  # the base revision's kernel, as the selected build, on copies of its own
            # (on the same copies it would find in the caches what the kernel before it read)
            wide = "avx512" in out[-len(builds)][3][0][0].library_for(1).pi_dense_variant().decode()
            lib = base_library(fmt, wide, base)
            out.append((fmt, "base", q.nbytes, [(BaseKernel(lib, c), c) for c in copies_of(q.clone())]))
    return out


def call_timer() -> ctypes.CDLL:
    """benchmarks/call_timer.c, built with the kernels' compiler and flags."""
    src = (pathlib.Path(__file__).parent / "call_timer.c").read_text()
    lib = ctypes.CDLL(str(c_codegen.build_library(src, c_codegen.build_flags(), "bench-timer")))
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.pi_time_dense.argtypes = [vp, ctypes.c_int, vp, i64, i64, vp, ctypes.c_int, i64, vp, vp]
    lib.pi_time_dense.restype = None
    return lib


def time_in_c(timer, lib, x, K: int, weights: list, O: int, out, calls: int) -> list[float]:
    """Seconds of `calls` back-to-back calls of lib.pi_dense from C, cycling over `weights`."""
    ptrs = (ctypes.c_void_p * len(weights))(*[w.data_ptr() for w in weights])
    seconds = (ctypes.c_double * calls)()
    timer.pi_time_dense(function_pointer(lib.pi_dense), calls, x.data_ptr(), 1, K, ptrs,
                        len(weights), O, out.data_ptr(), seconds)
    return list(seconds)


def bench(O: int, K: int, calls: int, rounds: int, isa: bool, base: str | None,
          hot: bool) -> list[dict]:
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(1))
    out = torch.empty(1, O)
    fns, info, in_c = {}, {}, {}
    timer = call_timer()
    alive = methods(O, K, isa, base, hot)  # the weights the raw calls below read by pointer
    for fmt, label, nbytes, kernels in alive:
        k0 = kernels[0][0]
        if k0 is None:
            raise SystemExit(f"no dense C kernel for {fmt}")
        lib = k0.library_for(1)
        dense._set_threads(lib)
        raw = [(x.data_ptr(), 1, K, k.weight.data_ptr(), O, None, out.data_ptr())
               for k, _ in kernels]
        nxt = cycler(raw)
        key = f"{fmt} {label} {len(fns)}"
        fns[key] = (lambda f=lib.pi_dense, n=nxt: f(*n()))
        in_c[key] = (lib, [c for _, c in kernels])
        variant = lib.pi_dense_variant().decode().split()[-1] + (f" ({label})" if label else "")
        info[key] = (fmt, variant, nbytes)
    times = time_calls(fns, calls, rounds)
    c_times = {key: [] for key in fns}
    for _ in range(rounds):  # interleaved too
        for key, (lib, weights) in in_c.items():
            c_times[key] += time_in_c(timer, lib, x, K, weights, O, out, calls)
    rows = []
    for key, t in times.items():
        fmt, variant, nbytes = info[key]
        med, c_med = statistics.median(t), statistics.median(c_times[key])
        rows.append(dict(format=fmt, build=variant, bytes=nbytes, gbs=nbytes / c_med / 1e9,
                         best=nbytes / min(c_times[key]) / 1e9, us=c_med * 1e6,
                         ctypes_gbs=nbytes / med / 1e9, ctypes_us=med * 1e6))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer calls")
    ap.add_argument("--isa", action="store_true",
                    help="also time each quantized format's AVX2 and AVX-512 builds")
    ap.add_argument("--base", metavar="REV",
                    help="also time the quantized formats with git revision REV's dense.c")
    ap.add_argument("--hot", action="store_true",
                    help="one copy of each weight: from the caches where it fits (compute ceiling)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    other = OtherLoad()
    print(f"# dense kernel, quantized vs float weights: {cpu_name()}, {os.cpu_count()} CPUs, {args.threads} threads, "
          f"T=1, torch {torch.__version__}{', HOT: weights from the caches where they fit' if args.hot else ''}\n")
    bw0 = stream_probe(5 if args.quick else 15)
    print(f"streaming read (torch sum of 1 GB float32): {bw0:.1f} GB/s\n")
    results = []
    for name, O, K in SHAPES:
        big = O * K >= 1 << 24
        calls = max(3, (10 if big else 100) // (3 if args.quick else 1))
        rounds = 3 if args.quick else 8
        results.append((name, O, K, bench(O, K, calls, rounds, args.isa, args.base, args.hot)))
    bw1 = stream_probe(5 if args.quick else 15)
    bw = max(bw0, bw1)
    print("| O x K | layer | format | build | MB | C GB/s | best | C us | % BW | ctypes GB/s | ctypes us |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, O, K, rows in results:
        for r in rows:
            print(f"| {O}x{K} | {name} | {r['format']} | {r['build']} | {r['bytes'] / 1e6:.2f} | "
                  f"{r['gbs']:.1f} | {r['best']:.1f} | {r['us']:.0f} | "
                  f"{100 * r['gbs'] / bw:.0f}% | {r['ctypes_gbs']:.1f} | {r['ctypes_us']:.0f} |")
    print(other.footer(bw1))


if __name__ == "__main__":
    main()
