"""The dense kernel on block-quantized weights (picompile/kernels/dense.c, -DPI_WDTYPE=3|4|5 via
picompile/codegen/dense.py's quant_kernel_for) against the reference, and QuantLinear.

The reference is quant.dequantize (PyTorch) then the matmul in float64, over x as the kernel
reads it (quant.round_activations: the 4-bit formats round x to int8 blocks, bit for bit as the
kernel does, so any difference there shows as an error far above the bound). Tolerance: q8_0
rounds each weight once as it dequantizes (d * q, exactly the reference's float32 weight); the
4-bit formats dot the integers exactly and round per block the scale product d * dx, the block
term and the block-sum term (-8 d * sx, m * sx), and the reference rounds each x' = dx * q once.
The sums of K products or block terms in float32 in some order (vector lanes, partial sums, the
bias last) add at most (K + 2) u times the sum of the magnitudes, u = 2^-24. So

    |kernel - exact| <= (K + 4) u * (|x'| @ M.T + |b|)

where M [O, K] bounds each term per weight (`magnitude`): |d| |q| (q8_0), |d| (nibble + 8)
(q4_0: its nibble and -8 terms are summed apart) or |d| nibble + |m| (q4_1); the float64
matmul over the reference's weights is exact to far below the bound.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from picompile.config import PREFILL_KERNEL_FORMATS
from picompile import quant
from picompile.codegen import c, dense
from picompile.runtime.dense_linear import DenseLinear, QuantLinear
from tests.test_dense_linear import assert_thread_count_independent

FORMATS = list(dense.QFORMATS)
U = 2.0**-24


@pytest.fixture(scope="module", autouse=True)
def _kernels_built():
    for fmt in FORMATS:
        if dense.try_load(fmt) is None:
            probe = torch.zeros(1, quant.row_bytes(32, fmt), dtype=torch.uint8)
            pytest.skip(f"no dense C kernel: {dense.why_no_quant_kernel(probe, fmt, 32)}")


def quantized(gen: torch.Generator, O: int, K: int, fmt: str) -> torch.Tensor:
    """A random weight [O, K] quantized by quant.quantize (blocks as GGUF makes them)."""
    return quant.quantize(torch.randn(O, K, generator=gen), fmt)


def raw_blocks(gen: torch.Generator, O: int, K: int, fmt: str) -> torch.Tensor:
    """Any block bytes (every int8 and nibble, -128 included) with finite float16 scales
    (normal, subnormal and large), not only what quantize makes."""
    bb = quant.format_of(fmt).block_bytes
    q = torch.randint(0, 256, (O, K // 32, bb), generator=gen, dtype=torch.uint8)
    n_f16 = 2 if fmt == "q4_1" else 1
    scale = torch.randn(O, K // 32, n_f16, generator=gen) * 0.05
    scale[..., ::3, :] *= 1e-4  # float16 subnormals
    scale[..., 1::5, :] *= 1e3
    q[..., :2 * n_f16] = scale.to(torch.float16).view(torch.uint8).reshape(O, K // 32, 2 * n_f16)
    return q.reshape(O, -1)


def magnitude(q: torch.Tensor, fmt: str, K: int) -> torch.Tensor:
    """M [O, K] >= |w|: |d| |q| (q8_0), |d| (nibble + 8) (q4_0), |d| nibble + |m| (q4_1), the
    size of each term the kernel adds (computed in float32: its rounding is covered by the
    bound's slack)."""
    O = q.shape[0]
    blocks = q.reshape(O, K // 32, -1)

    def f16(at: int) -> torch.Tensor:  # |the block's float16 at byte `at`| [O, nb, 1]
        return blocks[..., at:at + 2].contiguous().view(torch.float16).float().abs()

    if fmt == "q8_0":
        m = f16(0) * blocks[..., 2:].contiguous().view(torch.int8).float().abs()
    else:
        qs = blocks[..., -16:]
        nib = torch.cat([qs & 15, qs >> 4], dim=-1).float()
        m = f16(0) * (nib + 8) if fmt == "q4_0" else f16(0) * nib + f16(2)
    return m.reshape(O, K)


def check(q: torch.Tensor, fmt: str, K: int, b: torch.Tensor | None, x: torch.Tensor,
          **build) -> torch.Tensor:
    kernel = dense.quant_kernel_for(quant.interleave_blocks(q, fmt), fmt, K, b, **build)
    assert kernel is not None
    out = kernel(x)
    assert out.dtype == torch.float32 and out.shape == (*x.shape[:-1], q.shape[0])
    W = quant.dequantize(q, fmt, K).double()
    xd = quant.round_activations(x, fmt).double()
    bd = None if b is None else b.double()
    ref = F.linear(xd, W)
    bound = F.linear(xd.abs(), magnitude(q, fmt, K).double())
    if bd is not None:
        ref, bound = ref + bd, bound + bd.abs()
    err = (out.double() - ref).abs()
    excess = (err - (K + 4) * U * bound).max().item() if err.numel() else 0.0
    assert excess <= 1e-30, (f"{fmt} {tuple(q.shape)} K={K} T={x.shape[0]} bias={b is not None}"
                             f" {kernel.variant}: max error {err.max().item():.3g}")
    return out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(T=st.integers(1, 12), blocks=st.integers(1, 20), O=st.integers(1, 70),
       fmt=st.sampled_from(FORMATS), bias=st.booleans(), raw=st.booleans(),
       layout=st.sampled_from(["contiguous", "strided"]), seed=st.integers(0, 2**31 - 1))
def test_kernel_property(T, blocks, O, fmt, bias, raw, layout, seed):
    """Any T (groups of up to 8 tokens), K = 32..640, O = 1..70 (odd counts, chunk tails),
    weights as quantize makes them or any block bytes, with and without a bias."""
    gen = torch.Generator().manual_seed(seed)
    K = 32 * blocks
    q = (raw_blocks if raw else quantized)(gen, O, K, fmt)
    b = torch.randn(O, generator=gen) if bias else None
    x = torch.randn(T, K, generator=gen) if layout == "contiguous" else \
        torch.randn(T, 2 * K, generator=gen)[:, ::2]
    check(q, fmt, K, b, x)


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_lm_head(fmt):
    """SmolLM2's LM head, 49152 x 576: one token and eight."""
    gen = torch.Generator().manual_seed(7)
    q = quantized(gen, 49152, 576, fmt)
    for T in (1, 8):
        check(q, fmt, 576, None, torch.randn(T, 576, generator=gen))


BUILDS = {  # ISA (as pi_dense_variant names it) -> quant_kernel_for's build options
    "scalar": dict(tuning={"SCALAR": 1}),
    "avx2": dict(avx512=False),
    "avx2-prefetch": dict(avx512=False, tuning={"PF_BYTES": 4096}),  # as default_tuning on Intel
    "avx2-no-prefetch": dict(avx512=False, tuning={"PF_BYTES": 0}),  # and elsewhere
    "avx512": dict(avx512=True),
    "avx512-dynamic": dict(avx512=True, tuning={"DYNAMIC": 1}),
}
CASES = [(32, 1, 1), (64, 3, 2), (96, 17, 3), (160, 16, 4), (576, 40, 5), (640, 64, 8),
         (1536, 130, 6), (608, 200, 7), (32, 1, 11)]  # (K, O, T): odd block counts, tails


def _skip_unbuilt(build: str) -> None:
    if build.startswith("avx512") and not c.avx512_available():
        pytest.skip("no AVX-512F on this CPU")
    if build.startswith("avx2") and "-mavx2" not in c.build_flags():
        pytest.skip("no AVX2 / FMA / F16C on this CPU")


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_builds(fmt, build):
    """Every code path the library can be built with, on any block bytes."""
    _skip_unbuilt(build)
    gen = torch.Generator().manual_seed(5)
    assert dense.quant_kernel_for(raw_blocks(gen, 1, 32, fmt), fmt, 32,
                                  **BUILDS[build]).variant == f"{fmt} {build.split('-')[0]}"
    for i, (K, O, T) in enumerate(CASES):
        q = raw_blocks(gen, O, K, fmt)
        b = torch.randn(O, generator=gen) if i % 2 else None
        check(q, fmt, K, b, torch.randn(T, K, generator=gen), **BUILDS[build])


@pytest.mark.parametrize("fmt", FORMATS)
def test_simd_against_scalar(fmt):
    """The vector builds and the scalar fallback agree (each within the bound of the exact
    result, so within twice it of each other)."""
    gen = torch.Generator().manual_seed(6)
    builds = [b for b in ("avx2", "avx512") if not (
        (b == "avx512" and not c.avx512_available()) or "-mavx2" not in c.build_flags())]
    if not builds:
        pytest.skip("no SIMD build on this CPU")
    for K, O, T in CASES:
        q = raw_blocks(gen, O, K, fmt)
        b = torch.randn(O, generator=gen)
        x = torch.randn(T, K, generator=gen)
        scalar = check(q, fmt, K, b, x, **BUILDS["scalar"]).double()
        bound = F.linear(x.double().abs(), magnitude(q, fmt, K).double()) + b.double().abs()
        for build in builds:
            simd = check(q, fmt, K, b, x, **BUILDS[build]).double()
            assert ((simd - scalar).abs() <= 2 * (K + 4) * U * bound).all(), build


@pytest.mark.parametrize("fmt", FORMATS)
def test_thread_count_independent(fmt):
    gen = torch.Generator().manual_seed(4)
    q = quant.interleave_blocks(quantized(gen, 4096, 576, fmt), fmt)
    x = torch.randn(3, 576, generator=gen)
    kernel = dense.quant_kernel_for(q, fmt, 576, torch.randn(4096, generator=gen))
    assert_thread_count_independent(kernel, x)


def test_kernel_shapes_and_errors(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    q = quant.interleave_blocks(quantized(gen, 10, 64, "q4_0"), "q4_0")
    kernel = dense.quant_kernel_for(q, "q4_0", 64)
    assert kernel.weight is q or kernel.weight.data_ptr() == q.data_ptr()  # no copy
    assert kernel(torch.zeros(0, 64)).shape == (0, 10)
    assert kernel(torch.randn(2, 3, 64)).shape == (2, 3, 10)
    with pytest.raises(ValueError):
        kernel(torch.zeros(2, 63))
    b16 = torch.randn(10).half()
    k16 = dense.quant_kernel_for(q, "q4_0", 64, b16)
    assert k16.bias.dtype == torch.float32  # the bias is read as float32
    with pytest.raises(ValueError, match="multiple of 32"):
        dense.quant_kernel_for(torch.zeros(4, 18, dtype=torch.uint8), "q4_0", 48)
    with pytest.raises(ValueError, match="uint8"):
        dense.quant_kernel_for(q, "q8_0", 64)  # q4_0's row bytes
    with pytest.raises(ValueError, match="unknown"):
        dense.quant_kernel_for(q, "q5_0", 64)
    with pytest.raises(ValueError):
        dense.flags("int8")  # neither a float dtype nor a format
    assert dense.quant_kernel_for(q.to("meta"), "q4_0", 64) is None
    assert "not on the CPU" in dense.why_no_quant_kernel(q.to("meta"), "q4_0", 64)
    monkeypatch.setenv("PICOMPILE_REFERENCE", "1")
    assert dense.quant_kernel_for(q, "q4_0", 64) is None
    assert "PICOMPILE_REFERENCE" in dense.why_no_quant_kernel(q, "q4_0", 64)


# ---------------------------------------------------------------------------------------------
# QuantLinear
# ---------------------------------------------------------------------------------------------


def _close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, mod: QuantLinear) -> None:
    """Kernel path against forward_native, both in float32: each within the bound of the exact
    result (float32 F.linear accumulates with at most the same error)."""
    bound = F.linear(x.double().abs(),
                     magnitude(mod.row_blocks(), mod.qformat, mod.in_features).double())
    if mod.bias is not None:
        bound = bound + mod.bias.double().abs()
    tol = 2 * (mod.in_features + 4) * U * bound
    assert ((got.double() - want.double()).abs() <= tol).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_linear_module(fmt):
    torch.manual_seed(0)
    lin = nn.Linear(96, 37)
    mod = QuantLinear.from_linear(lin, fmt)
    assert mod.qformat == fmt and (mod.in_features, mod.out_features) == (96, 37)
    assert not hasattr(mod, "weight")  # no float copy of the weight
    assert mod.qweight.dtype == torch.uint8 and mod.qweight.shape == (37, quant.row_bytes(96, fmt))
    assert torch.equal(mod.row_blocks(), quant.quantize(lin.weight, fmt))
    assert torch.equal(mod.qweight, quant.interleave_blocks(mod.row_blocks(), fmt))  # the kernel's layout
    assert mod.bias.dtype == torch.float32 and torch.equal(mod.bias, lin.bias)
    assert set(mod.state_dict()) == {"qweight", "bias"}
    assert mod.path.startswith(f"C {fmt}") and f"format={fmt}" in repr(mod)
    with torch.no_grad():
        for shape in [(1, 96), (2, 3, 96), (8, 96)]:  # the kernel
            x = torch.randn(shape)
            _close(mod(x), mod.forward_native(x), x, mod)
        x = torch.randn(40, 96)  # prefill: on the kernel where PREFILL_KERNEL_FORMATS says so
        if fmt in PREFILL_KERNEL_FORMATS:
            _close(mod(x), mod.forward_native(x), x, mod)
        else:
            assert torch.equal(mod(x), mod.forward_native(x))
        want = F.linear(quant.round_activations(x, fmt), quant.dequantize(mod.row_blocks(), fmt, 96),
                        lin.bias)
        torch.testing.assert_close(mod.forward_native(x), want)
        for dt in (torch.float16, torch.bfloat16):  # x's dtype in, x's dtype out
            x = torch.randn(2, 96).to(dt)
            out = mod(x)
            assert out.dtype == dt
            torch.testing.assert_close(out, mod.forward_native(x.float()).to(dt),
                                       rtol=2e-2, atol=2e-2)
    # autograd on x: the reference path, with its gradient
    x = torch.randn(3, 96, requires_grad=True)
    mod(x).sum().backward()
    torch.testing.assert_close(x.grad, mod.dequantized_weight().sum(0).expand(3, -1))


def test_quant_linear_from_dense_linear_and_no_bias():
    torch.manual_seed(1)
    lin = nn.Linear(64, 20, bias=False)
    mod = QuantLinear.from_linear(DenseLinear.from_linear(lin), "q8_0")
    assert mod.bias is None and mod.kernel is not None
    x = torch.randn(1, 64)
    with torch.no_grad():
        _close(mod(x), mod.forward_native(x), x, mod)


def test_quant_linear_refusals():
    with pytest.raises(ValueError, match="must stay float"):
        QuantLinear.from_linear(nn.Linear(48, 8), "q4_0")
    with pytest.raises(ValueError, match="unknown quantization"):
        QuantLinear.from_linear(nn.Linear(64, 8), "q3_k")
    mod = QuantLinear.from_linear(nn.Linear(64, 8), "q4_1")
    with pytest.raises(RuntimeError, match="run on the CPU or a CUDA GPU"):
        mod.to("meta")  # a device without kernels (CUDA: tests/test_cuda_quant_gpu.py)
    assert mod.qweight.device.type == "cpu" and mod.kernel is not None  # nothing moved
    mod.float()  # dtype changes of the float tensors are fine; the kernel is bound again
    assert mod.qweight.dtype == torch.uint8 and mod.kernel is not None


def test_quant_linear_rebinds_and_pickles(monkeypatch):
    torch.manual_seed(2)
    mod = QuantLinear.from_linear(nn.Linear(64, 16), "q4_0")
    other = QuantLinear.from_linear(nn.Linear(64, 16), "q4_0")
    x = torch.randn(1, 64)
    with torch.no_grad():
        mod.load_state_dict(other.state_dict(), assign=True)  # new storage: bound again
        _close(mod(x), other.forward_native(x), x, other)
        for clone in (copy.deepcopy(mod), pickle.loads(pickle.dumps(mod))):
            assert clone.kernel is not None
            _close(clone(x), other.forward_native(x), x, other)
        buf = io.BytesIO()
        torch.save(mod.state_dict(), buf)
        buf.seek(0)
        assert torch.equal(torch.load(buf)["qweight"], other.qweight)
    monkeypatch.setenv("PICOMPILE_REFERENCE", "1")
    ref = QuantLinear.from_linear(nn.Linear(64, 16), "q8_0")
    assert ref.kernel is None and ref.path == "reference (PICOMPILE_REFERENCE set)"
    with torch.no_grad():
        assert torch.equal(ref(x), ref.forward_native(x))


# ---------------------------------------------------------------------------------------------
# The whole-step decoder with quantized attention and LM head
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_decoder_runs_quantized_linears(fmt):
    """q/k/v/o and the LM head as QuantLinear: the decoder binds their kernels (the same C
    struct, W = the blocks), and its step logits equal the per-module path's."""
    import picompile
    from tests.test_decoder import _model, _step_logits
    from tests import zoo

    cm = picompile.compile(_model("llama_silu", hidden=64, layers=2), quiet=True)
    model = cm._orig_mod
    model.lm_head = QuantLinear.from_linear(model.lm_head, fmt)
    for layer in model.model.layers:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(layer.self_attn, name,
                    QuantLinear.from_linear(getattr(layer.self_attn, name), fmt))
    dec = cm.decoder()
    assert dec is not None, cm.decoder_reason
    assert all(isinstance(lin, QuantLinear) for layer in dec.layers for lin in layer.linears.values())
    ids = torch.randint(3, zoo.VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    want, got = _step_logits(cm, dec, ids, prompt=5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@settings(max_examples=30, deadline=None)
@given(fmt=st.sampled_from(FORMATS), O=st.integers(1, 40), blocks=st.integers(1, 27),
       dot_layout=st.booleans(), seed=st.integers(0, 2**16))
def test_c_dequantize_equals_the_reference_bit_for_bit(fmt, O, blocks, dot_layout, seed):
    """Prefill's weights, dequantized in C (both row layouts; rows with whole superblocks and
    tail blocks; any block bytes), are quant.dequantize's, exactly."""
    K = 32 * blocks
    q = raw_blocks(torch.Generator().manual_seed(seed), O, K, fmt)
    want = quant.dequantize(q, fmt, K)
    got = dense.dequantize(quant.interleave_blocks(q, fmt) if dot_layout else q, fmt, K, dot_layout)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_linear_prefill_equals_its_reference(fmt):
    """More tokens than a decode call: the 4-bit formats run the kernel (groups of 8 tokens),
    the kernel's own result for those tokens and within its bound of forward_native; q8_0 runs
    BLAS over the C-dequantized weight: forward_native's result, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    lin = QuantLinear(quantized(gen, 48, 320, fmt), fmt, 320, torch.randn(48, generator=gen))
    lin.select_kernel()
    assert lin.kernel is not None
    x = torch.randn(2, 13, 320, generator=gen)  # 26 tokens: prefill
    with torch.no_grad():
        got = lin(x)
        if fmt in PREFILL_KERNEL_FORMATS:
            assert torch.equal(got[0, :8], lin.kernel(x[0, :8]))  # the kernel ran it
            _close(got.reshape(-1, 48), lin.forward_native(x).reshape(-1, 48), x.reshape(-1, 320), lin)
        else:
            assert torch.equal(got, lin.forward_native(x))
