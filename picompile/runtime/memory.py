"""Weights in transparent huge pages: the kernels read gigabytes of weights per token, often a
few kilobytes of scattered rows at a time; with 4 KB pages every such row costs a TLB miss and
a page walk. Linux backs memory with 2 MB pages only where asked (THP "madvise" mode, the common
default), so picompile asks for its kernels' weights: they are copied, once, after lowering,
into one anonymous mapping advised MADV_HUGEPAGE before it is first touched.
BENCHMARKS.md (session 10) has the measurement that made this worth it.

Where the OS cannot (not Linux, THP off) the tensors stay as they are; PICOMPILE_HUGE_PAGES=0
turns it off. huge_page_copy does it for one tensor (benchmarks/ffn_rows.py's A/B)."""

from __future__ import annotations

import mmap
import os

import torch
from torch import nn

HUGE_PAGE = 2 << 20  # huge_page_copy leaves smaller tensors, and the arena fewer bytes, alone
ENV = "PICOMPILE_HUGE_PAGES"


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "") and hasattr(mmap, "MADV_HUGEPAGE")


def _huge_buffer(nbytes: int) -> torch.Tensor | None:
    """uint8 [nbytes] in a fresh anonymous mapping advised MADV_HUGEPAGE, not yet touched (the
    tensor keeps the mapping alive); None where THP is compiled out or disabled."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        buf.close()
        return None
    return torch.frombuffer(buf, dtype=torch.uint8)


def huge_page_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor `t` in memory advised for huge pages (the mapping lives
    as long as the tensor); `t` itself where that does not apply."""
    if not enabled() or t.device.type != "cpu" or t.nbytes < HUGE_PAGE or t.is_quantized:
        return t
    buf = _huge_buffer(t.nbytes)
    if buf is None:
        return t
    out = buf.view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


ALIGN = 64  # each tensor's start in the arena (the kernels' vector loads, torch's own alignment)


@torch.no_grad()
def weights_to_huge_pages(modules) -> int:
    """Move the parameters and buffers of `modules` (the kernel-bearing modules: the sparse FFN
    blocks, the lowered linears) into one huge-page arena, in place: Parameters keep their
    identity (tied weights stay tied), a buffer shared by modules moves once. One arena rather
    than a mapping per tensor, so that a model of small matrices (SmolLM2's are 1-2 MB) is on
    huge pages too. The arena's pages are touched tensor by tensor as each old tensor is let go,
    so the copy costs about the largest tensor in memory, not the model. -> bytes moved."""
    if not enabled():
        return 0
    holders: dict[int, list[tuple[dict, str]]] = {}  # id(tensor) -> where it is held
    sizes: dict[int, int] = {}  # id(tensor) -> its bytes rounded up to ALIGN
    for module in modules:
        for kind in ("_parameters", "_buffers"):
            table = getattr(module, kind)
            for name, t in table.items():
                if t is not None and t.device.type == "cpu" and t.is_contiguous() and t.numel():
                    holders.setdefault(id(t), []).append((table, name))
                    sizes[id(t)] = -(-t.nbytes // ALIGN) * ALIGN
    total = sum(sizes.values())
    if total < HUGE_PAGE:
        return 0
    arena = _huge_buffer(total)  # [total]
    if arena is None:
        return 0
    offset = moved = 0
    for key, places in holders.items():
        table, name = places[0]
        t = table[name]
        view = arena[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        offset += sizes[key]
        moved += t.nbytes
        if isinstance(t, nn.Parameter):
            t.data = view  # every holder has this Parameter object
        else:
            for table, name in places:
                table[name] = view
        del t  # the old storage goes now, not at the end
    return moved
