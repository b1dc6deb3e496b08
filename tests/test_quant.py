"""Block formats (picompile/quant.py) against the `gguf` package's own (de)quantization: the
bytes are GGUF's, and the PyTorch dequantization (the kernels' reference) reads them as gguf does."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from picompile import quant

FORMATS = sorted(quant.FORMATS)


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 9), blocks=st.integers(1, 6), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1e-3, 0.02, 1.0, 30.0]))
def test_round_trip_matches_gguf(fmt, rows, blocks, seed, scale):
    w = torch.randn(rows, blocks * quant.BLOCK, generator=torch.Generator().manual_seed(seed)) * scale
    q = quant.quantize(w, fmt)
    assert q.dtype == torch.uint8 and q.shape == (rows, quant.row_bytes(w.shape[1], fmt))
    qtype = gguf.GGMLQuantizationType[quant.FORMATS[fmt].gguf_type]
    want = gguf.quants.dequantize(q.numpy(), qtype)  # gguf reading picompile's bytes
    got = quant.dequantize(q, fmt, w.shape[1])
    np.testing.assert_array_equal(got.numpy(), want)
    # and the values are close to the originals: half a step of the block's scale
    step = {"q8_0": 1 / 127, "q4_0": 1 / 8, "q4_1": 1 / 15}[fmt]
    amax = w.abs().reshape(rows, blocks, quant.BLOCK).amax(-1, keepdim=True)
    err = (got - w).abs().reshape(rows, blocks, quant.BLOCK)
    assert (err <= amax * step * (2.0 if fmt == "q4_1" else 1.0) + 1e-6).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_and_constant_blocks(fmt):
    w = torch.zeros(2, 64)
    w[1, 32:] = 0.5
    got = quant.dequantize(quant.quantize(w, fmt), fmt, 64)
    torch.testing.assert_close(got[0], torch.zeros(64))
    torch.testing.assert_close(got[1, 32:], torch.full((32,), 0.5), atol=0.5 / 127 + 1e-3, rtol=0)


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize(torch.zeros(3, 40), "q8_0")
    with pytest.raises(ValueError, match="unknown quantization 'q5_0'"):
        quant.quantize(torch.zeros(3, 32), "q5_0")
    with pytest.raises(ValueError, match=r"uint8 \[rows, 34\]"):
        quant.dequantize(torch.zeros(3, 20, dtype=torch.uint8), "q8_0", 32)
