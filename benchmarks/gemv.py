"""Benchmark the dense decode GEMV (picompile/kernels/dense.c) against torch's F.linear.

    .venv/bin/python benchmarks/gemv.py            # SmolLM2 shapes, float32 and float16, 2 threads
    .venv/bin/python benchmarks/gemv.py --quick    # fewer calls

One token (x [1, K]) through W [O, K] for SmolLM2-135M's linear layers: q/o 576x576, k/v
192x576, up/gate 1536x576, down 576x1536, the LM head 49152x576. Reported: GB/s of weight bytes
read per call (O*K*itemsize / median time) for

  - "C":      the kernel as DenseLinear calls it (Python closure: x to float32, output allocated)
  - "torch":  F.linear(x, W) in the weights' dtype (what the dense model runs)

as medians ("best": the fastest call, what an unloaded machine gives) and microseconds per call;
"Python us" is the closure's cost over the bare ctypes call with preallocated buffers.

with weights read from memory, as in decoding a model much larger than the caches: each method
cycles over copies of W that together exceed the last-level cache ("cold"). The "C hot" column
repeats the kernel on one copy (cache-resident where it fits). Methods are interleaved in rounds
so that load from other processes hits all of them alike; the share of CPU time other processes
took during the run is printed. A streaming-read probe (torch sum of a 1 GB float32 tensor)
gives the machine's read bandwidth for reference.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from machine import COLD_BYTES, OtherLoad, stream_probe  # benchmarks/machine.py, beside this script
from picompile.codegen import dense

SHAPES = [  # (name, O, K)
    ("q_proj / o_proj", 576, 576),
    ("k_proj / v_proj", 192, 576),
    ("gate / up", 1536, 576),
    ("down", 576, 1536),
    ("lm_head", 49152, 576),
]
DTYPES = {"float32": torch.float32, "float16": torch.float16}


def time_calls(fns: dict, calls: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each fn, sorted (interleaved: `rounds` rounds of `calls` calls)."""
    times: dict[str, list] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()  # warm
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {k: sorted(v) for k, v in times.items()}


def cycler(items):
    state = {"i": 0}

    def nxt():
        i = state["i"]
        state["i"] = (i + 1) % len(items)
        return items[i]

    return nxt


def bench(O: int, K: int, dtype: str, tokens: list[int], calls: int,
          rounds: int) -> list[dict[str, float]]:
    """One result per token count: GB/s ("C", "torch", their "... best" and "... hot") and us."""
    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(0)
    nbytes = O * K * torch.empty((), dtype=dt).element_size()
    copies = max(2, -(-COLD_BYTES // nbytes))
    ws = [(torch.randn(O, K, generator=gen) * K**-0.5).to(dt) for _ in range(copies)]
    kernels = [dense.dense_kernel_for(w) for w in ws]
    if kernels[0] is None:
        raise SystemExit(f"no dense C kernel: {dense.why_no_kernel(ws[0])}")
    results = []
    for T in tokens:
        x = torch.randn(T, K, generator=gen)
        x_dt = x.to(dt)
        ref = F.linear(x.double(), ws[0].double())
        assert (kernels[0](x) - ref).abs().max() <= 1e-4 * ref.abs().max() + 1e-6

        lib = kernels[0].library_for(T)
        dense._set_threads(lib)
        out = torch.empty(T, O)
        raw = [(x.data_ptr(), T, K, w.data_ptr(), O, None, out.data_ptr()) for w in ws]
        next_k, next_w, next_raw = cycler(kernels), cycler(ws), cycler(raw)
        fns = {
            "C": lambda: next_k()(x),
            "C only": lambda: lib.pi_dense(*next_raw()),
            "torch": lambda: F.linear(x_dt, next_w()),
            "C hot": lambda: kernels[0](x),
            "torch hot": lambda: F.linear(x_dt, ws[0]),
        }
        t = time_calls(fns, calls, rounds)
        med = {k: statistics.median(v) for k, v in t.items()}
        results.append({k: nbytes / v / 1e9 for k, v in med.items()}
                       | {f"{k} best": nbytes / v[0] / 1e9 for k, v in t.items()}
                       | {"us": med["C"] * 1e6, "torch_us": med["torch"] * 1e6,
                          "overhead_us": (med["C"] - med["C only"]) * 1e6})
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer calls")
    ap.add_argument("--dtypes", default="float32,float16")
    ap.add_argument("--tokens", default="1", help="token counts, e.g. 1,4,8 (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    other = OtherLoad()

    k0 = dense.dense_kernel_for(torch.zeros(1, 1))
    print(f"# dense GEMV / small-T GEMM: {platform.processor() or platform.machine()}, "
          f"{args.threads} threads, torch {torch.__version__}, kernel "
          f"{k0.variant if k0 else 'unavailable'}\n")
    bw = stream_probe(5 if args.quick else 15)
    print(f"streaming read (torch sum of 1 GB float32): {bw:.1f} GB/s\n")
    print("| O x K | layer | dtype | T | C GB/s | torch GB/s | C / torch | C us | torch us "
          "| C best | torch best | C hot | torch hot | Python us |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    tokens = [int(t) for t in args.tokens.split(",")]
    for dtype in args.dtypes.split(","):
        for name, O, K in SHAPES:
            big = O * K >= 1 << 24
            calls = max(3, (10 if big else 100) // (3 if args.quick else 1))
            rounds = 3 if args.quick else 8
            for T, r in zip(tokens, bench(O, K, dtype, tokens, calls, rounds)):
                print(f"| {O} x {K} | {name} | {dtype} | {T} | {r['C']:.1f} | {r['torch']:.1f} | "
                      f"{r['C'] / r['torch']:.2f}x | {r['us']:.0f} | {r['torch_us']:.0f} | "
                      f"{r['C best']:.1f} | {r['torch best']:.1f} | {r['C hot']:.1f} | "
                      f"{r['torch hot']:.1f} | {r['overhead_us']:.1f} |", flush=True)
    print(other.footer(stream_probe(5)))


if __name__ == "__main__":
    main()
