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
    # and the values are close to the originals: within a step of the block's scale (q4_0 clips
    # the value opposite the largest to +7 steps: a whole step off, times the float16 rounding
    # of the scale, up to 8 * 2^-11 of it)
    step = {"q8_0": 1 / 127, "q4_0": 1 / 8, "q4_1": 1 / 15}[fmt]
    amax = w.abs().reshape(rows, blocks, quant.BLOCK).amax(-1, keepdim=True)
    err = (got - w).abs().reshape(rows, blocks, quant.BLOCK)
    assert (err <= amax * step * (2.0 if fmt == "q4_1" else 1.005) + 1e-6).all()


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


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 5), blocks=st.integers(1, 6), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1e-30, 1e-3, 1.0, 300.0]))
def test_round_activations(rows, blocks, seed, scale):
    """The quantized kernels read x rounded to integer blocks (qblocks.h: 8 bits for the 4-bit
    formats, 16 for q8_0); the reference rounds the same way. Against an independent numpy
    float32 version: d = max|x| / L (L = 127, 32767), q = rint(x * (1 / d)) (half to even),
    x' = q * d; within half a step of x."""
    K = blocks * quant.BLOCK
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(seed)) * scale
    x[0, :quant.BLOCK] = 0.0  # an all-zero block stays zero
    if K > quant.BLOCK:
        x[0, quant.BLOCK:2 * quant.BLOCK] = torch.arange(32) - 15.5  # ties at x * (1 / d) = k + 0.5
    xb = x.numpy().reshape(rows, blocks, quant.BLOCK)
    for fmt, L in (("q4_0", 127), ("q4_1", 127), ("q8_0", 32767)):
        assert quant.format_of(fmt).activation_bits == (8 if L == 127 else 16)
        d = np.abs(xb).max(-1, keepdims=True) / np.float32(L)
        with np.errstate(divide="ignore"):
            inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        q = np.rint(xb * inv)
        assert np.abs(q).max() <= L
        want = (q * d).astype(np.float32).reshape(rows, K)
        got = quant.round_activations(x, fmt)
        np.testing.assert_array_equal(got.numpy(), want)
        # half a step, and float32's rounding of x * (1 / d) and q * d: a few L * 2^-24 steps
        step = torch.from_numpy(d) * (0.5 + L * 2.0**-22)
        assert ((got - x).abs().reshape(rows, blocks, -1) <= step).all()
        assert torch.equal(got[0, :quant.BLOCK], torch.zeros(quant.BLOCK))


def test_round_activations_other_formats_and_gradient():
    x = torch.randn(2, 64)
    assert quant.round_activations(x, "float16") is x and quant.round_activations(x, None) is x
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.round_activations(torch.zeros(1, 48), "q4_0")
    x.requires_grad_(True)
    (quant.round_activations(x, "q4_1") * 3).sum().backward()  # straight through
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(sorted(quant.FORMATS)), rows=st.integers(0, 6),
       blocks=st.integers(1, 27), seed=st.integers(0, 2**31 - 1))
def test_interleave_blocks(fmt, rows, blocks, seed):
    """The dot layout (qblocks.h): in each row, per run of 8 blocks, the 8 blocks' float16
    scales (and minimums) side by side, then weight byte Cv + c of block b (qs of a 4-bit block,
    q of a q8_0 one) at 8Cv + Cb + c (C: 4 bytes per piece, q8_0 2); the blocks % 8 after the
    last run unchanged; deinterleave_blocks undoes it."""
    gen = torch.Generator().manual_seed(seed)
    bb = quant.format_of(fmt).block_bytes
    q = torch.randint(0, 256, (rows, blocks * bb), generator=gen, dtype=torch.uint8)
    packed = quant.interleave_blocks(q, fmt)
    assert packed.shape == q.shape and packed is not q
    assert torch.equal(quant.deinterleave_blocks(packed, fmt), q)
    head = {"q8_0": 2, "q4_0": 2, "q4_1": 4}[fmt]
    c = {"q8_0": 2, "q4_0": 4, "q4_1": 4}[fmt]  # bytes per piece
    P = (bb - head) // c  # pieces of weights per block
    span = blocks // 8 * 8 * bb
    assert torch.equal(packed[:, span:], q[:, span:])
    for r in range(rows):
        for g in range(blocks // 8):
            src = q[r, g * 8 * bb:(g + 1) * 8 * bb].reshape(8, bb)  # GGUF's 8 blocks
            dst = packed[r, g * 8 * bb:(g + 1) * 8 * bb]
            for h in range(head // 2):  # d (and m): float16 h of blocks 0..7 side by side
                assert torch.equal(dst[16 * h:16 * h + 16].reshape(8, 2), src[:, 2 * h:2 * h + 2])
            qs = dst[8 * head:].reshape(P, 8, c)  # [v, b, c]
            assert torch.equal(qs.permute(1, 0, 2).reshape(8, c * P), src[:, head:])


def test_interleave_blocks_errors():
    q = quant.quantize(torch.randn(9, 64), "q8_0")
    with pytest.raises(ValueError, match="uint8"):
        quant.interleave_blocks(torch.zeros(8, 19, dtype=torch.uint8), "q4_0")
    with pytest.raises(ValueError, match="unknown"):
        quant.interleave_blocks(q, "q5_0")


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 70), blocks=st.integers(1, 19), T=st.integers(1, 40),
       tile_rows=st.integers(1, 80), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_linear_dequantized_equals_the_reference(fmt, rows, blocks, T, tile_rows, bias, seed):
    """The long-prompt path of the GPU's quantized linear layers (row tiles dequantized, then
    BLAS), here on the CPU, against QuantLinear's reference over any tiling, superblock tails
    included."""
    from picompile.runtime.dense_linear import QuantLinear

    g = torch.Generator().manual_seed(seed)
    cols = blocks * quant.BLOCK
    lin = torch.nn.Linear(cols, rows, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(rows, cols, generator=g))
    layer = QuantLinear.from_linear(lin, fmt, select=False)
    x = torch.randn(T, cols, generator=g)
    out = torch.full((T, rows), float("nan"))
    got = quant.linear_dequantized(quant.round_activations(x, fmt), layer.qweight, fmt,
                                   layer.bias, out=out, tile_bytes=tile_rows * 4 * cols)
    assert got is out
    with torch.no_grad():
        torch.testing.assert_close(got, layer.forward_native(x), rtol=1e-5, atol=1e-4)


# ---- gguf_transcode: GGUF types written exactly as a kernel format's blocks ----

def _random_blocks(kind: str, rows: int, cols: int, rng, exponent: int) -> np.ndarray:
    """uint8 [rows, row_bytes] of random `kind` blocks, their float16 scales near 2**exponent."""
    size = {"Q4_K": (256, 144), "Q5_0": (32, 22), "IQ4_NL": (32, 18), "IQ4_XS": (256, 136)}[kind]
    raw = rng.integers(0, 256, (rows * cols // size[0], size[1]), dtype=np.uint8)
    heads = 2 if kind == "Q4_K" else 1  # Q4_K: d and dmin
    scales = rng.uniform(1, 2, (len(raw), heads)) * 2.0 ** exponent
    if kind != "Q4_K":
        scales *= rng.choice([-1, 1], scales.shape)
    raw[:, :2 * heads] = scales.astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 5), superblocks=st.integers(1, 3), seed=st.integers(0, 2**16),
       exponent=st.integers(-28, 8))
def test_q4_k_as_q4_1_blocks_dequantizes_as_gguf_does(rows, superblocks, seed, exponent):
    """Q4_K -> q4_1 against the gguf package's Q4_K dequantization: every weight within float16
    rounding of its sub-block's scale and minimum (a nibble or a scale in the wrong place is
    off by a whole step), scales in float16's normal and subnormal range."""
    from picompile import gguf_transcode

    cols = 256 * superblocks
    raw = _random_blocks("Q4_K", rows, cols, np.random.default_rng(seed), exponent)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    out = gguf_transcode.transcode(raw, "Q4_K")
    assert out.dtype == np.uint8 and out.shape == (rows, quant.row_bytes(cols, "q4_1"))
    got = quant.dequantize(torch.from_numpy(out), "q4_1", cols).numpy()
    blocks = torch.from_numpy(out).reshape(rows, -1, 20)
    s, m = (quant._f16(blocks, at).abs().numpy() for at in (0, 2))  # [rows, cols / 32, 1]
    # float16 rounding: 2^-11 of a normal value, 2^-25 absolute below
    bound = (15 * s + m) * 2.0 ** -11 + 16 * 2.0 ** -25
    err = np.abs(got - want).reshape(rows, -1, 32)
    assert (err <= bound * (1 + 1e-3) + 1e-6 * np.abs(want).reshape(rows, -1, 32)).all()


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 5), blocks=st.integers(1, 9), seed=st.integers(0, 2**16),
       exponent=st.integers(-20, 8))
def test_q5_0_as_q8_0_blocks_is_exact(rows, blocks, seed, exponent):
    from picompile import gguf_transcode

    raw = _random_blocks("Q5_0", rows, 32 * blocks, np.random.default_rng(seed), exponent)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_0)
    out = gguf_transcode.transcode(raw, "Q5_0")
    assert out.shape == (rows, quant.row_bytes(32 * blocks, "q8_0"))
    np.testing.assert_array_equal(quant.dequantize(torch.from_numpy(out), "q8_0", 32 * blocks).numpy(),
                                  want)


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(["IQ4_NL", "IQ4_XS"]), rows=st.integers(1, 5),
       superblocks=st.integers(1, 3), seed=st.integers(0, 2**16), exponent=st.integers(-20, 8))
def test_iq4_as_q8_0_blocks_dequantizes_as_gguf_does(kind, rows, superblocks, seed, exponent):
    """IQ4_NL's levels with their d are q8_0 blocks, exactly; IQ4_XS's within float16 rounding
    of each sub-block's scale d * (ls - 32)."""
    from picompile import gguf_transcode

    cols = 256 * superblocks
    raw = _random_blocks(kind, rows, cols, np.random.default_rng(seed), exponent)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    out = gguf_transcode.transcode(raw, kind)
    assert out.shape == (rows, quant.row_bytes(cols, "q8_0"))
    got = quant.dequantize(torch.from_numpy(out), "q8_0", cols).numpy()
    if kind == "IQ4_NL":
        np.testing.assert_array_equal(got, want)
    else:
        assert (np.abs(got - want) <= np.abs(want) * 2.0 ** -11 + 127 * 2.0 ** -25).all()


def test_q4_k_scales_beyond_float16_are_not_transcoded(tmp_path):
    """A Q4_K tensor one of whose products d * sc overflows float16 -> None, and
    gguf_weights.read re-quantizes it with a note; the file's other tensors are written, and
    noted unless the FFN kernels quantize them again (ffn_down: blocked along n_ff)."""
    from picompile import gguf_transcode, gguf_weights

    rng = np.random.default_rng(0)
    fine = _random_blocks("Q4_K", 64, 256, rng, -8)
    huge = _random_blocks("Q4_K", 64, 256, rng, -8)
    huge[0, 0:2] = np.array([60000], np.float16).view(np.uint8)
    huge[0, 4] = 63  # sub-block 0's scale: 63 * 60000 > 65504
    assert gguf_transcode.transcode(huge, "Q4_K") is None
    with pytest.raises(ValueError, match="no exact transcoding of Q6_K"):
        gguf_transcode.transcode(fine, "Q6_K")
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "qwen2")
    writer.add_block_count(1)
    for name, raw in (("blk.0.ffn_up.weight", fine), ("blk.0.attn_q.weight", huge)):
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    down = _random_blocks("Q5_0", 64, 256, rng, -8)
    writer.add_tensor("blk.0.ffn_down.weight", down, raw_dtype=gguf.GGMLQuantizationType.Q5_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors, notes = gguf_weights.read(tmp_path / "m.gguf")
    up, q = (tensors.get(f"model.layers.0.{n}") for n in ("mlp.up_proj", "self_attn.q_proj"))
    assert up.fmt == q.fmt == "q4_1"
    assert torch.equal(up.data, torch.from_numpy(gguf_transcode.transcode(fine, "Q4_K")))
    assert q.data is None
    assert torch.equal(tensors.get("model.layers.0.mlp.down_proj").data,
                       torch.from_numpy(gguf_transcode.transcode(down, "Q5_0")))
    assert notes == ["blk.0.attn_q.weight: Q4_K scales beyond float16's range: re-quantized to q4_1",
                     "Q4_K tensors: written as q4_1 blocks of the same values (their scales "
                     "rounded to float16), not rounded a second time"]
