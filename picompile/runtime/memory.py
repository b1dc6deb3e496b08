"""Weights in transparent huge pages: the kernels read gigabytes of weights per token, often a
few kilobytes of scattered rows at a time; with 4 KB pages every such row costs a TLB miss and
a page walk. Linux backs memory with 2 MB pages only where asked (THP "madvise" mode, the common
default), so picompile asks for its kernels' weights: each large weight tensor is copied, once,
after lowering, into an anonymous mapping advised MADV_HUGEPAGE before it is first touched.
BENCHMARKS.md (session 10) has the measurement that made this worth it.

Where the OS cannot (not Linux, THP off) the tensors stay as they are; PICOMPILE_HUGE_PAGES=0
turns it off."""

from __future__ import annotations

import mmap
import os

import torch
from torch import nn

HUGE_PAGE = 2 << 20  # smaller tensors stay where they are: at most part of one huge page
ENV = "PICOMPILE_HUGE_PAGES"


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "") and hasattr(mmap, "MADV_HUGEPAGE")


def huge_page_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor `t` in memory advised for huge pages (the mapping lives
    as long as the tensor); `t` itself where that does not apply."""
    if not enabled() or t.device.type != "cpu" or t.nbytes < HUGE_PAGE or t.is_quantized:
        return t
    buf = mmap.mmap(-1, t.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP compiled out or disabled: plain pages, no copy needed
        buf.close()
        return t
    out = torch.frombuffer(buf, dtype=torch.uint8).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


@torch.no_grad()
def weights_to_huge_pages(modules) -> int:
    """Move every large parameter and buffer of `modules` (the kernel-bearing modules: the
    sparse FFN blocks, the lowered linears) to huge-page memory, in place (Parameters keep their
    identity: tied weights stay tied). -> bytes moved."""
    moved, done = 0, {}  # id(tensor) -> its copy (a buffer shared by modules moves once)
    for module in modules:
        for kind in ("_parameters", "_buffers"):
            table = getattr(module, kind)
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in done:
                    old = t.data if isinstance(t, nn.Parameter) else t
                    new = huge_page_copy(old) if old.is_contiguous() else old
                    done[id(t)] = new
                    if new is old:
                        continue
                    moved += new.nbytes
                if isinstance(t, nn.Parameter):
                    t.data = done[id(t)]
                else:
                    table[name] = done[id(t)]
    return moved
