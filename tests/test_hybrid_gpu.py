"""Hybrid execution on a real GPU: equals dense, and keeps peak GPU memory within the budget.

Run where a GPU exists: `pytest -m gpu`."""

from __future__ import annotations

import copy

import pytest
import torch

import picompile
from tests import zoo

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
cupy = pytest.importorskip("cupy", reason="needs cupy (pip install picompile[cuda])")


def _model(dtype):
    return zoo.make("opt", dtype, n_ff=512, hidden=128, layers=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("share", [0.3, 0.7])
def test_hybrid_on_gpu_equals_dense_and_holds_the_budget(dtype, share):
    dense = _model(dtype)
    total = sum(p.numel() * p.element_size() for p in dense.parameters())
    calib = torch.randint(0, zoo.VOCAB, (4, 32))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    cm = picompile.compile(copy.deepcopy(dense), gpu_budget=int(total * share + 2**20),
                           calibration=calib, max_context=64, quiet=True)
    assert cm.plan.placement.fixed_on_gpu
    assert any(f.hybrid is not None and f.hybrid.hot is not None for f in cm.ffns().values())
    torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, zoo.VOCAB, (1, 8))
    want = dense.generate(ids, max_new_tokens=8, do_sample=False)
    got = cm.generate(ids, max_new_tokens=8, do_sample=False).cpu()
    if dtype == torch.float32:
        assert torch.equal(got, want)
    peak = torch.cuda.max_memory_allocated() - base + cupy.get_default_memory_pool().total_bytes()
    assert peak <= cm.plan.placement.budget_bytes, (peak, cm.plan.placement)


def test_hybrid_logits_match_dense_on_gpu():
    dense = _model(torch.float32)
    cm = picompile.compile(copy.deepcopy(dense), gpu_budget="20MB", mode="predicted",
                           calibration=torch.randint(0, zoo.VOCAB, (4, 32)), max_context=64,
                           quiet=True)
    for ffn in cm.ffns().values():
        ffn.predictor.tau = float("-inf")  # predict everything: must equal exact/dense
    ids = torch.randint(0, zoo.VOCAB, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(cm, ids).cpu(), zoo.logits(dense, ids),
                                   atol=1e-3, rtol=1e-3)
