"""Benchmark the sparse FFN C kernel's gather of scattered rows (predicted mode, one token) on a
Llama-7B-shaped gated ReLU block, in GB/s of the weight bytes it actually reads, next to a
streaming read; optionally against the kernel source of another git revision, in the same process.

    .venv/bin/python benchmarks/ffn_rows.py                             # this tree's kernel
    .venv/bin/python benchmarks/ffn_rows.py --kernels base new --base a2d4f38 --rounds 8
    .venv/bin/python benchmarks/ffn_rows.py --kernels new new:PIC_PF_ROWS=4  # a tuning knob
    .venv/bin/python benchmarks/ffn_rows.py --kernels new new@huge    # weights in 4 KB / 2 MB pages

The block: d 4096, n_ff 11008 (--shape smollm2: 576, 1536), gated ReLU, no bias, random weights;
formats q4_0 (gate / up rows in the dot layout, down rows q8_0, as `quantize="q4_0"` makes them)
and float16. One token x; the candidates are what a predictor hands the kernel (a mask [1, n_ff],
the decoder's path): at density p, p * n_ff neurons, 90% of them drawn from the neurons whose gate
fires for x and 10% from the others (a predictor with 90% precision; the planted model's
predictors predict about 11% where 10% fire). Their order is the neurons' (the kernel walks them
ascending). Density 1 is exact mode: no mask, every gate row read in order.

Bytes read per call: every candidate's gate row, and the up and down rows of those whose gate
fired (the kernel's access pattern for gated ReLU), with row bytes d / 32 * 18 (q4_0), d / 32 *
34 (q8_0 down) or d * 2 (float16). "GB/s" is that over the median time of the bare ctypes call
`ffn()`; "of the round's probe": the median over rounds of its GB/s in a round against the
streaming probe measured at that round's start (the VM's memory speed drifts within minutes,
so a probe before and after is too far from most calls); each (format, density) cycles over copies of its block that together exceed the
32 MiB L3 (at least 256 MB), so rows come from memory as in decoding a large model.

Kernels: `new` is this tree's picompile/kernels/ffn.c; `base` the ffn.c and qblocks.h of the git
revision --base (built with this tree's variant header); `NAME:K=V,K=V` adds -D tuning knobs
(codegen.c.source's `tuning`); `NAME+vnni` builds with -mavx512f/vl/bw/vnni added (AVX-512
VNNI integer dots, 32 vector registers); `NAME+avx2` without the -mavx512f that
codegen.c.ffn_flags adds where the CPU has AVX-512F (the down rows' AVX2 path); `NAME@huge`
runs NAME on copies of the weights in transparent huge pages (picompile.runtime.memory, as
compile places them), the others on copies in the allocator's ordinary 4 KB pages. `rows`
(`rows:PF=2`: software prefetch 2 candidates ahead) is no kernel: benchmarks/row_reader.c reads
the very rows the kernel reads and only XORs them, so its GB/s is what that access pattern gets
from memory on these threads. Kernels run in alternating order within each round
(A B A B ...) so that other processes' load hits all alike; each kernel's output is checked
against the first one's. Printed: the streaming-read probe before and after, and the share of
CPU time other processes used. On a machine other processes keep busy, set
OMP_WAIT_POLICY=PASSIVE (README): with spinning OpenMP threads a call whose second thread is
descheduled waits for a time slice, and the medians measure the scheduler.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import statistics
import time

import torch

from machine import (COLD_BYTES, REPO, OtherLoad, cpu_name, kernel_source_at,
                     stream_probe)  # benchmarks/machine.py
from picompile.codegen import c as c_codegen
from picompile.plan import BlockPlan
from picompile.runtime import memory
from picompile.runtime.sparse_ffn import SparseFFN, down_input

SHAPES = {"llama7b": (4096, 11008), "smollm2": (576, 1536)}  # (d, n_ff)
D, N_FF = SHAPES["llama7b"]  # the shape measured (--shape)


def kernel_source(v: c_codegen.Variant, spec: str, base: str) -> str:
    """The generated source of variant v for a kernel spec ("new", "base"; ":K=V,..." knobs)."""
    name, _, knobs = spec.partition(":")
    name = name.removesuffix("+vnni").removesuffix("+avx2")
    tuning = {k: int(val) for k, val in (kv.split("=") for kv in knobs.split(",") if kv)}
    src = c_codegen.source(v, tuning)
    if name == "base":
        src = src.replace(c_codegen.package_source("ffn.c"), kernel_source_at(base, "ffn.c"))
    elif name != "new":
        raise SystemExit(f"unknown kernel {spec!r}: base or new, with :K=V knobs")
    return src


def is_reader(spec: str) -> bool:
    """`rows` (benchmarks/row_reader.c): the same rows read with no arithmetic."""
    return spec.partition(":")[0].removesuffix("@huge") == "rows"


def load_reader() -> ctypes.CDLL:
    src = open(os.path.join(REPO, "benchmarks", "row_reader.c")).read()
    lib = ctypes.CDLL(str(c_codegen.build_library(src, c_codegen.build_flags(), "row reader")))
    lib.read_rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.read_rows.restype = None
    return lib


def load_kernel(v: c_codegen.Variant, spec: str, base: str) -> ctypes.CDLL:
    flags = c_codegen.ffn_flags()
    if "+avx2" in spec.partition(":")[0]:
        flags = c_codegen.build_flags()
    if "+vnni" in spec.partition(":")[0]:
        flags = flags + ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni"]
    path = c_codegen.build_library(kernel_source(v, spec, base), flags, "picompile-c bench")
    lib = ctypes.CDLL(str(path))
    lib.ffn.argtypes = c_codegen._FFN_ARGTYPES
    lib.ffn.restype = None
    lib.pic_set_num_threads.argtypes = [ctypes.c_int]
    return lib


class Subject:
    """One format: copies of the block's weights (enough to leave the caches)."""

    def __init__(self, fmt: str, ws: dict, hot: bool = False):
        self.fmt = fmt
        bp = BlockPlan(name="ffn", module="m", kind="gated", act="relu", d_model=D, d_ff=N_FF,
                       bias=False, dtype="float32")
        if fmt == "q4_0":
            f = SparseFFN(bp, ws["w_up"], ws["w_down_t"], w_gate=ws["w_gate"])
            f.quantize_("q4_0", "q8_0")
            base = {k: getattr(f, k).detach() for k in ("w_gate", "w_up", "w_down_t")}
        else:
            base = {k: w.to(getattr(torch, fmt)) for k, w in ws.items()}
        self.variant = c_codegen.Variant(
            fmt, gated=True, drelu=False, bias=False, act="relu",
            down_dtype="q8_0" if fmt == "q4_0" else fmt)
        one = sum(t.numel() * t.element_size() for t in base.values())
        copies = 1 if hot else max(2, -(-COLD_BYTES // one))
        self.copies = [base] + [{k: t.clone() for k, t in base.items()} for _ in range(copies - 1)]
        self.huge = [{k: memory.huge_page_copy(t) for k, t in c.items()} for c in self.copies]
        self.gate_bytes = self.variant.row_bytes(D)
        self.down_bytes = self.variant.row_bytes(D, self.variant.down_dtype)
        self.ref = f if fmt == "q4_0" else SparseFFN(bp, base["w_up"], base["w_down_t"],
                                                      w_gate=base["w_gate"])
        self.i = 0

    def h(self, x: torch.Tensor) -> torch.Tensor:
        """h = relu(gate x) * up x [n_ff] of this format's weights (x rounded as the kernel
        rounds it): nonzero where the gate fires."""
        r = self.ref
        h = down_input(x, r.w_up, w_gate=r.w_gate, act="relu", qformat=r.qformat)
        return h[0]


def candidates(fires: torch.Tensor, density: float, gen: torch.Generator) -> torch.Tensor | None:
    """mask [1, n_ff] bool: density * n_ff neurons, 90% among `fires`, 10% among the others;
    None (exact mode: every neuron a candidate) at density 1."""
    if density >= 1:
        return None
    m = int(round(density * N_FF))
    on, off = fires.nonzero().flatten(), (~fires).nonzero().flatten()
    k_on = min(len(on), int(round(0.9 * m)))
    pick = torch.cat([on[torch.randperm(len(on), generator=gen)[:k_on]],
                      off[torch.randperm(len(off), generator=gen)[:m - k_on]]])
    mask = torch.zeros(1, N_FF, dtype=torch.bool)
    mask[0, pick] = True
    return mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", nargs="+", default=["new"])
    ap.add_argument("--base", default="a2d4f38", help="git revision of the `base` kernel")
    ap.add_argument("--formats", nargs="+", default=["q4_0", "float16"])
    ap.add_argument("--densities", nargs="+", type=float, default=[0.1, 0.5],
                    help="predicted share of the neurons; 1: exact mode (no mask)")
    ap.add_argument("--shape", choices=list(SHAPES), default="llama7b")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=8, help="timed calls per kernel per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hot", action="store_true",
                    help="one copy of the weights: the rows read stay in the caches (the "
                         "kernel's compute ceiling, not a decoding figure)")
    args = ap.parse_args()
    global D, N_FF
    D, N_FF = SHAPES[args.shape]
    torch.set_num_threads(args.threads)
    other = OtherLoad()
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, {cpu_name()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, threads={args.threads}, T=1, "
          f"d={D}, n_ff={N_FF}, gated ReLU, predicted (mask), "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, build flags "
          f"{' '.join(c_codegen.ffn_flags())}, kernels {args.kernels} (base = {args.base})"
          f"{', HOT: rows from the caches' if args.hot else ''}")
    print(f"streaming read (torch sum of 1 GB float32): {stream_probe(15):.1f} GB/s\n", flush=True)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, D, generator=gen)
    subjects = []
    for fmt in args.formats:
        ws = {k: torch.randn(N_FF, D, generator=gen) * D**-0.5
              for k in ("w_gate", "w_up", "w_down_t")}
        subjects.append(Subject(fmt, ws, args.hot))
        del ws
    reader = load_reader() if any(map(is_reader, args.kernels)) else None
    libs = {(s.fmt, k): reader if is_reader(k) else
            load_kernel(s.variant, k.removesuffix("@huge"), args.base)
            for s in subjects for k in args.kernels}
    for lib in libs.values():
        if lib is not reader:
            lib.pic_set_num_threads(args.threads)
    sink = ctypes.c_uint64(0)

    out = torch.empty(1, D)
    n_active = ctypes.c_int64(0)

    def call(s: Subject, lib, mask: torch.Tensor, huge: bool = False, rows=None) -> None:
        """One kernel call on the next copy of the weights; `rows` (cand, fired, pf): the row
        reader's instead."""
        w = (s.huge if huge else s.copies)[s.i]
        s.i = (s.i + 1) % len(s.copies)
        if rows is not None:
            cand, fired, pf = rows
            lib.read_rows(w["w_gate"].data_ptr(), w["w_up"].data_ptr(), w["w_down_t"].data_ptr(),
                          s.gate_bytes, s.down_bytes, cand.data_ptr(), cand.numel(),
                          fired.data_ptr(), pf, ctypes.byref(sink))
            return
        lib.ffn(x.data_ptr(), 1, D, N_FF, w["w_gate"].data_ptr(), w["w_up"].data_ptr(),
                w["w_down_t"].data_ptr(), None, None, None, None, N_FF,
                None if mask is None else mask.data_ptr(), 0.0,
                out.data_ptr(), ctypes.byref(n_active))

    configs = []
    for s in subjects:
        fires = s.h(x) != 0
        for p in args.densities:
            mask = candidates(fires, p, gen)
            m = N_FF if mask is None else int(mask.sum())
            fired = int(fires.sum()) if mask is None else int((mask[0] & fires).sum())
            cand = (torch.arange(N_FF) if mask is None else mask[0].nonzero().flatten()).int()
            chosen = fires if mask is None else mask[0] & fires
            rows = {k: (cand, chosen.to(torch.uint8),
                        int(dict(kv.split("=") for kv in k.partition(":")[2].removesuffix(
                            "@huge").split(",") if kv).get("PF", 0)))
                    for k in args.kernels if is_reader(k)}
            outs = []
            kernels = [k for k in args.kernels if not is_reader(k)]
            for k in kernels:
                call(s, libs[(s.fmt, k)], mask, k.endswith("@huge"))
                outs.append(out.clone())
                assert abs(n_active.value - fired) <= 2, (k, n_active.value, fired)
            for k, o in zip(kernels[1:], outs[1:]):
                err = float((o - outs[0]).abs().max())
                assert err <= 1e-4 * float(outs[0].abs().max()) + 1e-5, (k, err)
            nbytes = m * s.gate_bytes + fired * (s.gate_bytes + s.down_bytes)
            configs.append(dict(s=s, p=p, mask=mask, m=m, fired=fired, bytes=nbytes, rows=rows,
                                times={k: [] for k in args.kernels},
                                rounds={k: [] for k in args.kernels}))

    probes = []  # the streaming probe once per round: this VM's memory speed drifts in minutes
    for r in range(args.rounds):
        probes.append(stream_probe(3))
        for cfg in configs:
            order = args.kernels if r % 2 == 0 else args.kernels[::-1]
            for k in order:
                lib = libs[(cfg["s"].fmt, k)]
                huge, rows = k.endswith("@huge"), cfg["rows"].get(k)
                call(cfg["s"], lib, cfg["mask"], huge, rows)  # warm
                ts = []
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    call(cfg["s"], lib, cfg["mask"], huge, rows)
                    ts.append(time.perf_counter() - t0)
                cfg["times"][k] += ts
                cfg["rounds"][k].append(statistics.median(ts))

    print(f"streaming probe per round: {', '.join(f'{g:.1f}' for g in probes)} GB/s\n")
    print("| weights | density | candidates | fired | MB read | kernel | us | GB/s | best GB/s "
          "| vs first | of the round's probe |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for cfg in configs:
        first = statistics.median(cfg["times"][args.kernels[0]])
        for k in args.kernels:
            ts = cfg["times"][k]
            med = statistics.median(ts)
            fmt = cfg["s"].fmt + (" (down q8_0)" if cfg["s"].fmt == "q4_0" else "")
            density = "exact" if cfg["p"] >= 1 else f"{cfg['p']:.0%}"
            print(f"| {fmt} | {density} | {cfg['m']} | {cfg['fired']} "
                  f"| {cfg['bytes'] / 1e6:.1f} | {k} | {med * 1e6:.0f} "
                  f"| {cfg['bytes'] / med / 1e9:.1f} | {cfg['bytes'] / min(ts) / 1e9:.1f} "
                  f"| {first / med:.2f}x | {of_probe(cfg['bytes'], cfg['rounds'][k], probes):.0%} |")
    print(other.footer(stream_probe(5)))


def of_probe(nbytes: int, round_medians: list[float], probes: list[float]) -> float:
    """Median over rounds of the kernel's GB/s in a round against that round's probe."""
    return statistics.median(nbytes / t / 1e9 / g for t, g in zip(round_medians, probes))


if __name__ == "__main__":
    main()
