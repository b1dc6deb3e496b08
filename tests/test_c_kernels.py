"""The generated C kernels (picompile/codegen/c.py) against ffn_reference, and the build cache.

Test data is dyadic (small integers over a power of two), so that every gate and up dot product
is exact in float32 whatever the summation order, and fp16 / bf16 weights hold it exactly: ReLU
decisions then agree bit for bit with the reference and active counts compare exactly. For
silu / gelu the threshold is put in a wide gap between the reference's |h| values, so that
last-ulp differences between libm and torch cannot flip a neuron.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from picompile.codegen import c
from picompile.codegen.cache import cache_dir, cache_key, cached_build
from picompile.runtime.predictor import Predictor
from picompile.plan import BlockPlan, Decisions
from picompile.runtime.sparse_ffn import SparseFFN, down_input, ffn_reference, predicted_candidates

KINDS = ("plain", "gated", "drelu")
TORCH_DT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module", autouse=True)
def _built_variants():
    """Build the float variants these tests use once, in parallel (a no-op when the cache is
    warm); the quantized ones are built by tests/test_ffn_quant.py as it needs them."""
    c.compile_all_variants(formats=c.DTYPES)


def variant(dtype: str, kind: str, bias: bool, act: str) -> c.Variant:
    return c.Variant(dtype, kind != "plain", kind == "drelu", bias, act)


# ---------------------------------------------------------------------------------------------
# Test data
# ---------------------------------------------------------------------------------------------


def dyadic(gen: torch.Generator, *shape, scale: int = 16) -> torch.Tensor:
    """Integers in [-scale, scale] over scale: exact in fp16 and bf16, dot products exact in fp32."""
    return torch.randint(-scale, scale + 1, shape, generator=gen).double() / scale


def make_case(
    v: c.Variant,
    T: int,
    d: int,
    n_ff: int,
    density: float,
    seed: int,
    collinear: bool = False,
):
    """(ffn weights as float64, x float64 [T, d]) with about `density` of the neurons firing for
    ReLU blocks: planted by shifting biases (bias variants) or sign-flipping rows (token 0 decides,
    and with collinear tokens all tokens do)."""
    gen = torch.Generator().manual_seed(seed)
    x = dyadic(gen, T, d, scale=8)
    if collinear:  # every token a positive multiple of token 0: signs of dot products agree
        x = x[:1] * torch.tensor([0.5, 1.0, 2.0]).double()[torch.arange(T) % 3, None]
    w_up, w_down_t = dyadic(gen, n_ff, d), dyadic(gen, n_ff, d)
    w_gate = dyadic(gen, n_ff, d) if v.gated else None
    b_gate = dyadic(gen, n_ff) if v.bias and v.gated else None
    b_up = dyadic(gen, n_ff) if v.bias else None
    b_down = dyadic(gen, d) if v.bias else None
    on = torch.rand(n_ff, generator=gen) < density  # neurons meant to fire

    def plant(w, b, want_on):
        """Make w x + b positive where want_on, non-positive elsewhere (exact arithmetic)."""
        pre = x @ w.T  # [T, n_ff], exact
        if b is not None:  # shift: all tokens decided, bias stays an integer over 16
            lo, hi = pre.min(0).values, pre.max(0).values
            b.copy_(torch.where(want_on, -torch.floor(lo) + 1, -torch.ceil(hi) - 1))
        else:  # flip rows so that token 0 has the wanted sign
            s = pre[0]
            flip = (want_on & (s < 0)) | (~want_on & (s > 0))
            w[flip] = -w[flip]

    if v.act == "relu":
        if v.gated:
            plant(w_gate, b_gate, on)
            if v.drelu:  # the up branch goes through relu as well
                plant(w_up, b_up, on | (torch.rand(n_ff, generator=gen) < 0.5))
        else:
            plant(w_up, b_up, on)
    weights = dict(w_up=w_up, w_down_t=w_down_t, w_gate=w_gate, b_gate=b_gate, b_up=b_up,
                   b_down=b_down)
    return weights, x


def module(v: c.Variant, weights: dict, threshold: float) -> SparseFFN:
    kind = "drelu" if v.drelu else "gated" if v.gated else "plain"
    n_ff, d = weights["w_up"].shape
    bp = BlockPlan(name="ffn", module="m", kind=kind, act=v.act, d_model=d, d_ff=n_ff,
                   bias=v.bias, dtype=v.dtype, decided=Decisions(threshold=threshold))
    dt = TORCH_DT[v.dtype]
    w = {k: None if t is None else t.to(dt) for k, t in weights.items()}
    return SparseFFN(bp, w.pop("w_up"), w.pop("w_down_t"), **w)


def pick_threshold(h: torch.Tensor, sparsity: float, floor: float) -> float:
    """A threshold >= floor leaving about `sparsity` of |h| at or below it, far from every value."""
    vals = np.unique(h.abs().double().numpy().ravel())
    cands = np.concatenate([(vals[:-1] + vals[1:]) / 2, [vals[-1] * 2 + 1, floor]])
    # distance from each candidate to the nearest value
    pos = np.searchsorted(vals, cands)
    below = np.abs(cands - vals[np.clip(pos - 1, 0, len(vals) - 1)])
    above = np.abs(vals[np.clip(pos, 0, len(vals) - 1)] - cands)
    margin = np.minimum(below, above)
    ok = (cands >= floor) & (margin > 1e-3 * cands + 1e-5)
    cands = cands[ok]
    frac = np.searchsorted(vals, cands) / len(vals)  # rough: unique values, not counts
    return float(cands[np.argmin(np.abs(frac - sparsity))])


def check(v: c.Variant, weights: dict, x: torch.Tensor, *, threshold: float,
          idx: torch.Tensor | None = None, mask: torch.Tensor | None = None, x_view=None):
    """The kernel on candidates `idx`, or on `mask` [T, n_ff] (a predictor's output: token t
    uses the neurons set in its row), against the reference."""
    ffn = module(v, weights, threshold)
    kernel = c.kernel_for(ffn)
    assert kernel is not None
    xin = x.float() if x_view is None else x_view
    out, n_active = kernel(xin, threshold=threshold, idx=idx, mask=mask)
    allowed = None
    if mask is not None:
        idx, allowed = predicted_candidates(mask)
    ref, active = ffn_reference(x.float(), **ffn.weights(), act=v.act, drelu=v.drelu,
                                threshold=threshold, idx=idx, allowed=allowed)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert n_active == int(active.sum())
    # error bound: float32 rounding of each active term of the down projection, and the bias
    h = down_input(x, **{k: weights[k] for k in ("w_up", "w_gate", "b_gate", "b_up")},
                   act=v.act, drelu=v.drelu, idx=idx, compute_dtype=torch.float64)
    wd = weights["w_down_t"] if idx is None else weights["w_down_t"][idx.long()]
    bound = (h.abs() * active) @ wd.abs()
    if weights["b_down"] is not None:
        bound = bound + weights["b_down"].abs()
    err = (out.double() - ref.double()).abs()
    assert bool((err <= 1e-4 * bound + 1e-5).all()), f"max err {err.max():.3g}, bound {bound.max():.3g}"
    return out, n_active, active


# ---------------------------------------------------------------------------------------------
# Kernel against the reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("act", c.ACTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", c.DTYPES)
def test_every_variant(dtype, kind, bias, act):
    v = variant(dtype, kind, bias, act)
    for T, d, n_ff, seed in ((1, 64, 96, 0), (3, 37, 50, 1), (8, 70, 130, 2)):
        weights, x = make_case(v, T, d, n_ff, density=0.4, seed=seed)
        if act == "relu":
            thr = 0.0
        else:
            h = down_input(x, **{k: weights[k] for k in ("w_up", "w_gate", "b_gate", "b_up")},
                           act=act, drelu=v.drelu, compute_dtype=torch.float64)
            thr = pick_threshold(h, 0.6, floor=1e-3)
        check(v, weights, x, threshold=thr)


@st.composite
def cases(draw):
    v = variant(draw(st.sampled_from(c.DTYPES)), draw(st.sampled_from(KINDS)),
                draw(st.booleans()), draw(st.sampled_from(c.ACTS)))
    T = draw(st.integers(1, 20))  # past 8: the kernel takes tokens in groups of 8
    d = draw(st.one_of(st.integers(1, 70), st.sampled_from([8, 16, 32, 64])))
    n_ff = draw(st.integers(1, 300))
    sparsity = draw(st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0)))
    collinear = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    idx_mode = draw(st.sampled_from(["all", "all", "subset", "empty", "repeats", "mask"]))
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided", "float64", "float16"]))
    relu_threshold = draw(st.booleans())
    return v, T, d, n_ff, sparsity, collinear, seed, idx_mode, layout, relu_threshold


def candidates(idx_mode: str, T: int, n_ff: int, gen: torch.Generator):
    """(idx, mask) for the kernel's candidate neurons: "all" (both None), "mask" (a predictor's
    output [T, n_ff]), "subset", "empty" or "repeats" (idx with duplicates)."""
    idx = mask = None
    if idx_mode == "mask":
        mask = torch.rand(T, n_ff, generator=gen) < float(torch.rand((), generator=gen))
    elif idx_mode == "subset":
        idx = torch.randperm(n_ff, generator=gen)[: int(torch.randint(0, n_ff + 1, (), generator=gen))]
    elif idx_mode == "empty":
        idx = torch.zeros(0, dtype=torch.long)
    elif idx_mode == "repeats":
        idx = torch.randint(0, n_ff, (n_ff + 3,), generator=gen, dtype=torch.int32)
    return idx, mask


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_matches_reference(case):
    v, T, d, n_ff, sparsity, collinear, seed, idx_mode, layout, relu_threshold = case
    weights, x = make_case(v, T, d, n_ff, 1.0 - sparsity, seed, collinear)
    gen = torch.Generator().manual_seed(seed + 1)
    idx, mask = candidates(idx_mode, T, n_ff, gen)

    if v.act == "relu" and not relu_threshold:
        thr = 0.0
    else:
        h = down_input(x, **{k: weights[k] for k in ("w_up", "w_gate", "b_gate", "b_up")},
                       act=v.act, drelu=v.drelu, idx=idx, compute_dtype=torch.float64)
        thr = pick_threshold(h, sparsity, floor=1e-3) if h.numel() else 0.5

    xf = x.float()
    if layout == "transposed":
        x_view = xf.t().contiguous().t()
    elif layout == "strided":
        x_view = torch.zeros(T, 2 * d + 1)[:, 1::2]
        x_view[:, :d] = xf
        x_view = x_view[:, :d]
    elif layout == "float64":
        x_view = x
    elif layout == "float16":
        x_view = x.half()  # multiples of 1/8 (times 2 when collinear): exact
    else:
        x_view = xf
    if layout in ("transposed", "strided"):
        assert not x_view.is_contiguous() or T == 1 or d == 1
    _, n_active, _ = check(v, weights, x, threshold=thr, idx=idx, mask=mask, x_view=x_view)
    if v.act == "relu" and not relu_threshold and idx is None and (collinear or v.bias):
        if sparsity == 1.0:  # every gate planted off for every token: the empty active set
            assert n_active == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", c.DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_relu_all_inactive_and_all_active(dtype, kind, bias):
    v = variant(dtype, kind, bias, "relu")
    for density, T in ((0.0, 1), (0.0, 5), (1.0, 1), (1.0, 6)):
        weights, x = make_case(v, T, 45, 77, density, seed=T, collinear=True)
        out, n_active, active = check(v, weights, x, threshold=0.0)
        if density == 0.0:
            assert n_active == 0
            expect = weights["b_down"] if bias else torch.zeros(45)
            assert torch.equal(out, expect.float().expand(T, 45))
        elif bias and kind == "plain":
            assert n_active == T * 77  # the bias shift turned every neuron on for every token
        else:
            assert n_active > 0


def test_more_than_eight_tokens():
    """The kernel takes any T (tokens are processed in groups of 8 per weight row)."""
    for v in (variant("float32", "gated", False, "relu"), variant("float16", "plain", True, "silu")):
        weights, x = make_case(v, 19, 40, 100, 0.5, seed=3)
        thr = 0.0 if v.act == "relu" else pick_threshold(
            down_input(x, w_up=weights["w_up"], b_up=weights["b_up"], act=v.act,
                       compute_dtype=torch.float64), 0.5, floor=1e-3)
        check(v, weights, x, threshold=thr)


def test_zero_tokens_and_tiny_shapes():
    v = variant("bfloat16", "gated", True, "relu")
    weights, x = make_case(v, 2, 1, 1, 1.0, seed=0)
    check(v, weights, x, threshold=0.0)
    k = c.kernel_for(module(v, weights, 0.0))
    out, n = k(torch.zeros(0, 1))
    assert out.shape == (0, 1) and n == 0


def test_large_parallel_shape():
    """Big enough for several OpenMP threads; per-chunk partial sums reduced without races, in a
    fixed order: the result does not depend on the thread count."""
    v = variant("float16", "gated", False, "relu")
    weights, x = make_case(v, 4, 256, 2000, 0.3, seed=5)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out, n_active, _ = check(v, weights, x, threshold=0.0)
            results.append((out, n_active))
    finally:
        torch.set_num_threads(threads)
    for out, n_active in results[1:]:
        assert n_active == results[0][1] and torch.equal(out, results[0][0])


# ---------------------------------------------------------------------------------------------
# The predictor kernel against Predictor.forward_native
# ---------------------------------------------------------------------------------------------


def random_predictor(d: int, r: int, n_ff: int, seed: int) -> Predictor:
    g = torch.Generator().manual_seed(seed)
    return Predictor(torch.randn(r, d, generator=g), torch.randn(r, generator=g),
                     torch.randn(n_ff, r, generator=g), torch.randn(n_ff, generator=g))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(T=st.integers(0, 12), d=st.integers(1, 80), r=st.integers(1, 48), n_ff=st.integers(1, 200),
       share=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_predictor_kernel_matches_reference(T, d, r, n_ff, share, seed):
    """Same mask as the float64 logits, except within rounding distance of tau."""
    check_predictor_kernel(T, d, r, n_ff, share, seed)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("T", [1, 8, 11])
def test_predictor_kernel_large_layer(T, threads):
    """n_ff large enough that each thread takes its slice of neurons in several passes
    (PIC_PRED_ACC partial logits at a time), odd so the last slice is not whole cache lines."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_predictor_kernel(T, d=72, r=40, n_ff=5003, share=0.2, seed=T)
    finally:
        torch.set_num_threads(before)


def check_predictor_kernel(T, d, r, n_ff, share, seed):
    pred = random_predictor(d, r, n_ff, seed)
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(seed + 1))
    p1, pb1, p2, pb2, x64 = (t.double() for t in (pred.p1, pred.pb1, pred.p2, pred.pb2, x))
    z = torch.relu(x64 @ p1.T + pb1)  # [T, r]
    logits = z @ p2.T + pb2  # [T, n_ff]
    pred.tau = float(logits.quantile(1 - share)) if logits.numel() else 0.0
    kernel = c.predictor_kernel_for(pred)
    assert kernel is not None
    mask = kernel(x, pred.tau)
    assert mask.dtype == torch.bool and mask.shape == (T, n_ff)
    scale = (x64.abs() @ p1.abs().T + pb1.abs()) @ p2.abs().T + pb2.abs()
    clear = (logits - pred.tau).abs() > 1e-5 * scale + 1e-6
    assert torch.equal(mask[clear], (logits > pred.tau)[clear])
    assert torch.equal(mask[clear], pred.forward_native(x)[clear])


def test_predictor_module_picks_its_path():
    pred = random_predictor(24, 8, 40, seed=3)
    pred.tau = 0.5
    assert pred.select_kernel() == "C"
    calls = []
    kernel = pred.kernel
    pred.kernel = lambda x, tau: calls.append(x.shape[0]) or kernel(x, tau)
    x = torch.randn(1, 3, 24)  # [batch, seq, d]: flattened to [3, 24]
    torch.testing.assert_close(pred(x).float(), pred.forward_native(x.reshape(3, 24)).float())
    pred(torch.randn(12, 24))  # prefill: the reference path
    assert calls == [3]
    pred.enabled = False
    assert pred(x) is None  # the block then runs exact


def test_sparse_ffn_forward_uses_kernel():
    v = variant("float32", "plain", True, "relu")
    weights, x = make_case(v, 3, 32, 64, 0.5, seed=7)
    ffn = module(v, weights, 0.0)
    assert ffn.select_kernel() == "C"
    y = ffn(x.float().reshape(1, 3, 32))
    ref, active = ffn.forward_native(x.float())
    torch.testing.assert_close(y.reshape(3, 32), ref, rtol=1e-5, atol=1e-5)
    assert ffn.active_pairs == int(active.sum()) and ffn.total_pairs == 3 * 64


def test_bad_inputs():
    v = variant("float32", "gated", False, "relu")
    weights, _ = make_case(v, 1, 16, 10, 0.5, seed=0)
    k = c.kernel_for(module(v, weights, 0.0))
    with pytest.raises(IndexError):
        k(torch.zeros(1, 16), 0.0, idx=torch.tensor([3, 10]))
    with pytest.raises(ValueError):
        k(torch.zeros(1, 15), 0.0)


@pytest.fixture(params=["simd", "scalar"])
def isa(request, monkeypatch):
    """Run a test against the AVX2 build and against the portable scalar fallback (the same
    source built without -mavx2 -mfma -mf16c)."""
    if request.param == "scalar":
        monkeypatch.setattr(c, "cpu_flags", lambda: frozenset())
        assert "-mavx2" not in c.build_flags()
    return request.param


@pytest.mark.parametrize("dtype", c.DTYPES)
def test_scalar_fallback_and_simd_agree_with_reference(isa, dtype):
    for kind, bias, act in (("gated", True, "relu"), ("plain", False, "silu"), ("drelu", False, "relu")):
        v = variant(dtype, kind, bias, act)
        weights, x = make_case(v, 5, 43, 90, 0.5, seed=11, collinear=True)
        thr = 0.0 if act == "relu" else pick_threshold(
            down_input(x, w_up=weights["w_up"], act=act, compute_dtype=torch.float64), 0.5, 1e-3)
        check(v, weights, x, threshold=thr)


def test_fp16_subnormal_weights(isa):
    """fp16 -> fp32 conversion of subnormals and small normals, through the F16C path (d >= 8)
    and the scalar one. Every sum here is a multiple of 2^-24 below 2^-2: exact in float32."""
    gen = torch.Generator().manual_seed(0)
    n_ff, d = 300, 43
    bits = torch.randint(1, 0x1800, (n_ff, d), generator=gen, dtype=torch.int32)  # < 2^-9
    sign = torch.randint(0, 2, (n_ff, d), generator=gen, dtype=torch.int32) << 15
    w_up = (bits | sign).to(torch.int16).view(torch.float16)
    assert bool((w_up.float().abs() < 2.0**-14).any())  # subnormals present
    x = torch.zeros(2, d)
    x[0, 0], x[1, d - 1] = 1.0, -1.0  # token 1 reads a column in the scalar tail, negated
    v = variant("float16", "plain", False, "relu")
    weights = dict(w_up=w_up.double(), w_down_t=torch.ones(n_ff, d, dtype=torch.float64),
                   w_gate=None, b_gate=None, b_up=None, b_down=None)
    ffn = module(v, weights, 0.0)
    out, n_active = c.kernel_for(ffn)(x, 0.0)
    h = torch.relu(x.double() @ w_up.double().T)  # [2, n_ff], exact
    assert n_active == int((h > 0).sum())
    assert torch.equal(out.double(), h.sum(1, keepdim=True).expand(2, d))


def test_source_is_readable_and_variant_baked_in():
    v = variant("bfloat16", "drelu", True, "relu")
    src = c.source(v)
    assert "#define PIC_WDTYPE PIC_BF16" in src and "#define PIC_DRELU 1" in src
    assert "[n_ff, d]" in src and "#if defined(__AVX2__) && defined(__FMA__)" in src
    assert c.Variant.of(module(v, make_case(v, 1, 4, 4, 0.5, 0)[0], 0.0)) == v


# ---------------------------------------------------------------------------------------------
# Falling back to the reference
# ---------------------------------------------------------------------------------------------


def _some_module():
    v = variant("float32", "gated", False, "relu")
    return module(v, make_case(v, 1, 8, 8, 0.5, 0)[0], 0.0)


def test_reference_forced(monkeypatch):
    monkeypatch.setenv("PICOMPILE_REFERENCE", "1")
    ffn = _some_module()
    assert c.kernel_for(ffn) is None
    assert ffn.select_kernel().startswith("reference")


def test_missing_compiler_warns_once(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent")
    monkeypatch.setattr(c, "_warned", False)
    ffn = _some_module()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert c.kernel_for(ffn) is None
        assert c.kernel_for(ffn) is None
    msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
    assert len(msgs) == 1 and "\n" not in msgs[0]
    assert "no C compiler" in msgs[0] and "reference" in msgs[0]
    assert ffn.select_kernel() == "reference (no C compiler found: set $CC)"


def test_failed_build_warns(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "false")  # runs, and fails every compile
    monkeypatch.setenv("PICOMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(c, "_warned", False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert c.kernel_for(_some_module()) is None
    assert len(w) == 1 and "failed" in str(w[0].message) and "\n" not in str(w[0].message)
    assert not list(tmp_path.glob("*.so"))


# ---------------------------------------------------------------------------------------------
# Build cache
# ---------------------------------------------------------------------------------------------


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PICOMPILE_CACHE_DIR", str(tmp_path / "a" / "b"))
    assert cache_dir() == tmp_path / "a" / "b" and cache_dir().is_dir()


def test_cache_hit_skips_build(monkeypatch, tmp_path):
    monkeypatch.setenv("PICOMPILE_CACHE_DIR", str(tmp_path))
    calls = []

    def build(src, out):
        calls.append(src.read_text())
        out.write_bytes(b"artifact:" + src.read_bytes())

    p1 = cached_build("int x;", suffix=".so", flags=["-O2"], build=build)
    p2 = cached_build("int x;", suffix=".so", flags=["-O2"], build=build)
    assert p1 == p2 and p1.read_bytes() == b"artifact:int x;" and calls == ["int x;"]
    p3 = cached_build("int x;", suffix=".so", flags=["-O3"], build=build)
    p4 = cached_build("int x;", suffix=".so", flags=["-O2"], build=build, tag="other compiler")
    assert len({p1, p3, p4}) == 3 and len(calls) == 3
    assert p1.name == cache_key("int x;", ["-O2"]) + ".so"
    assert (tmp_path / (cache_key("int x;", ["-O2"]) + ".c")).read_text() == "int x;"
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # no temp dirs left


def test_cache_failed_build_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("PICOMPILE_CACHE_DIR", str(tmp_path))

    def bad(src, out):
        out.write_bytes(b"half")
        raise RuntimeError("cc: error: boom")

    with pytest.raises(RuntimeError, match="boom"):
        cached_build("src", suffix=".so", flags=[], build=bad)
    assert not list(tmp_path.glob("*.so")) and not [p for p in tmp_path.iterdir() if p.is_dir()]
    good = cached_build("src", suffix=".so", flags=[], build=lambda s, o: o.write_bytes(b"ok"))
    assert good.read_bytes() == b"ok"


def test_cache_race_threads(monkeypatch, tmp_path):
    monkeypatch.setenv("PICOMPILE_CACHE_DIR", str(tmp_path))
    n = 6
    barrier = threading.Barrier(n)
    builds, results, errors = [], [], []

    def build(src, out):
        builds.append(threading.get_ident())
        with open(out, "wb") as f:  # slow, piecewise write: a reader must never see it half done
            for i in range(20):
                f.write(b"%03d" % i)
                f.flush()
                threading.Event().wait(0.005)

    def worker():
        try:
            barrier.wait()
            p = cached_build("race", suffix=".bin", flags=["-x"], build=build)
            results.append(p.read_bytes())
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(builds) == 1
    assert results == [b"".join(b"%03d" % i for i in range(20))] * n


_RACER = textwrap.dedent(
    """
    import importlib.util, os, pathlib, sys, time
    spec = importlib.util.spec_from_file_location("pic_cache", sys.argv[1])
    cache = importlib.util.module_from_spec(spec); spec.loader.exec_module(cache)
    go = pathlib.Path(sys.argv[2])
    while not go.exists():
        time.sleep(0.001)

    def build(src, out):
        with open(go.parent / "builds.log", "a") as f:
            f.write(f"{os.getpid()}\\n")
        with open(out, "wb") as f:
            for i in range(30):
                f.write(b"%03d" % i); f.flush(); time.sleep(0.005)

    p = cache.cached_build("race", suffix=".so", flags=["-O3"], build=build, tag="t")
    data = p.read_bytes()
    assert data == b"".join(b"%03d" % i for i in range(30)), data
    print(p)
    """
)


def test_cache_race_processes(tmp_path):
    cache_py = pathlib.Path(c.__file__).with_name("cache.py")
    env = dict(os.environ, PICOMPILE_CACHE_DIR=str(tmp_path / "cache"))
    go = tmp_path / "go"
    procs = [
        subprocess.Popen([sys.executable, "-c", _RACER, str(cache_py), str(go)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    go.touch()
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    assert len({o.strip() for o, _ in outs}) == 1
    assert len((tmp_path / "builds.log").read_text().split()) == 1
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
