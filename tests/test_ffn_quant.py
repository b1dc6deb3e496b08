"""The sparse FFN C kernel on quantized weights (q8_0, q4_0, q4_1: picompile/quant.py) against the
plain-PyTorch reference over the dequantized weights, SparseFFN.quantize_, and quantized blocks in
a compiled model (per module and through the whole-step decoder).

Two kinds of test data:

- "exact" blocks, built directly as GGUF blocks: scales powers of two (2^-8 .. 2^-5), q4_1 minima
  multiples of 2^-7, integers of the format's full range, biases multiples of 1/16; x multiples
  of 1/8 in [-1, 1] (q8_0), or for the 4-bit formats, whose kernels round x to int8 blocks,
  multiples of 2^-7 with each block's largest |x| = 127/128 (`exact_x`: the rounding's scale is
  then 2^-7 and it changes nothing). Every dequantized weight is then a dyadic number of few
  bits, and every product and partial sum of a gate / up dot product (d <= 320 terms, q8_0 below
  4 in steps of 2^-11: sums below 2^11, 22 bits; 4-bit below 1 in steps of 2^-15: 24 bits) is
  exact in float32 whatever the order: the kernel's pre-activations (which sum per block and
  scale once, and for q4_* dot integers and subtract the block-sum terms) equal the reference's
  bit for bit.
  So ReLU decisions and active counts compare exactly; for SiLU the threshold is put in a wide
  gap between the reference's |h| values, so that last-ulp differences between libm's expf and
  torch's cannot flip a neuron.
- blocks quantized by quantize_ from random float weights (what compile(quantize=...) makes),
  with a tolerance derived from float32 accumulation (below, `_float_bound`).

The down rows may have a format of their own (Variant.down_dtype, SparseFFN.down_qformat): the
mixed pairs below (MIXED: 4-bit gate / up with q8_0 down, as compile(gguf=) makes them, and q8_0
with float down rows) run through the same checks; exact float down rows are dyadic numbers
(multiples of 1/16), exact in float16 too.

The down projection sums float32 products h * w in another order than the reference: its error is
bounded by a few float32 roundings of each term, 1e-4 of sum |h| |w_down| (+ |b_down|) as in
tests/test_c_kernels.py, far above the rounding (n_ff <= 300 terms: about 300 * 2^-24 = 2e-5) and
far below any real fault (a wrong nibble, scale or row changes the output by O(1) of it).
"""

from __future__ import annotations

import copy
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from picompile import quant
from picompile.codegen import c
from picompile.plan import BlockPlan, Decisions
from picompile.runtime.sparse_ffn import (SparseFFN, activation, combine, down_input, ffn_reference,
                                           predicted_candidates)
from tests import zoo
from tests.test_decoder import _compile_kw, _step_logits  # shared with the float decoder tests
from tests.test_c_kernels import candidates  # the float kernel tests' candidate sets

FORMATS = list(quant.FORMATS)  # q8_0, q4_0, q4_1
# (gate / up, down) formats: the down rows in another format than the gate and up rows
MIXED = [("q4_1", "q8_0"), ("q4_0", "q8_0"), ("q8_0", "float32"), ("q4_1", "float16")]
PAIRS = [(f, f) for f in FORMATS] + MIXED
KINDS = ("plain", "gated", "drelu")
ACTS = ("relu", "silu")
TORCH_DT = {"float32": torch.float32, "float16": torch.float16}


def variant(fmt: str, kind: str, bias: bool, act: str, down: str | None = None) -> c.Variant:
    return c.Variant(fmt, kind != "plain", kind == "drelu", bias, act, down_dtype=down)


@pytest.fixture(scope="module", autouse=True)
def _built():
    """Build the quantized variants the tests use once, two at a time (no-op on a warm cache)."""
    vs = [variant(f, k, b, a, down) for f, down in PAIRS for k in KINDS for b in (False, True)
          for a in ACTS]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(c.build, vs))


# ---------------------------------------------------------------------------------------------
# Test data
# ---------------------------------------------------------------------------------------------


def exact_blocks(gen: torch.Generator, fmt: str, rows: int, d: int) -> torch.Tensor:
    """uint8 [rows, row_bytes] of GGUF blocks with power-of-two scales (see the module doc)."""
    nb = d // quant.BLOCK
    scale = (2.0 ** -torch.randint(5, 9, (rows, nb), generator=gen).double()).half()
    parts = [scale.view(torch.uint8).reshape(rows, nb, 2)]
    if fmt == "q8_0":
        q = torch.randint(-127, 128, (rows, nb, 32), generator=gen, dtype=torch.int16)
        parts.append(q.to(torch.int8).view(torch.uint8))
    else:
        if fmt == "q4_1":
            m = (torch.randint(-64, 65, (rows, nb), generator=gen).double() / 128).half()
            parts.append(m.view(torch.uint8).reshape(rows, nb, 2))
        n = torch.randint(0, 16, (rows, nb, 32), generator=gen, dtype=torch.uint8)
        parts.append(n[..., :16] | (n[..., 16:] << 4))
    return torch.cat(parts, dim=-1).reshape(rows, -1).contiguous()


def dyadic(gen, *shape, scale: int) -> torch.Tensor:
    return torch.randint(-scale, scale + 1, shape, generator=gen).float() / scale


def exact_down(gen, fmt: str, n_ff: int, d: int) -> torch.Tensor:
    """Exact down rows in `fmt`: GGUF blocks, or dyadic float elements."""
    if fmt in TORCH_DT:
        return dyadic(gen, n_ff, d, scale=16).to(TORCH_DT[fmt])
    return exact_blocks(gen, fmt, n_ff, d)


def dequantized_down(w_down_t: torch.Tensor, fmt: str, d: int) -> torch.Tensor:
    """Down rows in `fmt` as float64 [n_ff, d]."""
    return (w_down_t if fmt in TORCH_DT else quant.dequantize(w_down_t, fmt, d)).double()


def exact_x(gen, fmt: str, T: int, d: int) -> torch.Tensor:
    """x [T, d] for exact_case: multiples of 1/8 in [-1, 1]; for the quantized formats, whose
    kernels round x to b-bit blocks (L = 2^(b-1) - 1), multiples of 1/(L + 1) with each block's
    largest |x| exactly L/(L + 1) (so the rounding's scale is 1/(L + 1) and it leaves x as it is)."""
    if fmt not in quant.FORMATS:
        return dyadic(gen, T, d, scale=8)
    L = 2 ** (quant.format_of(fmt).activation_bits - 1) - 1
    x = torch.randint(-L, L + 1, (T, d // 32, 32), generator=gen).float()
    x[..., int(torch.randint(0, 32, (), generator=gen))] = float(L)
    return x.reshape(T, d) / (L + 1)


def exact_case(fmt: str, v: c.Variant, T: int, d: int, n_ff: int, seed: int):
    """(weights dict in the keyword form of SparseFFN / ffn_reference, x float32 [T, d]); the
    down rows in v.down_dtype."""
    gen = torch.Generator().manual_seed(seed)
    x = exact_x(gen, fmt, T, d)
    w = dict(w_up=exact_blocks(gen, fmt, n_ff, d), w_down_t=exact_down(gen, v.down_dtype, n_ff, d),
             w_gate=exact_blocks(gen, fmt, n_ff, d) if v.gated else None,
             b_gate=dyadic(gen, n_ff, scale=16) if v.bias and v.gated else None,
             b_up=dyadic(gen, n_ff, scale=16) if v.bias else None,
             b_down=dyadic(gen, d, scale=16) if v.bias else None)
    return w, x


def block_plan(v: c.Variant, d: int, n_ff: int, threshold: float = 0.0) -> BlockPlan:
    kind = "drelu" if v.drelu else "gated" if v.gated else "plain"
    return BlockPlan(name="ffn", module="m", kind=kind, act=v.act, d_model=d, d_ff=n_ff,
                     bias=v.bias, dtype="float32", decided=Decisions(threshold=threshold))


def make_module(fmt: str, v: c.Variant, w: dict, d: int, threshold: float = 0.0) -> SparseFFN:
    """A SparseFFN over already quantized weights (the constructor's qformat; the down rows'
    format is v.down_dtype: down_qformat, or float rows)."""
    w = dict(w)  # (GGUF's layout; the module keeps gate and up rows in the dot layout)
    for k in ("w_up", "w_gate"):
        w[k] = None if w[k] is None else quant.interleave_blocks(w[k], fmt)
    down = None if v.down_dtype in TORCH_DT else v.down_dtype
    ffn = SparseFFN(block_plan(v, d, w["w_up"].shape[0], threshold), w.pop("w_up"),
                    w.pop("w_down_t"), **w, qformat=fmt, down_qformat=down)
    ffn.select_kernel()
    return ffn


def pick_threshold(h: torch.Tensor, sparsity: float, floor: float = 1e-3) -> float:
    """A threshold >= floor leaving about `sparsity` of |h| at or below it, in a gap between
    values wide enough (1e-3 relative) that no rounding can cross it."""
    vals = np.unique(h.abs().double().numpy().ravel())
    cands = np.concatenate([(vals[:-1] + vals[1:]) / 2, [vals[-1] * 2 + 1, floor]])
    pos = np.searchsorted(vals, cands)
    below = np.abs(cands - vals[np.clip(pos - 1, 0, len(vals) - 1)])
    above = np.abs(vals[np.clip(pos, 0, len(vals) - 1)] - cands)
    ok = (cands >= floor) & (np.minimum(below, above) > 1e-3 * cands + 1e-5)
    cands = cands[ok]
    frac = np.searchsorted(vals, cands) / len(vals)
    return float(cands[np.argmin(np.abs(frac - sparsity))])


def reference_h(fmt, v, w, x, idx=None):
    """h in float64 over the dequantized weights (exact data: the exact h)."""
    d = x.shape[1]
    deq = {k: None if w[k] is None else quant.dequantize(w[k], fmt, d).double()
           for k in ("w_up", "w_gate")}
    return down_input(x.double(), deq["w_up"], w_gate=deq["w_gate"],
                      b_gate=None if w["b_gate"] is None else w["b_gate"].double(),
                      b_up=None if w["b_up"] is None else w["b_up"].double(),
                      act=v.act, drelu=v.drelu, idx=idx, compute_dtype=torch.float64)


def check_exact(fmt, v, w, x, *, threshold, idx=None, mask=None, ffn=None):
    """The kernel against ffn_reference on exact data: equal active counts, output within the
    down projection's float32 rounding. Returns (out, n_active)."""
    d = x.shape[1]
    ffn = ffn or make_module(fmt, v, w, d)
    kernel = c.kernel_for(ffn)
    assert kernel is not None, c.why_no_kernel(ffn)
    assert kernel.variant == v and kernel.variant.dtype == fmt
    out, n_active = kernel(x, threshold=threshold, idx=idx, mask=mask)
    allowed = None
    if mask is not None:
        idx, allowed = predicted_candidates(mask)
    ref, active = ffn_reference(x, **ffn.weights(), act=v.act, drelu=v.drelu,
                                threshold=threshold, idx=idx, allowed=allowed)
    assert out.dtype == torch.float32 and out.shape == ref.shape == (x.shape[0], d)
    assert n_active == int(active.sum())
    h = reference_h(fmt, v, w, x, idx)
    wd = dequantized_down(w["w_down_t"], v.down_dtype, d)
    wd = wd if idx is None else wd[idx.long()]
    bound = (h.abs() * active) @ wd.abs()
    if w["b_down"] is not None:
        bound = bound + w["b_down"].double().abs()
    err = (out.double() - ref.double()).abs()
    assert bool((err <= 1e-4 * bound + 1e-5).all()), f"max err {err.max():.3g}, bound {bound.max():.3g}"
    return out, n_active


# ---------------------------------------------------------------------------------------------
# The kernel against the reference (exact data)
# ---------------------------------------------------------------------------------------------


def test_exact_blocks_are_what_they_claim():
    """The test data's blocks dequantize to multiples of 2^-8 below 4 in magnitude."""
    gen = torch.Generator().manual_seed(0)
    for fmt in FORMATS:
        w = quant.dequantize(exact_blocks(gen, fmt, 7, 96), fmt, 96)
        assert bool(((w * 2**8).round() == w * 2**8).all()) and float(w.abs().max()) < 4


@st.composite
def cases(draw, pairs=tuple((f, f) for f in FORMATS)):
    fmt, down = draw(st.sampled_from(pairs))
    v = variant(fmt, draw(st.sampled_from(KINDS)), draw(st.booleans()), draw(st.sampled_from(ACTS)),
                down)
    T = draw(st.integers(1, 20))  # past 8: the kernel takes tokens in groups of 8
    d = 32 * draw(st.integers(1, 10))
    n_ff = draw(st.one_of(st.integers(1, 300), st.sampled_from([1, 7, 63, 65, 129, 257, 299])))
    sparsity = draw(st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(0.0, 1.0)))
    idx_mode = draw(st.sampled_from(["all", "all", "subset", "empty", "repeats", "mask"]))
    relu_threshold = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return fmt, v, T, d, n_ff, sparsity, idx_mode, relu_threshold, seed


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_kernel_matches_reference(case):
    check_case(case)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(pairs=tuple(MIXED)))
def test_kernel_with_down_rows_in_their_own_format_matches_reference(case):
    """Gate and up rows in one format, down rows in another (4-bit with q8_0, q8_0 with
    float32, q4_1 with float16)."""
    check_case(case)


def check_case(case):
    fmt, v, T, d, n_ff, sparsity, idx_mode, relu_threshold, seed = case
    w, x = exact_case(fmt, v, T, d, n_ff, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    idx, mask = candidates(idx_mode, T, n_ff, gen)
    if v.act == "relu" and not relu_threshold:
        thr = 0.0  # exact mode
    else:
        h = reference_h(fmt, v, w, x, idx)
        thr = pick_threshold(h, sparsity) if h.numel() else 0.5
    check_exact(fmt, v, w, x, threshold=thr, idx=idx, mask=mask)


@pytest.mark.parametrize("fmt,down", PAIRS)
@pytest.mark.parametrize("kind,act,bias", [("gated", "silu", False), ("plain", "relu", True),
                                           ("gated", "relu", False), ("drelu", "relu", True),
                                           ("gated", "silu", True), ("gated", "relu2", False)])
def test_every_mode(fmt, down, kind, act, bias):
    """Exact (threshold 0), about half firing (a threshold in a gap near the median of |h|) and
    predicted (a mask), 1 to 9 tokens, for the block kinds picompile rewrites."""
    v = variant(fmt, kind, bias, act, down)
    for T, d, n_ff, seed in ((1, 576 // 2, 300, 0), (4, 32, 77, 1), (9, 160, 129, 2)):
        w, x = exact_case(fmt, v, T, d, n_ff, seed)
        ffn = make_module(fmt, v, w, d)
        h = reference_h(fmt, v, w, x)
        half = pick_threshold(h, 0.5)
        _, n_half = check_exact(fmt, v, w, x, threshold=half, ffn=ffn)
        _, n_all = check_exact(fmt, v, w, x, threshold=0.0, ffn=ffn)
        assert 0 < n_half < n_all
        if act == "silu":  # every nonzero h fires in exact mode, about half above `half`
            assert n_all == int((h != 0).sum()) and 0.3 < n_half / n_all < 0.7
        mask = torch.rand(T, n_ff, generator=torch.Generator().manual_seed(seed)) < 0.3
        check_exact(fmt, v, w, x, threshold=half, mask=mask, ffn=ffn)


@pytest.mark.parametrize("fmt,down", PAIRS)
@pytest.mark.parametrize("kind,act", [("gated", "silu"), ("plain", "relu"), ("drelu", "relu")])
def test_stable_entry_gives_each_token_its_own_calls_sums(fmt, down, kind, act):
    """ffn_stable (the C decoder's): with a predictor's mask, each of up to 20 tokens gets bit for
    bit what a call of its own gives (quantized rows dot in integers; the chunks are ranges of
    neuron numbers, not of the union's list), and the reference's result."""
    v = variant(fmt, kind, False, act, down)
    T, d, n_ff = 20, 160, 300
    w, x = exact_case(fmt, v, T, d, n_ff, 3)
    ffn = make_module(fmt, v, w, d)
    kernel = c.kernel_for(ffn)
    half = pick_threshold(reference_h(fmt, v, w, x), 0.5)
    mask = torch.rand(T, n_ff, generator=torch.Generator().manual_seed(4)) < 0.3
    out, n_active = kernel(x, threshold=half, mask=mask, stable=True)
    alone = [kernel(x[t:t + 1], threshold=half, mask=mask[t:t + 1], stable=True) for t in range(T)]
    assert torch.equal(out, torch.cat([o for o, _ in alone]))
    assert n_active == sum(n for _, n in alone)
    want, _ = check_exact(fmt, v, w, x, threshold=half, mask=mask, ffn=ffn)  # ffn: the reference's
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)


@pytest.fixture(params=["simd", "avx2", "scalar"])
def isa(request, monkeypatch):
    """This CPU's build (with -mavx512f where it has AVX-512F), the AVX2 one, and the portable
    scalar fallback (the same source built without -mavx2 -mfma -mf16c)."""
    if request.param == "scalar":
        monkeypatch.setattr(c, "cpu_flags", lambda: frozenset())
        assert "-mavx2" not in c.ffn_flags()
    elif "-mavx2" not in c.build_flags():
        pytest.skip("no AVX2 + FMA + F16C on this CPU")
    elif request.param == "avx2":
        monkeypatch.setattr(c, "avx512_available", lambda: False)
        assert "-mavx512f" not in c.ffn_flags()
    return request.param


@pytest.mark.parametrize("fmt,down", PAIRS)
def test_scalar_fallback_and_simd_agree(isa, fmt, down):
    for kind, bias, act in (("gated", True, "relu"), ("plain", False, "silu"), ("drelu", False, "relu")):
        v = variant(fmt, kind, bias, act, down)
        for T, d in ((1, 96), (5, 160), (9, 320)):  # 3, 5 and 10 blocks: tails and groups
            w, x = exact_case(fmt, v, T, d, 90, seed=T)
            thr = 0.0 if act == "relu" else pick_threshold(reference_h(fmt, v, w, x), 0.5)
            check_exact(fmt, v, w, x, threshold=thr)
    src = c.source(variant(fmt, "gated", False, "relu", down))
    assert "PIC_IS_QUANT" in src and "row_bytes" in src
    assert f"#define PIC_DDTYPE {c._FORMAT_MACROS[down]}" in src


def test_scalar_and_simd_builds_give_the_same_counts(monkeypatch):
    """The two builds side by side on one case of each format: the same active neurons, outputs
    within rounding of each other."""
    if "-mavx2" not in c.build_flags():
        pytest.skip("no AVX2 on this CPU")
    for fmt, down in PAIRS:
        v = variant(fmt, "gated", True, "relu", down)
        w, x = exact_case(fmt, v, 6, 256, 200, seed=5)
        simd = c.kernel_for(make_module(fmt, v, w, 256))(x, 0.0)
        with monkeypatch.context() as m:
            m.setattr(c, "cpu_flags", lambda: frozenset())
            scalar = c.kernel_for(make_module(fmt, v, w, 256))(x, 0.0)
        assert simd[1] == scalar[1]
        torch.testing.assert_close(simd[0], scalar[0], rtol=1e-5, atol=1e-5 * float(simd[0].abs().max()))


@pytest.mark.parametrize("fmt,down", PAIRS)
def test_avx512_build_adds_down_rows_as_the_avx2_build_bit_for_bit(fmt, down, monkeypatch):
    """The AVX-512 build adds quantized down rows 16 floats at a time with the AVX2 build's
    FMAs: the same outputs to the bit, one token (rows in groups) and several (a row at a time),
    every mode's candidates."""
    if not c.avx512_available():
        pytest.skip("no AVX-512F on this CPU")
    assert "-mavx512f" in c.ffn_flags()
    for kind, act in (("gated", "relu"), ("plain", "silu")):
        v = variant(fmt, kind, False, act, down)
        for T, d, n_ff in ((1, 288, 150), (3, 96, 90), (9, 320, 64)):
            w, x = exact_case(fmt, v, T, d, n_ff, seed=T + d)
            ffn = make_module(fmt, v, w, d)
            mask = torch.rand(T, n_ff, generator=torch.Generator().manual_seed(T)) < 0.4
            thr = 0.0 if act == "relu" else pick_threshold(reference_h(fmt, v, w, x), 0.5)
            wide = c.kernel_for(ffn)
            with monkeypatch.context() as m:
                m.setattr(c, "avx512_available", lambda: False)
                narrow = c.kernel_for(ffn)
            for kw in (dict(), dict(mask=mask), dict(mask=mask, stable=True)):
                a, b = wide(x, thr, **kw), narrow(x, thr, **kw)
                assert torch.equal(a[0], b[0]) and a[1] == b[1], (T, kw)


# ---------------------------------------------------------------------------------------------
# quantize_ on float weights
# ---------------------------------------------------------------------------------------------


def float_module(kind: str, act: str, bias: bool, d: int, n_ff: int, seed: int = 0,
                 dtype=torch.float32) -> SparseFFN:
    gen = torch.Generator().manual_seed(seed)
    v = c.Variant("float32", kind != "plain", kind == "drelu", bias, act)

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen) * d**-0.5).to(dtype)

    ffn = SparseFFN(block_plan(v, d, n_ff), rnd(n_ff, d), rnd(n_ff, d),
                    w_gate=rnd(n_ff, d) if kind != "plain" else None,
                    b_gate=rnd(n_ff) if bias and kind != "plain" else None,
                    b_up=rnd(n_ff) if bias else None, b_down=rnd(d) if bias else None)
    ffn.select_kernel()
    return ffn


def _float_bound(ffn: SparseFFN, x: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """A bound on |kernel - reference| for float data (both float32, summing in other orders):
    each dot product of n terms is off by at most n * 2^-24 of the sum of its |terms|
    (the classic worst case); h = act(g) * u inherits |act'| <= 1.1 times g's error times |u|
    plus |act(g)| times u's error; the down projection adds its own n_ff * 2^-24."""
    w = ffn.weights()
    d, eps = x.shape[1], 2.0**-24
    deq = {k: None if w[k] is None else quant.dequantize(w[k], ffn.qformat, d).double()
           for k in ("w_up", "w_gate")}
    deq["w_down_t"] = dequantized_down(w["w_down_t"], ffn.down_format, d)
    ax = x.double().abs()
    x64 = x.double()
    b_up = 0 if w["b_up"] is None else w["b_up"].double()
    u = x64 @ deq["w_up"].T + b_up
    du = (d + 2) * eps * (ax @ deq["w_up"].abs().T + abs(b_up))
    if deq["w_gate"] is not None:
        b_gate = 0 if w["b_gate"] is None else w["b_gate"].double()
        g = x64 @ deq["w_gate"].T + b_gate
        dg = (d + 2) * eps * (ax @ deq["w_gate"].abs().T + abs(b_gate))
        a = activation(ffn.act, g)
        dh = 1.1 * dg * u.abs() + (a.abs() + 1.1 * dg) * du
        h = a * (torch.relu(u) if ffn.drelu else u)
    else:
        h = torch.relu(u) if ffn.act == "relu" else u
        dh = 1.1 * du
    n_ff = h.shape[1]
    wd = deq["w_down_t"].abs()
    bd = 0 if w["b_down"] is None else w["b_down"].double().abs()
    return (dh * active) @ wd + (n_ff + 2) * eps * ((h.abs() + dh) @ wd + bd) + 1e-6


def _decode_matches_reference(ffn: SparseFFN, gen: torch.Generator) -> None:
    """1, 3 and 8 random tokens [T, 192] through the block's kernel and forward (the kernel for
    <= 8 tokens): the reference's active count, its output within _float_bound."""
    for T in (1, 3, 8):
        x = torch.randn(T, 192, generator=gen)
        out, n_active = ffn.kernel(x, 0.0)
        ref, active = ffn.forward_native(x)
        assert n_active == int(active.sum())
        err = (out.double() - ref.double()).abs()
        assert bool((err <= _float_bound(ffn, x, active)).all()), float(err.max())
        torch.testing.assert_close(ffn(x), out)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind,act,bias", [("gated", "silu", False), ("plain", "relu", True),
                                           ("gated", "relu", True), ("drelu", "relu", False)])
def test_quantize_then_kernel_matches_reference(fmt, kind, act, bias):
    ffn = float_module(kind, act, bias, d=192, n_ff=150, seed=3)
    w_float = ffn.w_up.detach().clone()
    assert ffn.quantize_(fmt) is ffn
    assert ffn.qformat == fmt and ffn.kernel is not None and ffn.kernel.variant.dtype == fmt
    assert ffn.n_ff == 150 and ffn.d_model == 192
    assert ffn.row_bytes == quant.row_bytes(192, fmt) and ffn.float_dtype == torch.float32
    for name in ("w_gate", "w_up", "w_down_t"):
        t = getattr(ffn, name)
        if t is not None:
            assert isinstance(t, torch.nn.Parameter) and not t.requires_grad
            assert t.dtype == torch.uint8 and t.shape == (150, quant.row_bytes(192, fmt))
    for name in ("b_gate", "b_up", "b_down"):
        b = getattr(ffn, name)
        assert b is None or b.dtype == torch.float32
    assert fmt in repr(ffn)
    # the quantized weights are the float ones to within the format's step
    step = {"q8_0": 1 / 127, "q4_0": 1 / 7, "q4_1": 1 / 15}[fmt]
    deq = quant.dequantize(ffn.row_blocks("w_up"), fmt, 192)
    blockmax = w_float.reshape(150, 6, 32).abs().amax(-1, keepdim=True).expand(150, 6, 32).reshape(150, 192)
    assert bool(((deq - w_float).abs() <= step * blockmax * (2 if fmt == "q4_1" else 1) + 1e-6).all())

    gen = torch.Generator().manual_seed(4)
    _decode_matches_reference(ffn, gen)


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_and_reference_paths_dequantize(fmt, monkeypatch):
    ffn = float_module("gated", "relu", True, d=64, n_ff=70, seed=1)
    ffn.quantize_(fmt)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(0))  # > 8 tokens: prefill
    want, active = ffn.forward_native(x)
    got = ffn(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert ffn.active_pairs == int(active.sum())
    pred = torch.rand(20, 70, generator=torch.Generator().manual_seed(1)) < 0.5
    y = ffn(x, pred)  # predicted prefill: masked per token
    h = down_input(x, ffn.w_up, w_gate=ffn.w_gate, b_gate=ffn.b_gate, b_up=ffn.b_up, act="relu",
                   qformat=fmt)
    keep = (h.abs() > 0) & pred
    want_p = torch.where(keep, h, 0) @ quant.dequantize(ffn.w_down_t, fmt, 64) + ffn.b_down
    torch.testing.assert_close(y, want_p, rtol=1e-5, atol=1e-5 * float(want_p.abs().max()))
    # the reference path (no C kernel) on a decode-sized input
    monkeypatch.setenv("PICOMPILE_REFERENCE", "1")
    assert "reference" in ffn.select_kernel() and ffn.kernel is None
    x1 = x[:2]
    torch.testing.assert_close(ffn(x1), ffn.forward_native(x1)[0])


@pytest.mark.parametrize("fmt,down", [("q4_0", "q8_0"), ("q8_0", "q8_0"), ("q4_1", "float16"),
                                      ("float16", None)])
@pytest.mark.parametrize("kind,act", [("gated", "relu"), ("gated", "silu"), ("plain", "relu")])
def test_one_token_alone_equals_it_in_a_batch_bit_for_bit(fmt, down, kind, act):
    """A token alone takes the kernel's one-token path (its down rows added several per pass over
    the output, axpy_rows), the same token in a batch of two the per-row path: the same FMAs in
    the same order, so its outputs agree bit for bit; for every kind of candidate list (all
    neurons, scattered neurons, a predictor's mask), with chunks longer than the kernel's blocks
    of neurons and rows with superblocks and tail blocks (d = 320), on 1, 2 and 3 threads (no
    dependence on the thread count)."""
    d, n_ff = 320, 2400
    if fmt == "float16":
        ffn = float_module(kind, act, False, d=d, n_ff=n_ff, seed=7, dtype=torch.float16)
    else:
        ffn = float_module(kind, act, False, d=d, n_ff=n_ff, seed=7).quantize_(fmt, down)
    assert ffn.kernel is not None
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, d, generator=gen)
    idx = torch.randperm(n_ff, generator=gen)[:700]
    pred = torch.rand(1, n_ff, generator=gen) < 0.3
    lists = [({}, {}), ({"idx": idx}, {"idx": idx}), ({"mask": pred}, {"mask": pred.expand(2, -1)})]
    threads = torch.get_num_threads()
    outs = []
    try:
        for nt in (1, 2, 3):
            torch.set_num_threads(nt)
            got = []
            for one_kw, two_kw in lists:
                one, n_one = ffn.kernel(x[:1], 0.0, **one_kw)
                two, _ = ffn.kernel(x, 0.0, **two_kw)
                assert n_one > 0 and torch.equal(one[0], two[0])
                got.append(one)
            outs.append(got)
    finally:
        torch.set_num_threads(threads)
    for got in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, outs[0]))
    ref, _ = ffn.forward_native(x[:1])
    torch.testing.assert_close(outs[0][0], ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_quantize_refuses_what_must_stay_float_and_keeps_or_requantizes():
    ffn = float_module("gated", "silu", False, d=48, n_ff=64)
    with pytest.raises(ValueError, match="must stay float"):
        ffn.quantize_("q8_0")
    assert ffn.qformat is None and ffn.w_up.dtype == torch.float32 and ffn.kernel is not None
    with pytest.raises(ValueError, match="unknown quantization"):
        float_module("gated", "silu", False, d=64, n_ff=8).quantize_("q5_k")
    ffn = float_module("plain", "relu", True, d=64, n_ff=33)  # n_ff of any size is fine
    ffn.quantize_("q8_0")
    same = ffn.w_up
    ffn.quantize_("q8_0")  # already: nothing changes
    assert ffn.w_up is same
    deq8 = quant.dequantize(ffn.w_up, "q8_0", 64)
    ffn.quantize_("q4_1")  # another format: dequantized and quantized again
    assert ffn.qformat == "q4_1" and ffn.w_up.shape == (33, quant.row_bytes(64, "q4_1"))
    torch.testing.assert_close(quant.dequantize(ffn.row_blocks("w_up"), "q4_1", 64),
                               quant.dequantize(quant.quantize(deq8, "q4_1"), "q4_1", 64))
    x = torch.randn(2, 64)
    torch.testing.assert_close(ffn(x), ffn.forward_native(x)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_quantize_takes_blocks_chosen_elsewhere(fmt):
    """quantize_(blocks=): rows given in GGUF's layout (GPTQ's, a file's) are stored as given
    (gate / up in the dot layout), the others rounded to nearest; a malformed one is refused."""
    ffn = float_module("gated", "silu", False, d=64, n_ff=16)
    up, gate = ffn.w_up.detach().clone(), ffn.w_gate.detach().clone()
    given = quant.quantize(torch.randn(16, 64), fmt)  # any valid blocks, not up's own
    ffn.quantize_(fmt, "q8_0", blocks={"w_up": given})
    assert torch.equal(ffn.row_blocks("w_up"), given)
    assert not torch.equal(given, quant.quantize(up, fmt))
    assert torch.equal(ffn.row_blocks("w_gate"), quant.quantize(gate, fmt))  # to nearest
    x = torch.randn(2, 64)
    torch.testing.assert_close(ffn(x), ffn.forward_native(x)[0], rtol=1e-4, atol=1e-4)
    other = float_module("gated", "silu", False, d=64, n_ff=16)
    with pytest.raises(ValueError, match="blocks given as"):
        other.quantize_(fmt, "q8_0", blocks={"w_gate": given[:8]})


def test_float16_block_quantizes_and_dtype_changes_keep_the_kernel():
    ffn = float_module("gated", "silu", True, d=96, n_ff=40, dtype=torch.float16)
    ffn.quantize_("q4_0")
    assert ffn.b_up.dtype == torch.float32
    x = torch.randn(3, 96)
    want = ffn(x)
    ffn.to(torch.bfloat16)  # uint8 weights stay; biases follow; the kernel is selected again
    assert ffn.w_up.dtype == torch.uint8 and ffn.kernel is not None
    assert ffn.kernel.variant.dtype == "q4_0"
    torch.testing.assert_close(ffn(x).float(), want.float(), rtol=0.02, atol=0.02)
    # pickled and loaded: the format and a kernel come back
    buf = io.BytesIO()
    torch.save(ffn, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert back.qformat == "q4_0" and back.kernel is not None
    torch.testing.assert_close(back(x), ffn(x))


def _bytes(fmt: str, d: int) -> int:
    """Bytes of one row of d weights in fmt."""
    return d * TORCH_DT[fmt].itemsize if fmt in TORCH_DT else quant.row_bytes(d, fmt)


@pytest.mark.parametrize("fmt,down", PAIRS)
def test_byte_accounting_counts_quantized_rows(fmt, down):
    """Every byte count takes gate / up rows in their format and down rows in theirs."""
    from picompile.passes import place, predictors
    from picompile.runtime import hybrid

    ffn = float_module("gated", "relu", True, d=128, n_ff=50)
    f32_row = ffn.row_bytes
    ffn.quantize_(fmt, down)
    rb, rd = quant.row_bytes(128, fmt), _bytes(down, 128)
    assert ffn.row_bytes == rb < f32_row and ffn.down_row_bytes == rd
    assert place.neuron_bytes(ffn) == 2 * rb + rd + 2 * 4  # gate, up, down_t rows; b_gate, b_up
    # gated ReLU: the gate row per candidate; the up and down rows per firing neuron
    assert predictors._row_reads(ffn) == (rb, rb + rd)
    assert predictors.exact_decode_bytes(ffn, 0.5) == round(50 * (rb + 0.5 * (rb + rd)))
    silu = float_module("gated", "silu", False, d=128, n_ff=50).quantize_(fmt, down)
    assert predictors._row_reads(silu) == (2 * rb, rd)  # gate and up per candidate, then down
    plain = float_module("plain", "relu", False, d=128, n_ff=50).quantize_(fmt, down)
    assert predictors._row_reads(plain) == (rb, rd)
    split = hybrid.HybridFFN(ffn, "cpu", 10)  # the hot rows' reads (a CPU stand-in here)
    assert split._bytes_read(7, 3) == 7 * rb + 3 * (rb + rd)


def test_gpu_split_of_a_quantized_block_is_refused():
    from picompile.runtime import hybrid

    ffn = float_module("gated", "relu", False, d=64, n_ff=40).quantize_("q4_0")
    with pytest.raises(ValueError, match="quantized .*q4_0"):
        hybrid.HybridFFN(ffn, "cuda", 10)
    model = torch.nn.Sequential(ffn)
    with pytest.raises(ValueError, match="quantized"):
        hybrid.distribute(model, {"0": ffn}, "cuda")
    assert ffn.hybrid is None and ffn.w_up.device.type == "cpu"
    # the CPU stand-in splits it (both sides quantized C kernels) and computes the same
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    want = ffn(x)
    ffn.hybrid = hybrid.HybridFFN(ffn, "cpu", 15)
    assert ffn.hybrid.cold.qformat == "q4_0" and ffn.hybrid.cold.kernel is not None
    torch.testing.assert_close(ffn(x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="before distribute"):
        ffn.quantize_("q8_0")


def test_kernel_refuses_a_malformed_quantized_block():
    ffn = float_module("plain", "relu", False, d=64, n_ff=10).quantize_("q8_0")
    with pytest.raises(ValueError, match="uint8"):
        SparseFFN(ffn.block, ffn.w_up.float(), ffn.w_down_t, qformat="q8_0")
    with pytest.raises(ValueError, match="uint8"):
        SparseFFN(ffn.block, ffn.w_up[:, :-1], ffn.w_down_t, qformat="q8_0")
    # down rows of another format: their own width must match d
    q4 = quant.quantize(torch.randn(10, 64), "q4_1")
    with pytest.raises(ValueError, match="d=64"):
        SparseFFN(ffn.block, q4, ffn.w_down_t[:, :34], qformat="q4_1", down_qformat="q8_0")
    with pytest.raises(ValueError, match="float down weights"):
        SparseFFN(ffn.block, q4, torch.randn(10, 32), qformat="q4_1")
    with pytest.raises(ValueError, match="needs quantized gate and up"):
        SparseFFN(ffn.block, torch.randn(10, 64), ffn.w_down_t, down_qformat="q8_0")
    ok = SparseFFN(ffn.block, q4, ffn.w_down_t, qformat="q4_1", down_qformat="q8_0")
    assert (ok.qformat, ok.down_qformat, ok.d_model) == ("q4_1", "q8_0", 64)
    assert SparseFFN(ffn.block, q4, torch.randn(10, 64), qformat="q4_1").down_qformat is None
    # uint8 down rows without down_qformat: the gate / up format (one format for all three)
    assert SparseFFN(ffn.block, ffn.w_up, ffn.w_down_t, qformat="q8_0").down_qformat == "q8_0"


# ---------------------------------------------------------------------------------------------
# Down rows in their own format
# ---------------------------------------------------------------------------------------------


def test_variant_names_and_sources_include_the_down_format():
    same = c.Variant("q4_1", True, False, False, "silu")
    assert same == c.Variant("q4_1", True, False, False, "silu", down_dtype="q4_1")
    assert same.down_dtype == "q4_1" and same.name == "gated_silu_q4_1"
    mixed = c.Variant("q4_1", True, False, False, "silu", down_dtype="q8_0")
    assert mixed != same and hash(mixed) != hash(same)
    assert mixed.name == "gated_silu_q4_1_down_q8_0"
    assert c.Variant("q8_0", False, False, True, "relu", down_dtype="float32").name == \
        "plain_relu_q8_0_down_float32_bias"
    src, src_same = c.source(mixed), c.source(same)
    assert "#define PIC_WDTYPE PIC_Q4_1" in src and "#define PIC_DDTYPE PIC_Q8_0" in src
    assert "#define PIC_DDTYPE PIC_Q4_1" in src_same
    assert 'PIC_VARIANT "gated_silu_q4_1_down_q8_0"' in src
    assert c.build(mixed) != c.build(same)  # cached apart
    assert c.load(mixed).pic_variant() == b"gated_silu_q4_1_down_q8_0"
    with pytest.raises(ValueError, match="down weight dtype"):
        c.Variant("q4_1", True, False, False, "silu", down_dtype="q5_k")
    assert {("q4_0", "q8_0"), ("q4_1", "q8_0")} <= {(v.dtype, v.down_dtype) for v in c.all_variants()}


@pytest.mark.parametrize("fmt,down", MIXED)
@pytest.mark.parametrize("kind,act,bias", [("gated", "silu", False), ("plain", "relu", True),
                                           ("drelu", "relu", False)])
def test_quantize_with_a_down_format_then_kernel_matches_reference(fmt, down, kind, act, bias):
    ffn = float_module(kind, act, bias, d=192, n_ff=150, seed=3)
    w_down = ffn.w_down_t.detach().clone()
    assert ffn.quantize_(fmt, down) is ffn
    assert ffn.qformat == fmt and ffn.down_format == down
    assert ffn.down_qformat == (None if down in TORCH_DT else down)
    assert ffn.kernel is not None and ffn.kernel.variant.down_dtype == down
    assert ffn.d_model == 192 and ffn.w_up.shape == (150, quant.row_bytes(192, fmt))
    if down in TORCH_DT:
        assert ffn.w_down_t.dtype == TORCH_DT[down] and ffn.w_down_t.shape == (150, 192)
        torch.testing.assert_close(ffn.w_down_t.float(), w_down, atol=1e-3, rtol=1e-3)
    else:
        assert ffn.w_down_t.dtype == torch.uint8
        assert torch.equal(ffn.w_down_t, quant.quantize(w_down, down))
    assert f"{fmt} (down {down})" in repr(ffn)
    gen = torch.Generator().manual_seed(4)
    _decode_matches_reference(ffn, gen)
    # prefill (> 8 tokens) and the reference path dequantize each matrix in its own format
    x = torch.randn(20, 192, generator=gen)
    want, _ = ffn.forward_native(x)
    torch.testing.assert_close(ffn(x), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    h = down_input(x, ffn.w_up, w_gate=ffn.w_gate, b_gate=ffn.b_gate, b_up=ffn.b_up, act=act,
                   drelu=ffn.drelu, qformat=fmt)
    wd = dequantized_down(ffn.w_down_t, down, 192).float()
    by_hand = torch.where(h.abs() > 0, h, 0) @ wd + (0 if ffn.b_down is None else ffn.b_down)
    torch.testing.assert_close(want, by_hand, rtol=1e-5, atol=1e-5 * float(by_hand.abs().max()))


def test_down_format_changes_requantize_only_the_down_rows():
    ffn = float_module("gated", "relu", True, d=64, n_ff=33)
    ffn.quantize_("q4_1", "q8_0")
    up, down = ffn.w_up, ffn.w_down_t
    assert ffn.quantize_("q4_1", "q8_0").w_down_t is down  # already: nothing changes
    ffn.quantize_("q4_1")  # down_fmt None: the gate / up format
    assert ffn.w_up is up and ffn.down_qformat == "q4_1"
    torch.testing.assert_close(quant.dequantize(ffn.w_down_t, "q4_1", 64),
                               quant.dequantize(quant.quantize(quant.dequantize(down, "q8_0", 64),
                                                               "q4_1"), "q4_1", 64))
    assert ffn.kernel.variant == c.Variant("q4_1", True, False, True, "relu")
    ffn.quantize_("q4_1", "float32")  # float down rows: dequantized
    assert ffn.w_up is up and ffn.down_qformat is None and ffn.w_down_t.dtype == torch.float32
    x = torch.randn(2, 64)
    torch.testing.assert_close(ffn(x), ffn.forward_native(x)[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown quantization"):
        ffn.quantize_("q4_1", "q5_k")


def test_mixed_block_splits_pickles_and_keeps_its_formats():
    from picompile.runtime import hybrid

    ffn = float_module("gated", "silu", False, d=64, n_ff=40).quantize_("q4_0", "q8_0")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    want = ffn(x)
    buf = io.BytesIO()
    torch.save(ffn, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert (back.qformat, back.down_qformat) == ("q4_0", "q8_0") and back.kernel is not None
    torch.testing.assert_close(back(x), want)
    # a block pickled before down rows had their own format: one format for the three
    old = float_module("plain", "relu", False, d=64, n_ff=8).quantize_("q8_0")
    state = old.__getstate__()
    del state["down_qformat"]
    revived = SparseFFN.__new__(SparseFFN)
    revived.__setstate__(state)
    assert revived.down_qformat == "q8_0" and revived.kernel is not None
    # the CPU stand-in of a split: both sides keep both formats
    ffn.hybrid = hybrid.HybridFFN(ffn, "cpu", 15)
    cold = ffn.hybrid.cold
    assert (cold.qformat, cold.down_qformat) == ("q4_0", "q8_0") and cold.kernel is not None
    torch.testing.assert_close(ffn(x), want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# A compiled model with quantized blocks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,down", [(f, f) for f in FORMATS] + [("q4_0", "q8_0")])
@pytest.mark.parametrize("arch", ["llama_silu", "tiny_plain_relu", "tiny_drelu"])
def test_compiled_model_with_quantized_blocks_matches_its_reference(fmt, down, arch):
    import picompile

    sizes = dict(d=64, n_ff=96) if arch.startswith("tiny_") else dict(hidden=64, n_ff=96)
    dense = zoo.make(arch, **sizes)
    cm = picompile.compile(copy.deepcopy(dense), quiet=True)
    ffns = cm.ffns()
    assert ffns
    for ffn in ffns.values():
        ffn.quantize_(fmt, down)
        assert ffn.kernel is not None and ffn.kernel.variant.down_dtype == down
    ids = torch.randint(0, zoo.VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))  # T=6
    with torch.no_grad():
        got = zoo.logits(cm, ids)
        for ffn in ffns.values():
            ffn.kernel = None  # the reference path: dequantize, then PyTorch
        want = zoo.logits(cm, ids)
        for ffn in ffns.values():
            ffn.select_kernel()
        float_logits = zoo.logits(dense, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    # quantization moved the logits a little, not far (a sanity check of the weights, not a
    # fidelity target): q8_0 within 2% of the largest logit, 4-bit within 20%
    tol = 0.02 if fmt == "q8_0" else 0.2
    assert float((got - float_logits).abs().max()) <= tol * float(float_logits.abs().max())




@pytest.mark.parametrize("fmt,down", [(f, f) for f in FORMATS] + [("q4_1", "q8_0")])
@pytest.mark.parametrize("arch,how", [("llama_silu", "exact"), ("llama_relu", "predicted"),
                                      ("qwen2", "threshold")])
def test_decoder_runs_quantized_blocks(fmt, down, arch, how):
    import picompile

    # predicted: the default width, as tests/test_decoder.py (at hidden=64 this random model's
    # predicted prefill and decode differ by ~1% of a logit, float weights too, and the decoder's
    # verification probe refuses it)
    sizes = dict(layers=3) if how == "predicted" else dict(hidden=64, n_ff=80, layers=2)
    model = zoo.make(arch, **sizes)
    cm = picompile.compile(model, **_compile_kw(how))
    before = cm.decoder()
    for ffn in cm.ffns().values():
        ffn.quantize_(fmt, down)
        if how == "predicted":
            assert ffn.predictor is not None and ffn.predictor.enabled
    dec = cm.decoder()
    assert dec is not None, cm.decoder_reason
    assert dec is not before  # rebound to the quantized kernels
    assert all((layer.ffn.kernel.variant.dtype, layer.ffn.kernel.variant.down_dtype) == (fmt, down)
               for layer in dec.layers)
    ids = torch.randint(3, zoo.VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    want, got = _step_logits(cm, dec, ids, prompt=5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "float16", "float32"])
@pytest.mark.parametrize("kind,act", [("gated", "silu"), ("plain", "relu")])
def test_prefill_runs_gate_and_up_on_the_dense_kernel_where_it_pays(fmt, kind, act):
    """Prefill (> 8 tokens) computes the gate and up products with the dense kernel over the
    block's own rows for the formats in PREFILL_KERNEL_FORMATS (4-bit, float16), with BLAS for
    the others; either way h, the mask and the output are the reference's, and a copy of the
    block (deepcopy: kernels are bound to raw pointers) binds its own kernels."""
    from picompile.config import PREFILL_KERNEL_FORMATS

    dtype = torch.float16 if fmt == "float16" else torch.float32
    ffn = float_module(kind, act, True, d=96, n_ff=80, seed=5, dtype=dtype)
    if fmt.startswith("q"):
        ffn.quantize_(fmt, "q8_0")
    kernels = ffn._prefill_kernels
    assert (kernels is not None) == (fmt in PREFILL_KERNEL_FORMATS)
    if kernels is not None:
        assert set(kernels) == ({"gate", "up"} if kind == "gated" else {"up"})
    x = torch.randn(24, 96, generator=torch.Generator().manual_seed(6)).to(dtype)
    with torch.no_grad():
        got = ffn(x)
        want, _ = ffn_reference(x.float(), **{k: (v.float() if torch.is_tensor(v) and v.is_floating_point()
                                                  else v) for k, v in ffn.weights().items()},
                                act=act, threshold=ffn.threshold)
        if kernels is not None:  # the kernel's own products
            h = ffn._prefill_down_input(x)  # [24, 80] float32
            g = kernels["gate"](x) + ffn.b_gate if kind == "gated" else None
            assert torch.equal(h, combine(kernels["up"](x) + ffn.b_up, g, act, False))
        copied = copy.deepcopy(ffn)
        assert (copied._prefill_kernels is None) == (kernels is None)
        if kernels is not None:
            assert copied._prefill_kernels["up"].weight.data_ptr() == copied.w_up.data_ptr() \
                != ffn.w_up.data_ptr()
        torch.testing.assert_close(copied(x), got)
    tol = 2e-2 if fmt == "float16" else 1e-4
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * float(want.abs().max()))
