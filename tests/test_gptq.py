"""GPTQ rounding (picompile/gptq.py): its output is GGUF blocks quant.dequantize reads; with
H = identity (and without the 4-bit scale search) it is round-to-nearest byte for byte; on correlated inputs the layer's output error
is below round-to-nearest's, in both layouts (blocks along the input, and down_t's along the
output)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from picompile import gptq, quant

FORMATS = sorted(quant.FORMATS)


def _inputs(n: int, k: int, seed: int) -> torch.Tensor:
    """X [n, k]: correlated features (a low-rank mix plus noise, uneven scales), as a layer's
    inputs are."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k // 4, k, generator=g)
    x = torch.randn(n, k // 4, generator=g) @ mix + 0.1 * torch.randn(n, k, generator=g)
    return x * torch.rand(k, generator=g).add(0.2)


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 9), blocks=st.integers(1, 6), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_identity_hessian_is_round_to_nearest(fmt, rows, blocks, seed, scale):
    w = torch.randn(rows, blocks * quant.BLOCK, generator=torch.Generator().manual_seed(seed)) * scale
    eye = torch.eye(w.shape[1])
    assert torch.equal(gptq.quantize(w, fmt, eye, search=False), quant.quantize(w, fmt))
    if fmt == "q8_0":  # no search for q8_0: gguf's rule
        assert torch.equal(gptq.quantize(w, fmt, eye), quant.quantize(w, fmt))
    # down_t's layout: rows are the input columns, blocks along the output
    assert torch.equal(gptq.quantize_transposed(w, fmt, torch.eye(rows)), quant.quantize(w, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_output_error_below_round_to_nearest(fmt, seed):
    """||X W^T - X Wq^T|| on the calibration inputs: GPTQ's blocks (valid GGUF: dequantize
    reads them) beat round-to-nearest's."""
    g = torch.Generator().manual_seed(seed)
    O, K = 24, 128
    w = torch.randn(O, K, generator=g)
    x = _inputs(512, K, seed)
    h = x.T @ x / len(x)
    q = gptq.quantize(w, fmt, h)
    assert q.dtype == torch.uint8 and q.shape == (O, quant.row_bytes(K, fmt))

    def err(blocks):
        return float((x @ (w - quant.dequantize(blocks, fmt, K)).T).norm())

    assert err(q) < err(quant.quantize(w, fmt))
    assert torch.equal(gptq.quantize(w, fmt, gptq.prepare(h)), q)  # one factor for many weights
    for kw in (dict(act_order=False), dict(search=False)):  # each part alone beats it too
        assert err(gptq.quantize(w, fmt, h, **kw)) < err(quant.quantize(w, fmt))
    # down_t [K, O]: the same layer with its weight stored transposed, blocks along O = 32 * 2
    wt = torch.randn(K, 64, generator=g)
    qt = gptq.quantize_transposed(wt, fmt, h)
    assert qt.shape == (K, quant.row_bytes(64, fmt))

    def err_t(blocks):
        return float((x @ (wt - quant.dequantize(blocks, fmt, 64))).norm())

    assert err_t(qt) < err_t(quant.quantize(wt, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_dead_inputs_keep_their_weights_rounded_to_nearest_and_bad_shapes(fmt):
    """Inputs calibration never reached (a zero row and column of H: an FFN neuron that did not
    fire on the calibration tokens) keep their weights, rounded to nearest: such a neuron may
    fire later. In down_t's layout such an input is a whole row; a block of 32 dead columns
    gets a scale like any other. A Hessian of the wrong size is refused."""
    w = torch.randn(4, 96)
    x = _inputs(256, 96, 0)
    dead = [5, *range(32, 64)]  # one column, and a whole block
    x[:, dead] = 0
    q = quant.dequantize(gptq.quantize(w, fmt, x.T @ x), fmt, 96)
    step = w.abs().amax() / (100 if fmt == "q8_0" else 6)  # a few quantization steps
    assert (q[:, dead] - w[:, dead]).abs().max() < step
    if fmt == "q8_0":  # no scale search: gguf's rule, so the dead block is round to nearest's
        assert torch.equal(q[:, 32:64], quant.dequantize(quant.quantize(w[:, 32:64], fmt), fmt, 32))
    wt = torch.randn(96, 64)
    qt = quant.dequantize(gptq.quantize_transposed(wt, fmt, x.T @ x), fmt, 64)
    assert torch.equal(qt[dead], quant.dequantize(quant.quantize(wt[dead], fmt), fmt, 64))
    with pytest.raises(ValueError, match=r"is \[96, 96\]"):
        gptq.quantize(w, "q8_0", torch.eye(32))
    with pytest.raises(ValueError, match="multiple of 32"):
        gptq.quantize(torch.zeros(3, 40), "q8_0", torch.eye(40))
