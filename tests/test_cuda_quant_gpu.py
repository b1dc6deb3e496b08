"""The CUDA kernels on quantized rows (q8_0 / q4_0 / q4_1 gate and up, q8_0 down) against the
plain-PyTorch reference `ffn_reference(..., qformat=, down_qformat=)`, on a GPU.

Run where a CUDA device and cupy exist: `pytest -m gpu tests/test_cuda_quant_gpu.py`.

The kernels decode blocks exactly (qdecode.h; tests/test_quant_decode_host.py checks that on the
CPU) and round x for the 4-bit formats bit for bit as the reference does, so the only difference
is fp32 summation against the float64 reference over the very same weights and inputs: TOL of
1 + max |out|. Thresholds and tau are placed in gaps of the reference values, so rounding never
flips an active / fires decision; n_active gets a slack of 2 for ReLU values within rounding of 0.
"""

from __future__ import annotations

import functools

import pytest
import torch

from picompile import quant
from picompile.runtime.sparse_ffn import down_input, ffn_reference

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cupy", reason="needs cupy (pip install 'picompile[cuda13]' or '[cuda12]')")

from picompile.codegen import cuda  # noqa: E402

DEV = torch.device("cuda")
FORMATS = ("q8_0", "q4_0", "q4_1")
TOL = 5e-5
# (d, n_rows): d a multiple of 32 with superblock tails (nb % 8 != 0: 96, 288, 800) and without,
# n below / above one mask word, lists long enough for the down split.
SHAPES = [(32, 40), (96, 100), (256, 77), (288, 333), (800, 31), (1024, 700), (4096, 1536)]
ACTS = [("relu", True, False), ("silu", True, False), ("relu", True, True), ("gelu", False, False),
        ("gelu_tanh", False, False)]  # (act, gated, drelu)


@functools.lru_cache(maxsize=16)
def _block(d, n, fmt, gated, bias, seed=0):
    """CPU tensors in ffn_reference's keywords, quantized as SparseFFN.quantize_ makes them:
    gate / up rows in `fmt` (4-bit ones in the dot layout), down rows q8_0, biases float32."""
    g = torch.Generator().manual_seed(seed)

    def rows(scale):
        return torch.randn(n, d, generator=g) * scale

    def gate_up(w):
        return quant.interleave_blocks(quant.quantize(w, fmt), fmt)

    w = dict(w_up=gate_up(rows(d**-0.5)), w_down_t=quant.quantize(rows(n**-0.5), "q8_0"),
             b_down=torch.randn(d, generator=g) * 0.1)
    if gated:
        w["w_gate"] = gate_up(rows(d**-0.5))
    if bias:
        w["b_up"] = torch.randn(n, generator=g) * 0.3
        if gated:
            w["b_gate"] = torch.randn(n, generator=g) * 0.3
    return w


def _x(T, d, seed=1):
    return torch.randn(T, d, generator=torch.Generator().manual_seed(seed))


def _gap(values, q=0.5) -> float:
    """A number near the q-quantile of `values`, relative 1e-4 away from each of them."""
    s = torch.sort(values.flatten().double()).values.tolist()
    if len(s) < 2:
        return 0.5
    k = min(max(int(q * len(s)), 1), len(s) - 1)
    for off in range(len(s)):
        for c in (k + off, k - off):
            if 1 <= c < len(s) and s[c] - s[c - 1] > 1e-4 * (1.0 + abs(s[c])):
                return 0.5 * (s[c - 1] + s[c])
    return s[-1] + 1.0


def _kw(w, fmt, act, drelu):
    return dict(act=act, drelu=drelu, qformat=fmt, down_qformat="q8_0", **w)


def _reference(x, w, fmt, act, drelu, threshold, idx):
    return ffn_reference(x, **_kw(w, fmt, act, drelu), threshold=threshold, idx=idx,
                         compute_dtype=torch.float64)


def _threshold(x, w, fmt, act, drelu, idx, on: bool) -> float:
    if not on:
        return 0.0
    h = down_input(x, w["w_up"], w_gate=w.get("w_gate"), b_gate=w.get("b_gate"),
                   b_up=w.get("b_up"), act=act, drelu=drelu, idx=idx, qformat=fmt,
                   compute_dtype=torch.float64).abs()
    return _gap(h[h > 0]) if (h > 0).any() else 0.5


def _ffn(w, fmt, act, drelu, threshold, **pred):
    d = {k: t.to(DEV) for k, t in w.items()}
    return cuda.CudaFFN(d.pop("w_up"), d.pop("w_down_t"), **d, act=act, drelu=drelu,
                        threshold=threshold, qformat=fmt, down_qformat="q8_0",
                        **{k: t.to(DEV) for k, t in pred.items()})


def _check(out, n_active, ref, active, what):
    torch.cuda.synchronize()
    assert out.dtype == torch.float32 and out.is_cuda
    err = (out.double().cpu() - ref).abs().max().item() if ref.numel() else 0.0
    bound = TOL * (1.0 + ref.abs().max().item())
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"
    assert abs(int(n_active) - int(active.sum())) <= 2, what


def _subset(n, density, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=g)[: int(round(density * n))]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("d,n", SHAPES)
@pytest.mark.parametrize("act,gated,drelu", ACTS)
def test_given_idx(fmt, d, n, act, gated, drelu):
    """Shapes x formats x forms, T = 1..8, sparse to dense lists, bias and threshold both ways."""
    for T in (1, 2, 5, 8):
        for density, bias, thr_on in ((0.0, False, False), (0.05, True, True), (0.5, False, True),
                                      (1.0, True, False)):
            w = _block(d, n, fmt, gated, bias)
            x = _x(T, d, seed=T)
            idx = _subset(n, density, seed=T + d)
            thr = _threshold(x, w, fmt, act, drelu, idx, thr_on)
            out, n_active = _ffn(w, fmt, act, drelu, thr).ffn_given_idx(x.to(DEV), idx.to(DEV))
            ref, active = _reference(x, w, fmt, act, drelu, thr, idx)
            _check(out, n_active, ref, active, f"{fmt} {act} d={d} n={n} T={T} m={idx.numel()}")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("d,n", [(96, 100), (1024, 700)])
def test_given_mask(fmt, d, n):
    """A predictor's mask [T, n] (the hybrid runtime's input): the union of its rows."""
    w = _block(d, n, fmt, True, True)
    for T in (1, 3, 8):
        x = _x(T, d, seed=10 + T)
        mask = torch.rand(T, n, generator=torch.Generator().manual_seed(T)) < 0.1
        idx = mask.any(0).nonzero().flatten()
        out, n_active = _ffn(w, fmt, "relu", False, 0.0).ffn_given_mask(x.to(DEV), mask.to(DEV))
        ref, active = _reference(x, w, fmt, "relu", False, 0.0, idx)
        _check(out, n_active, ref, active, f"{fmt} mask T={T}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_predicted(fmt):
    """The whole pipeline: float32 predictor on the device -> compaction -> quantized rows."""
    d, n, r = 512, 300, 64
    w = _block(d, n, fmt, True, False)
    g = torch.Generator().manual_seed(5)
    p1, pb1 = torch.randn(r, d, generator=g) * d**-0.5, torch.randn(r, generator=g) * 0.1
    p2, pb2 = torch.randn(n, r, generator=g) * r**-0.5, torch.randn(n, generator=g) * 0.1
    for T in (1, 4, 8):
        x = _x(T, d, seed=20 + T)
        logits = torch.relu(x.double() @ p1.double().T + pb1.double()) @ p2.double().T + pb2.double()
        tau = _gap(logits, 0.8)
        ffn = _ffn(w, fmt, "silu", False, 0.0, p1=p1, pb1=pb1, p2=p2, pb2=pb2)
        ffn.tau = tau
        out, n_active = ffn(x.to(DEV))
        idx = (logits > tau).any(0).nonzero().flatten()
        assert torch.equal(ffn.last_idx[: int(ffn.last_count)].cpu().long(), idx)
        ref, active = _reference(x, w, fmt, "silu", False, 0.0, idx)
        _check(out, n_active, ref, active, f"{fmt} predicted T={T}")


def test_four_bit_rows_read_rounded_x():
    """The 4-bit kernels match the reference that rounds x, not one that does not: the
    comparison above could fail if the rounding were skipped."""
    d, n, T = 1024, 256, 2
    w = _block(d, n, "q4_0", False, False)
    x = _x(T, d, seed=3) * torch.logspace(-2, 0, d)  # per-block spread: rounding is visible
    idx = torch.arange(n)
    out, _ = _ffn(w, "q4_0", "gelu", False, 0.0).ffn_given_idx(x.to(DEV), idx.to(DEV))
    ref, _ = _reference(x, w, "q4_0", "gelu", False, 0.0, idx)
    w8 = dict(w, w_up=quant.dequantize(quant.deinterleave_blocks(w["w_up"], "q4_0"), "q4_0", d),
              w_down_t=quant.dequantize(w["w_down_t"], "q8_0", d))
    unrounded, _ = ffn_reference(x, **w8, act="gelu", idx=idx, compute_dtype=torch.float64)
    err = (out.double().cpu() - ref).abs().max().item()
    assert err <= TOL * (1 + ref.abs().max().item())
    assert (out.double().cpu() - unrounded).abs().max().item() > 10 * err


def test_float_rows_refused_with_quantized_format():
    w = _block(64, 32, "q4_0", True, False)
    d = {k: t.to(DEV) for k, t in w.items()}
    with pytest.raises(ValueError, match="CUDA kernels take"):
        cuda.CudaFFN(d["w_up"], torch.zeros(32, 64, device=DEV), w_gate=d["w_gate"],
                     qformat="q4_0")


@pytest.mark.parametrize("fmt", FORMATS)
def test_hybrid_quantized_block_equals_the_reference(fmt):
    """HybridFFN on a quantized block: hot rows copied to the GPU as the CPU holds them, run by
    the quantized CUDA kernels, cold rows by the C kernels, merged on the device."""
    import picompile
    from picompile.runtime.hybrid import HybridFFN
    from tests import zoo

    cm = picompile.compile(zoo.make("llama_relu"), quiet=True)
    ffn = next(iter(cm.ffns().values()))
    ffn.quantize_(fmt, "q8_0")
    hyb = HybridFFN(ffn, "cuda", ffn.n_ff // 2)
    assert hyb.hot.w_up.is_cuda and hyb.hot.w_up.dtype == torch.uint8
    for T in (1, 4):
        x = torch.randn(T, ffn.d_model, generator=torch.Generator().manual_seed(T))
        rows = torch.rand(ffn.n_ff, generator=torch.Generator().manual_seed(T)) < 0.3
        for predicted in (None, rows.expand(T, -1)):  # the same rows for every token
            idx = None if predicted is None else rows.nonzero().flatten()
            ref, _ = ffn_reference(x, **ffn.weights(), act=ffn.act, drelu=ffn.drelu,
                                   threshold=ffn.threshold, idx=idx, compute_dtype=torch.float64)
            out = hyb(x.to(DEV), None if predicted is None else predicted.to(DEV))
            torch.cuda.synchronize()
            err = (out.double().cpu() - ref).abs().max().item()
            assert err <= 1e-4 * (1.0 + ref.abs().max().item()), (fmt, T, err)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k,o", [(32, 1), (96, 33), (288, 700), (800, 257), (1312, 40),
                                 (4096, 1024), (32, 9000)])
def test_quant_linear_equals_the_reference(fmt, k, o):
    """codegen.cuda.quant_linear (the dense linear kernels on rows in the dot layout, superblock
    tails included, several blocks a lane with a tail at 1312, a grid-stride loop at 9000 rows)
    against the float64 reference on the CPU, for 1 to 13 tokens (groups of 8, a last group of
    1 at 9), 40 (tiles dequantized and multiplied), float32 and float16 x, with and without a
    bias; and QuantLinear moved to the GPU runs it."""
    from picompile.runtime.dense_linear import QuantLinear

    g = torch.Generator().manual_seed(k + o)
    lin = torch.nn.Linear(k, o, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(o, k, generator=g) * k**-0.5)
        lin.bias.copy_(torch.randn(o, generator=g))
    layer = QuantLinear.from_linear(lin, fmt)
    for T in (1, 3, 8, 9, 13, 40):
        for dtype in (torch.float32, torch.float16):
            x = torch.randn(T, k, generator=g).to(dtype)
            for bias in (layer.bias, None):  # (round_activations answers in float32)
                ref = torch.nn.functional.linear(
                    quant.round_activations(x.float(), fmt).double(),
                    layer.dequantized_weight().double(), None if bias is None else bias.double())
                got = cuda.quant_linear(x.to(DEV), layer.qweight.to(DEV), fmt,
                                        None if bias is None else bias.to(DEV))
                torch.cuda.synchronize()
                assert got.shape == (T, o) and got.dtype == torch.float32
                err = (got.double().cpu() - ref).abs().max().item()
                assert err <= TOL * (1 + ref.abs().max().item()), (fmt, T, dtype, bias is None, err)
    on_gpu = QuantLinear.from_linear(lin.to(DEV), fmt)  # quantized on the CPU, then moved back
    assert on_gpu.qweight.is_cuda and on_gpu.path.startswith("CUDA")
    x = torch.randn(2, 5, k, generator=g)
    with torch.no_grad():
        want = layer.forward_native(x)
        got = on_gpu(x.to(DEV))
    assert got.is_cuda and got.shape == (2, 5, o)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
