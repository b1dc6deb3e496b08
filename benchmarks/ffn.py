"""Benchmark one FFN block at decode (batch 1): dense PyTorch against the sparse C kernel.

    .venv/bin/python benchmarks/ffn.py            # full run (a few minutes)
    .venv/bin/python benchmarks/ffn.py --quick    # fewer repeats, fewer sparsity levels

Shapes: LLaMA-7B (d=4096, n_ff=11008, gated, relu, no bias) and OPT-6.7B (d=4096, n_ff=16384,
plain, relu, biases), weights in float32 and float16. The activation sparsity is planted exactly:
x is drawn first, then gate rows (up rows for the plain block) are sign-flipped so that exactly
the target fraction of pre-activations is <= 0.

Reported per row: dense torch time (F.linear chain in the weights' dtype), the exact-mode C kernel
time, their ratio (and the ratio against dense float32, since torch float16 matmuls on CPU can be
slow), and the C kernel's effective bandwidth: the bytes it must read (gate rows all, up and down
rows of the active neurons; plain: up rows all, down rows of the active ones) over its time, next
to the bandwidth a dense float32 matvec (F.linear of a 4096 x 11008 matrix) reaches.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from picompile.codegen import c as c_codegen  # noqa: E402
from picompile.plan import BlockPlan  # noqa: E402
from picompile.runtime.sparse_ffn import SparseFFN  # noqa: E402

from machine import OtherLoad, cpu_name  # noqa: E402  (benchmarks/machine.py, beside this script)

SHAPES = {
    # name: (d, n_ff, kind, bias)
    "LLaMA-7B": (4096, 11008, "gated", False),
    "OPT-6.7B": (4096, 16384, "plain", True),
}
DTYPES = {"float32": torch.float32, "float16": torch.float16}


def median_time(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def plant(w: torch.Tensor, x: torch.Tensor, b: torch.Tensor | None, density: float, gen):
    """Sign-flip rows of w (and entries of b) in place so that exactly round(density * n) of the
    pre-activations w x + b are positive; returns that count."""
    n = w.shape[0]
    pre = (w.float() @ x.float().reshape(-1)) + (0 if b is None else b.float())
    k = round(density * n)
    want = torch.zeros(n, dtype=torch.bool)
    want[torch.randperm(n, generator=gen)[:k]] = True
    flip = (want & (pre <= 0)) | (~want & (pre > 0))
    w[flip] = -w[flip]
    if b is not None:
        b[flip] = -b[flip]
    return k


def dense_matvec_bandwidth(repeats: int) -> tuple[float, float]:
    """(seconds, GB/s) of F.linear(x [1, 4096], W [11008, 4096]) in float32."""
    w = torch.randn(11008, 4096) * 0.02
    x = torch.randn(1, 4096)
    t = median_time(lambda: F.linear(x, w), repeats)
    return t, w.numel() * 4 / t / 1e9


def bench_block(name: str, dtype: str, sparsities, repeats: int, dense_times):
    d, n_ff, kind, bias = SHAPES[name]
    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, d, generator=gen)
    scale = d**-0.5

    def rnd(*shape):
        return torch.randn(*shape, generator=gen) * scale

    # Weights in the benchmarked dtype; planting flips signs, which is exact in every dtype.
    w_up = rnd(n_ff, d).to(dt)
    w_down_t = rnd(n_ff, d).to(dt)
    w_gate = rnd(n_ff, d).to(dt) if kind == "gated" else None
    b_up = rnd(n_ff).to(dt) if bias else None
    b_down = rnd(d).to(dt) if bias else None
    ws = dict(w_up=w_up, w_down_t=w_down_t, w_gate=w_gate, b_up=b_up, b_down=b_down)
    bp = BlockPlan(name=name, module=name, kind=kind, act="relu", d_model=d, d_ff=n_ff,
                   bias=bias, dtype=dtype)
    rows = []
    for sp in sparsities:
        other = OtherLoad()
        k = plant(w_gate if kind == "gated" else w_up, x, None if kind == "gated" else b_up,
                  1.0 - sp, gen)
        ffn = SparseFFN(bp, w_up, w_down_t, w_gate=w_gate, b_up=b_up, b_down=b_down)
        kernel = c_codegen.kernel_for(ffn)
        if kernel is None:
            raise SystemExit("no C kernel (compiler missing or build failed); see the warning above")
        out, n_active = kernel(x, 0.0)
        # The kernel sums in another order than the planting matmul: a pre-activation within
        # rounding of 0 may land on the other side. Report the kernel's own count.
        assert abs(n_active - k) <= max(2, k // 500), (n_active, k)

        t_c = median_time(lambda: kernel(x, 0.0), repeats)

        # Dense torch: the F.linear chain the model would run, in this dtype and in float32.
        def dense_fn(dtd):
            wg = None if w_gate is None else ws["w_gate"].to(dtd)
            wu = ws["w_up"].to(dtd)
            wd = ws["w_down_t"].to(dtd).t().contiguous()  # down projection weight [d, n_ff]
            bu = None if b_up is None else ws["b_up"].to(dtd)
            bd = None if b_down is None else ws["b_down"].to(dtd)
            xd = x.to(dtd)
            if wg is not None:
                return lambda: F.linear(F.relu(F.linear(xd, wg)) * F.linear(xd, wu), wd)
            return lambda: F.linear(F.relu(F.linear(xd, wu, bu)), wd, bd)

        # Measured next to each C timing (not once per block): on a shared machine the load
        # drifts, and paired measurements keep the ratios honest.
        f = dense_fn(dt)
        t_dense = median_time(f, repeats)
        del f
        if dt == torch.float32:
            t_dense32 = t_dense
        else:
            f = dense_fn(torch.float32)
            t_dense32 = median_time(f, repeats)
            del f
        dense_times[(name, dtype)].append(t_dense)
        dense_times[(name, "float32")].append(t_dense32)

        es = torch.empty((), dtype=dt).element_size()
        if kind == "gated":
            nbytes = n_ff * d * es + n_active * 2 * d * es
        else:
            nbytes = n_ff * d * es + n_active * d * es
        rows.append(dict(model=name, dtype=dtype, sparsity=sp, active=n_active, n_ff=n_ff,
                         dense_ms=t_dense * 1e3, c_ms=t_c * 1e3, ratio=t_c / t_dense,
                         ratio32=t_c / t_dense32, gbs=nbytes / t_c / 1e9, mb=nbytes / 1e6,
                         other=other.fraction()))
        del ffn, kernel
    return rows


def pct(v: float | None) -> str:
    return "?" if v is None else f"{v:.0%}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats, sparsity 90%% only")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement")
    ap.add_argument("--threads", type=int, default=2, help="torch (and C kernel) threads")
    ap.add_argument("--models", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    args = ap.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 15)
    sparsities = [0.9] if args.quick else [0.5, 0.8, 0.9, 0.95]
    torch.set_num_threads(args.threads)

    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, {cpu_name()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, threads={args.threads}, "
          f"median of {repeats}")
    probe = OtherLoad()
    time.sleep(1.0)
    busy = probe.fraction()
    print(f"CPU used by other processes in the second before the run: {pct(busy)}"
          + ("  (WARNING: the machine is busy; 2-thread timings suffer most)"
             if busy is not None and busy > 0.1 else ""))
    print("dense float32 matvec (F.linear, 11008x4096) is measured before each block; "
          "'% of matvec' compares the C kernel's GB/s with it.\n")

    print("| block | weights | sparsity | active | dense torch ms | C kernel ms | C / dense "
          "| C / dense fp32 | C reads MB | C GB/s | matvec GB/s | % of matvec | other procs CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    dense_times = collections.defaultdict(list)
    slow_fp16 = False
    for name in args.models:
        for dtype in args.dtypes:
            _, bw_mv = dense_matvec_bandwidth(repeats)
            for r in bench_block(name, dtype, sparsities, repeats, dense_times):
                print(f"| {r['model']} | {r['dtype']} | {r['sparsity']:.0%} | {r['active']} "
                      f"| {r['dense_ms']:.2f} | {r['c_ms']:.2f} | {r['ratio']:.2f}x "
                      f"| {r['ratio32']:.2f}x | {r['mb']:.0f} | {r['gbs']:.1f} "
                      f"| {bw_mv:.1f} | {r['gbs'] / bw_mv:.0%} | {pct(r['other'])} |",
                      flush=True)
            if dtype == "float16":
                t16 = statistics.median(dense_times[(name, "float16")])
                t32 = statistics.median(dense_times[(name, "float32")])
                slow_fp16 |= t16 > 0.75 * t32
    if slow_fp16:
        print("\nNote: dense torch float16 on this CPU is not faster than float32 although it reads "
              "half the bytes (no fast fp16 GEMV path), so 'C / dense' flatters the float16 rows; "
              "'C / dense fp32' compares against the faster dense baseline.")


if __name__ == "__main__":
    main()
