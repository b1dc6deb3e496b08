"""Weights in huge-page memory (runtime/memory.py): the copies equal the originals, ties stay
tied, and kernels bound before the move read the moved tensors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import picompile
from picompile.runtime import memory
from picompile.runtime.dense_linear import DenseLinear
from tests import zoo

needs_thp = pytest.mark.skipif(not memory.enabled(), reason="no MADV_HUGEPAGE on this OS")


@needs_thp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.uint8])
def test_huge_page_copy_equals_the_tensor(dtype):
    t = (torch.randn(2048, 1030) * 50).to(dtype)  # > 2 MB, not a multiple of a page
    out = memory.huge_page_copy(t)
    assert out is not t and out.dtype == t.dtype and out.shape == t.shape and out.is_contiguous()
    assert torch.equal(out, t) and out.data_ptr() != t.data_ptr()
    small = torch.randn(64, 64)
    assert memory.huge_page_copy(small) is small  # under a huge page: left as it is


@needs_thp
def test_moved_weights_keep_ties_and_kernels_rebind():
    weight = nn.Parameter(torch.randn(1024, 768), requires_grad=False)  # 3 MB
    a, b = DenseLinear(weight), DenseLinear(weight)  # one Parameter under two modules (tied)
    a.select_kernel()
    x = torch.randn(1, 768)
    expected = F.linear(x, weight)
    before = weight.data_ptr()
    assert memory.weights_to_huge_pages([a, b]) == weight.nbytes  # moved once
    assert a.weight is b.weight is weight and weight.data_ptr() != before
    a.select_kernel()
    torch.testing.assert_close(a(x), expected, rtol=1e-4, atol=1e-4)


@needs_thp
def test_small_tensors_share_one_arena():
    """SmolLM2's matrices are 1-2 MB: they go into one huge-page arena, each 64-byte aligned,
    a buffer held by two modules moved once and still shared."""
    mods = [nn.Module() for _ in range(3)]
    shared = torch.randn(7)
    want = {}
    for i, m in enumerate(mods):
        m.w = nn.Parameter(torch.randn(700, 301 + i), requires_grad=False)  # ~0.8 MB each
        m.register_buffer("b", shared)
        want[i] = m.w.clone()
    moved = memory.weights_to_huge_pages(mods)
    assert moved == sum(m.w.nbytes for m in mods) + shared.nbytes
    ptrs = sorted(m.w.data_ptr() for m in mods)
    assert all(p % memory.ALIGN == 0 for p in ptrs) and ptrs[-1] - ptrs[0] < 4 << 20
    assert all(torch.equal(m.w, want[i]) for i, m in enumerate(mods))
    assert mods[0].b is mods[1].b is mods[2].b and torch.equal(mods[0].b, shared)


@needs_thp
def test_compiled_model_in_huge_pages_equals_without(monkeypatch):
    dense = zoo.make("llama_relu", hidden=256, n_ff=2048)  # FFN matrices of 2 MB
    ids = torch.randint(0, zoo.VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = zoo.logits(dense, ids)
    gate_ptr = dense.model.layers[0].mlp.gate_proj.weight.data_ptr()
    cm = picompile.compile(copy.deepcopy(dense), quiet=True)
    ffn = next(iter(cm.ffns().values()))
    assert ffn.w_gate.data_ptr() != gate_ptr  # the compiled copy was made, ours untouched
    monkeypatch.setenv(memory.ENV, "0")
    plain = picompile.compile(copy.deepcopy(dense), quiet=True)
    with torch.no_grad():
        for model in (cm, plain):
            torch.testing.assert_close(zoo.logits(model, ids), want, rtol=1e-4, atol=1e-4)
            for step in range(3):  # decode steps through the kernels
                torch.testing.assert_close(zoo.logits(model, ids[:, : 10 + step]),
                                           want[:, : 10 + step], rtol=1e-4, atol=1e-4)
