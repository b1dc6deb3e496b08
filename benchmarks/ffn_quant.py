"""Benchmark the sparse FFN C kernel on quantized weights (q8_0, q4_0, q4_1) against float16 / float32.

    .venv/bin/python benchmarks/ffn_quant.py            # both shapes, 2 threads
    .venv/bin/python benchmarks/ffn_quant.py --quick    # fewer calls

Blocks: gated SiLU, no bias, SmolLM2-135M-shaped (d=576, n_ff=1536) and Llama-7B-shaped
(d=4096, n_ff=11008); random weights (float32, then converted / quantized with quant.quantize);
one token (T=1). Modes:

  - exact:  threshold 0; with SiLU every neuron fires, so the kernel reads every row (dense)
  - ~50%:   a threshold at the median of |h| over this format's (dequantized) weights for this x,
            so about half the neurons fire (reported: the fraction that did)

Bytes read per call, from the kernel's access pattern (gated SiLU reads every gate and up row,
and the down rows of the neurons that fired): (2 * n_ff + active) * row bytes, with row bytes
d * itemsize for float weights and d / 32 * block bytes (34 / 18 / 20) for q8_0 / q4_0 / q4_1.
"GB/s" is that over the median time of the bare ctypes call `ffn()` with preallocated buffers
(what the whole-step decoder calls); "us" is that time, "closure us" the time of the Python
kernel SparseFFN.forward calls. "vs f32" / "vs f16": float32 / float16 time over this format's
(>1: faster) in the same mode.

Weights are read from memory, as in decoding a model larger than the caches: each format cycles
over copies of its block that together exceed the 32 MiB L3 (at least 256 MB). Formats are
interleaved in rounds so that load from other processes hits all alike; the share of CPU time
other processes took is printed, and a streaming-read probe (torch sum of 1 GB) before and after.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch

from machine import COLD_BYTES, OtherLoad, cpu_name, stream_probe  # benchmarks/machine.py, beside this script
from picompile import quant
from picompile.codegen import c as c_codegen
from picompile.plan import BlockPlan
from picompile.runtime.sparse_ffn import SparseFFN, down_input

SHAPES = {"SmolLM2": (576, 1536), "Llama-7B": (4096, 11008)}  # name: (d, n_ff), gated SiLU
FORMATS = ["float32", "float16", "q8_0", "q4_0", "q4_1"]


class Subject:
    """One format of one block: copies of its weights (enough to leave the caches), their
    kernels, and the raw ffn() argument tuples."""

    def __init__(self, fmt: str, d: int, n_ff: int, ws: dict, x: torch.Tensor):
        self.fmt, self.d, self.n_ff = fmt, d, n_ff
        bp = BlockPlan(name="ffn", module="m", kind="gated", act="silu", d_model=d, d_ff=n_ff,
                       bias=False, dtype="float32")
        if fmt in quant.FORMATS:
            base = {k: quant.quantize(w, fmt) for k, w in ws.items()}
            qformat = fmt
        else:
            base = {k: w.to(getattr(torch, fmt)) for k, w in ws.items()}
            qformat = None
        one = sum(t.numel() * t.element_size() for t in base.values())
        copies = max(2, -(-COLD_BYTES // one))
        self.ffns = []
        for i in range(copies):
            w = base if i == 0 else {k: t.clone() for k, t in base.items()}
            self.ffns.append(SparseFFN(bp, w["w_up"], w["w_down_t"], w_gate=w["w_gate"],
                                       qformat=qformat))
        self.kernels = [c_codegen.kernel_for(f) for f in self.ffns]
        if self.kernels[0] is None:
            raise SystemExit(f"no C kernel: {c_codegen.why_no_kernel(self.ffns[0])}")
        self.row_bytes = self.ffns[0].row_bytes
        self.lib = self.kernels[0].library
        self.x = x.contiguous()
        self.out = torch.empty(1, d)
        self.n_active = c_codegen.ctypes.c_int64(0)
        f0 = self.ffns[0]
        ref = f0.weights()
        self.h = down_input(x, ref["w_up"], w_gate=ref["w_gate"], act="silu",
                            qformat=ref["qformat"])  # [1, n_ff], this format's weights
        self.i = 0

    def threshold(self, mode: str) -> float:
        if mode == "exact":
            return 0.0
        v = self.h.abs().flatten().sort().values  # midway between the two middle values
        return float(v[len(v) // 2 - 1] + v[len(v) // 2]) / 2

    def check(self, thr: float) -> int:
        """The kernel against the reference on copy 0; the active count."""
        out, n_active = self.kernels[0](self.x, thr)
        ref, active = _ref(self.ffns[0], self.x, thr)
        # float32 sums in another order: a neuron within rounding of the threshold may flip
        assert abs(n_active - int(active.sum())) <= 2, (n_active, int(active.sum()))
        if n_active == int(active.sum()):
            err = float((out - ref).abs().max())
            assert err <= 1e-4 * float(ref.abs().max()) + 1e-5, err
        return n_active

    def raw_call(self, thr: float):
        k = self.kernels[self.i]
        self.i = (self.i + 1) % len(self.kernels)
        self.lib.ffn(self.x.data_ptr(), 1, self.d, self.n_ff, *k.pointers(), None, 0, None,
                     thr, self.out.data_ptr(), c_codegen.ctypes.byref(self.n_active))

    def closure_call(self, thr: float):
        k = self.kernels[self.i]
        self.i = (self.i + 1) % len(self.kernels)
        k(self.x, thr)


def _ref(ffn: SparseFFN, x: torch.Tensor, thr: float):
    old, ffn.threshold = ffn.threshold, thr
    try:
        return ffn.forward_native(x)
    finally:
        ffn.threshold = old


def bench_shape(name: str, calls: int, rounds: int, formats: list[str]) -> list[dict]:
    d, n_ff = SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    ws = {k: torch.randn(n_ff, d, generator=gen) * d**-0.5 for k in ("w_gate", "w_up", "w_down_t")}
    x = torch.randn(1, d, generator=gen)
    subjects = [Subject(fmt, d, n_ff, ws, x) for fmt in formats]
    del ws
    rows = []
    for mode in ("exact", "~50%"):
        thr = {s.fmt: s.threshold(mode) for s in subjects}
        active = {s.fmt: s.check(thr[s.fmt]) for s in subjects}
        for s in subjects:
            c_codegen._set_threads(s.lib)
        raw = {s.fmt: [] for s in subjects}
        closure = {s.fmt: [] for s in subjects}
        for _ in range(rounds):
            for s in subjects:
                t = thr[s.fmt]
                s.raw_call(t)  # warm
                for _ in range(calls):
                    t0 = time.perf_counter()
                    s.raw_call(t)
                    raw[s.fmt].append(time.perf_counter() - t0)
                for _ in range(max(1, calls // 4)):
                    t0 = time.perf_counter()
                    s.closure_call(t)
                    closure[s.fmt].append(time.perf_counter() - t0)
        med = {f: statistics.median(v) for f, v in raw.items()}
        for s in subjects:
            nbytes = (2 * n_ff + active[s.fmt]) * s.row_bytes
            rows.append(dict(block=f"{name} {d}x{n_ff}", fmt=s.fmt, mode=mode,
                             active=active[s.fmt] / n_ff, mb=nbytes / 1e6,
                             us=med[s.fmt] * 1e6, closure_us=statistics.median(closure[s.fmt]) * 1e6,
                             gbs=nbytes / med[s.fmt] / 1e9,
                             best=nbytes / min(raw[s.fmt]) / 1e9,
                             vs32=med.get("float32", float("nan")) / med[s.fmt],
                             vs16=med.get("float16", float("nan")) / med[s.fmt]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer calls")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--formats", nargs="*", default=FORMATS, choices=FORMATS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    other = OtherLoad()
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, {cpu_name()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, threads={args.threads}, T=1, "
          f"build flags {' '.join(c_codegen.ffn_flags())}\n")
    print(f"streaming read (torch sum of 1 GB float32): {stream_probe(5 if args.quick else 15):.1f} GB/s\n")
    print("| block | weights | mode | fired | MB read | us | GB/s | best GB/s | vs f32 | vs f16 "
          "| closure us |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.shapes:
        big = SHAPES[name][0] >= 4096
        calls = (4 if big else 40) // (2 if args.quick else 1)
        rounds = 3 if args.quick else 8
        for r in bench_shape(name, calls, rounds, args.formats):
            print(f"| {r['block']} | {r['fmt']} | {r['mode']} | {r['active']:.0%} | {r['mb']:.1f} "
                  f"| {r['us']:.0f} | {r['gbs']:.1f} | {r['best']:.1f} | {r['vs32']:.2f}x "
                  f"| {r['vs16']:.2f}x | {r['closure_us']:.0f} |", flush=True)
    print(other.footer(stream_probe(5)))


if __name__ == "__main__":
    main()
