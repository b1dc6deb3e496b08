"""Where a hybrid run's GPU memory goes, phase by phase, against what placement counted.

    PYTHONPATH=. python benchmarks/gpu_memory.py     # needs a CUDA GPU and cupy (tests.zoo's model)

The budget promises that PyTorch's reserved pool (its peak), CuPy's pool and the memory the
process holds outside both (the CUDA context, loaded modules) stay within `gpu_budget`. A test
(tests/test_hybrid_gpu.py) asserts it; this script says, when that fails, which part grew:

1. cuBLAS's workspace per stream: the pool's growth from the first matrix product on a fresh
   stream (float16, then float32), which placement counts as CUBLAS_WORKSPACE_BYTES;
2. a small model (the GPU tests' ReLU-Llama) compiled in predicted mode at a budget holding 30%
   of its FFN neurons, then its device decoder built, its KV cache reserved (the CUDA graphs
   captured), 8 tokens generated: after each phase the three parts, their peak, and the pool's
   segments.
"""

from __future__ import annotations

import copy
import gc

import torch

import picompile
from picompile.passes import place
from tests import zoo


def parts() -> dict[str, int]:
    """PyTorch's reserved pool now and at its peak, CuPy's pool, the memory outside both."""
    import cupy

    free, total = torch.cuda.mem_get_info()
    pool = cupy.get_default_memory_pool().total_bytes()
    stats = torch.cuda.memory_stats()
    return dict(reserved=torch.cuda.memory_reserved(), peak_reserved=torch.cuda.max_memory_reserved(),
                cupy_pool=pool, outside=total - free - torch.cuda.memory_reserved() - pool,
                segments=stats.get("segment.all.current", 0),
                small_pool=stats.get("reserved_bytes.small_pool.current", 0),
                large_pool=stats.get("reserved_bytes.large_pool.current", 0))


def show(phase: str, budget: int | None = None) -> None:
    p = parts()
    total = p["peak_reserved"] + p["cupy_pool"] + p["outside"]
    over = "" if budget is None else f", {total - budget:+,} against the budget"
    print(f"{phase:<34} reserved {p['reserved'] / 2**20:8.1f} MiB (peak {p['peak_reserved'] / 2**20:8.1f}: "
          f"small {p['small_pool'] / 2**20:.1f}, large {p['large_pool'] / 2**20:.1f}, "
          f"{p['segments']} segments), cupy {p['cupy_pool'] / 2**20:.1f}, outside "
          f"{p['outside'] / 2**20:8.1f} MiB; peak total {total:,} B{over}", flush=True)


def workspace_per_stream() -> None:
    for dtype in (torch.float16, torch.float32):
        a = torch.randn(256, 256, device="cuda", dtype=dtype)
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            (a @ a).sum()
        stream.synchronize()
        grown = torch.cuda.memory_reserved() - before
        print(f"cuBLAS on a fresh stream, {dtype}: the pool grew {grown / 2**20:.1f} MiB "
              f"(placement counts {place.CUBLAS_WORKSPACE_BYTES / 2**20:.0f} MiB for two streams)")


def main():
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    a = torch.randn(64, 64, device="cuda")
    (a @ a).sum().item()
    show("CUDA context + cuBLAS, default stream")
    workspace_per_stream()
    dense = zoo.make("llama_relu", torch.float16, n_ff=2048, hidden=256, layers=2)
    kw = dict(mode="predicted", calibration=torch.randint(0, zoo.VOCAB, (4, 32)), max_context=64,
              quiet=True)
    probe = picompile.compile(copy.deepcopy(dense), gpu_budget=64 * 2**30, **kw)
    budget = place.budget_for_share(probe.plan.placement.fixed_bytes, probe.ffns().values(), 0.3)
    del probe
    gc.collect()
    torch.cuda.empty_cache()
    show("after a probe compile, emptied")
    torch.cuda.reset_peak_memory_stats()
    cm = picompile.compile(copy.deepcopy(dense), gpu_budget=budget, **kw)
    print("placement counted: " + ", ".join(f"{k} {v:,}" for k, v in
                                            cm.plan.placement.fixed_bytes.items()))
    print(f"budget {budget:,} B, planned on the GPU {cm.plan.placement.gpu_bytes:,} B")
    show("compiled (decoder built and verified)", budget)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    dec = cm.decoder()
    dec.reserve(64)
    show("KV cache reserved, graphs captured", budget)
    print(f"  decode step: {dec.describe()}")
    ids = torch.randint(0, zoo.VOCAB, (1, 8))
    cm.generate(ids, max_new_tokens=8, do_sample=False)
    show("8 tokens generated", budget)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    cm.generate(ids, max_new_tokens=8, do_sample=False)
    show("again, from an emptied pool", budget)


if __name__ == "__main__":
    main()
