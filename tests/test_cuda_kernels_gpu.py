"""The generated CUDA kernels against `ffn_reference` and a torch predictor reference, on a GPU.

Run where a CUDA device and cupy exist: `pytest -m gpu tests/test_cuda_kernels_gpu.py`.

References are computed on the CPU in float64 from the very same (16-bit or fp32) weights. The
kernels widen inputs exactly and accumulate in fp32 whatever the dtype, so the error is fp32
rounding over d (gate/up) and m (down) terms: with the unit-scale data below that is ~1e-6 of the
output scale, and the tolerances (TOL, relative to 1 + max |out|) leave a wide margin. 16-bit
dtypes get a little more: their rows have larger relative spread after rounding, nothing else.
Thresholds and tau are placed in gaps of the reference values, so fp32 vs fp64 never flips an
active / fires decision; `n_active` gets a slack of 2 for ReLU pre-activations within rounding of 0.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from picompile.runtime.sparse_ffn import activation, ffn_reference

pytestmark = pytest.mark.gpu


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "cupy is not installed (pip install 'picompile[cuda13]' or 'picompile[cuda12]')"
    return None


_REASON = _skip_reason()
if _REASON is not None:
    pytest.skip(_REASON, allow_module_level=True)

from picompile.codegen import cuda  # noqa: E402
from picompile.codegen.variant import Variant  # noqa: E402

DEV = torch.device("cuda")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOL = {"float32": 5e-5, "float16": 1e-4, "bfloat16": 1e-4}
# (d, n_rows): multiples of 8 and not, n below / above one mask word, several column slices of the
# down projection, and lists long enough for the down split (partials + reduction).
SHAPES = [(64, 40), (72, 100), (100, 77), (203, 333), (576, 1536), (1000, 31), (2050, 700),
          (4096, 2048)]


# ------------------------------------------------------------------------------------------------
# Data and references
# ------------------------------------------------------------------------------------------------


def make_block(d: int, n: int, v: Variant, seed: int = 0) -> dict:
    """CPU weights in ffn_reference's keywords; unit-scale pre-activations, O(1) outputs."""
    return dict(_make_block(d, n, v, seed))


@functools.lru_cache(maxsize=8)
def _make_block(d: int, n: int, v: Variant, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[v.dtype]

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(dt)

    w = dict(w_up=rnd(n, d, scale=d**-0.5), w_down_t=rnd(n, d, scale=n**-0.5))
    if v.gated:
        w["w_gate"] = rnd(n, d, scale=d**-0.5)
    if v.bias:
        w["b_up"] = rnd(n, scale=0.3)
        if v.gated:
            w["b_gate"] = rnd(n, scale=0.3)
    w["b_down"] = rnd(d, scale=0.1)
    return w


def make_x(T: int, d: int, dtype: str, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, d, generator=g).to(DTYPES[dtype])


def h_reference(x, w, v: Variant, idx) -> torch.Tensor:
    """h [T, m] in float64 (the contract, before the |h| > threshold test)."""
    def rows(t):
        return t.index_select(0, idx.long()).double()

    def ent(t):
        return None if t is None else t.index_select(0, idx.long()).double()

    x = x.double()
    if v.gated:
        a = activation(v.act, F.linear(x, rows(w["w_gate"]), ent(w.get("b_gate"))))
        u = F.linear(x, rows(w["w_up"]), ent(w.get("b_up")))
        return a * (F.relu(u) if v.drelu else u)
    return activation(v.act, F.linear(x, rows(w["w_up"]), ent(w.get("b_up"))))


def gap_value(values: torch.Tensor, q: float) -> float:
    """A number near the q-quantile of `values`, in a gap: relative 1e-4 away from all of them."""
    s = torch.sort(values.flatten().double()).values.tolist()
    n = len(s)
    if n < 2:
        return 0.5 if n == 0 else (s[0] * 0.5 if s[0] > 0 else s[0] - 1.0)
    k = min(max(int(q * n), 1), n - 1)
    for off in range(n):
        for c in (k + off, k - off):
            if 1 <= c < n and s[c] - s[c - 1] > 1e-4 * (1.0 + abs(s[c])):
                return 0.5 * (s[c - 1] + s[c])
    return s[-1] + 1.0


def pick_threshold(x, w, v, idx, q=0.5) -> float:
    if not v.threshold:
        return 0.0
    h = h_reference(x, w, v, idx).abs()
    nz = h[h > 0]
    return gap_value(nz, q) if nz.numel() else 0.5


def predictor_reference(x, p1, pb1, p2, pb2) -> torch.Tensor:
    """logits [T, n_hot] float64: z = relu(x p1^T + pb1); logits = z p2^T + pb2."""
    z = torch.relu(x.double() @ p1.double().T + pb1.double())
    return z @ p2.double().T + pb2.double()


def make_predictor(d: int, n: int, r: int, dtype: str, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    p1 = (torch.randn(r, d, generator=g) * d**-0.5).to(dt)
    pb1 = (torch.randn(r, generator=g) * 0.1).to(dt)
    p2 = (torch.randn(n, r, generator=g) * r**-0.5).to(dt)
    pb2 = (torch.randn(n, generator=g) * 0.1).to(dt)
    return p1, pb1, p2, pb2


def to_dev(w: dict) -> dict:
    return {k: (t.to(DEV) if isinstance(t, torch.Tensor) else t) for k, t in w.items()}


def check_close(out, ref, dtype, what=""):
    assert out.dtype == torch.float32 and out.device.type == DEV.type
    out = out.double().cpu()
    err = (out - ref).abs().max().item() if ref.numel() else 0.0
    bound = TOL[dtype] * (1.0 + ref.abs().max().item() if ref.numel() else 1.0)
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def run_given_idx(v, w, x, idx, threshold, *, out=None, accumulate=False, use_bias_down=True,
                  backend=None):
    wd = to_dev(w)
    if not use_bias_down:
        wd.pop("b_down")
    w_up, w_down_t = wd.pop("w_up"), wd.pop("w_down_t")
    return cuda.ffn_given_idx(x.to(DEV), w_up, w_down_t, idx.to(DEV), **wd, act=v.act,
                              drelu=v.drelu, threshold=threshold, out=out, accumulate=accumulate,
                              backend=backend)


def reference_given_idx(v, w, x, idx, threshold, use_bias_down=True):
    w = dict(w)
    if not use_bias_down:
        w.pop("b_down")
    return ffn_reference(x, **w, act=v.act, drelu=v.drelu, threshold=threshold, idx=idx,
                         compute_dtype=torch.float64)


def subset(n: int, density: float, seed: int, shuffle: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = int(round(density * n))
    idx = torch.randperm(n, generator=g)[:m]
    return idx if shuffle else torch.sort(idx).values


def assert_given_idx(v, d, n, T, density, seed=0, block_seed=0, **kw):
    w = make_block(d, n, v, block_seed)
    x = make_x(T, d, v.dtype, seed + 1)
    idx = subset(n, density, seed + 2)
    thr = pick_threshold(x, w, v, idx)
    out, n_active = run_given_idx(v, w, x, idx, thr, **kw)
    torch.cuda.synchronize()
    ref, active = reference_given_idx(v, w, x, idx, thr, kw.get("use_bias_down", True))
    what = f"{v.tag} d={d} n={n} T={T} m={idx.numel()}"
    check_close(out, ref, v.dtype, what)
    assert n_active.device.type == DEV.type and n_active.dtype == torch.int32
    assert abs(int(n_active) - int(active.sum())) <= 2, what


# ------------------------------------------------------------------------------------------------
# Gate/up + down over a given index list
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("v", cuda.all_variants(quantized=False), ids=lambda v: v.tag)
def test_every_variant_given_idx(v):
    k = cuda.all_variants(quantized=False).index(v)
    for T in (1, 3, 8):
        d, n = SHAPES[(k + T) % len(SHAPES)]
        assert_given_idx(v, d, n, T, density=0.3, seed=k)


@pytest.mark.parametrize("v", cuda.all_variants(quantized=False)[::7], ids=lambda v: v.tag)
def test_nvcc_cubins_compute_as_the_reference(v):
    """The nvcc backend: cubins compiled ahead (scripts/gpu_acceptance.sh cubins carries them),
    loaded instead of NVRTC's build."""
    if cuda.nvcc_path() is None:  # the cubins' cache key names nvcc's version
        pytest.skip("needs nvcc on this GPU machine (PICOMPILE_NVCC, PATH or CUDA_HOME)")
    assert cuda.load(v, "nvcc") is not cuda.load(v, "nvrtc")
    for T in (1, 8):
        assert_given_idx(v, 576, 1536, T, density=0.3, seed=T, backend="nvcc")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("d,n", SHAPES)
@pytest.mark.parametrize("act,gated", [("relu", True), ("silu", True), ("gelu", False)])
def test_shapes_tokens_sparsity(dtype, d, n, act, gated):
    v = Variant(dtype, gated=gated, drelu=False, bias=False, act=act, threshold=False)
    for T in range(1, 9):
        for density in (0.0, 0.02, 0.5, 1.0):
            assert_given_idx(v, d, n, T, density, seed=T)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_thresholds_from_dense_to_empty(dtype):
    v = Variant(dtype, gated=True, drelu=False, bias=True, act="silu", threshold=True)
    d, n, T = 203, 333, 4
    w = make_block(d, n, v)
    x = make_x(T, d, dtype)
    idx = torch.arange(n)
    habs = h_reference(x, w, v, idx).abs()
    for q in (0.0, 0.3, 0.9, 1.0):
        thr = gap_value(habs, q) if q < 1.0 else float(habs.max()) * 2 + 1.0
        thr = max(thr, 1e-30)
        out, n_active = run_given_idx(v, w, x, idx, thr)
        ref, active = reference_given_idx(v, w, x, idx, thr)
        check_close(out, ref, dtype, f"q={q}")
        assert abs(int(n_active) - int(active.sum())) <= 2
    assert int(active.sum()) == 0  # the last threshold is above every |h|


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_empty_index_list(dtype):
    v = Variant(dtype, gated=True, drelu=False, bias=False, act="relu")
    d, n, T = 100, 77, 3
    w = make_block(d, n, v)
    x = make_x(T, d, dtype)
    empty = torch.zeros(0, dtype=torch.long)
    out, n_active = run_given_idx(v, w, x, empty, 0.0)
    ref = w["b_down"].double().expand(T, d)
    check_close(out, ref, dtype, "empty list -> b_down")
    assert int(n_active) == 0
    out, _ = run_given_idx(v, w, x, empty, 0.0, use_bias_down=False)
    assert torch.count_nonzero(out) == 0
    prior = torch.randn(T, d, device=DEV)
    out, _ = run_given_idx(v, w, x, empty, 0.0, out=prior.clone(), accumulate=True)
    check_close(out, prior.double().cpu() + ref, dtype, "empty list, accumulate")


@pytest.mark.parametrize("d,n", [(100, 40), (576, 1536)])  # one range / partials + reduction
def test_accumulate_into_out(d, n):
    v = Variant("float16", gated=True, drelu=False, bias=False, act="silu")
    w = make_block(d, n, v)
    x = make_x(5, d, "float16")
    idx = subset(n, 0.6, 3)
    prior = torch.randn(5, d, device=DEV)
    out = prior.clone()
    res, _ = run_given_idx(v, w, x, idx, 0.0, out=out, accumulate=True)
    assert res.data_ptr() == out.data_ptr()
    ref, _ = reference_given_idx(v, w, x, idx, 0.0)
    check_close(res, ref + prior.double().cpu(), "float16", "accumulate")
    res, _ = run_given_idx(v, w, x, idx, 0.0, out=out, accumulate=False)
    check_close(res, ref, "float16", "overwrite")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_unaligned_tensors_take_the_scalar_path(dtype):
    """x and the weights at an odd element offset: no 16-byte loads, same results."""
    v = Variant(dtype, gated=True, drelu=False, bias=True, act="gelu_tanh")
    d, n, T = 64, 100, 2
    w = make_block(d, n, v)
    x = make_x(T, d, dtype)

    def shifted(t):
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=DEV)
        view = buf[1:].view(t.shape)
        view.copy_(t.to(DEV))
        assert view.data_ptr() % 16 != 0
        return view

    wd = {k: shifted(t) for k, t in w.items()}
    xd = shifted(x)
    idx = subset(n, 0.5, 4)
    w_up, w_down_t = wd.pop("w_up"), wd.pop("w_down_t")
    out, _ = cuda.ffn_given_idx(xd, w_up, w_down_t, idx.to(DEV), **wd, act=v.act)
    ref, _ = reference_given_idx(v, w, x, idx, 0.0)
    check_close(out, ref, dtype, "unaligned")


def test_duplicate_and_int64_indices():
    v = Variant("bfloat16", gated=False, drelu=False, bias=True, act="gelu")
    d, n = 72, 100
    w = make_block(d, n, v)
    x = make_x(2, d, "bfloat16")
    idx = torch.tensor([5, 5, 99, 0, 17, 5], dtype=torch.long)
    out, _ = run_given_idx(v, w, x, idx, 0.0)
    ref, _ = reference_given_idx(v, w, x, idx, 0.0)
    check_close(out, ref, "bfloat16", "duplicates")


def test_runs_on_the_current_stream():
    v = Variant("float16", gated=True, drelu=False, bias=False, act="silu")
    d, n = 576, 1536
    w = make_block(d, n, v)
    x = make_x(4, d, "float16")
    idx = subset(n, 0.4, 5)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out, _ = run_given_idx(v, w, x, idx, 0.0)
        out2 = out * 1.0  # ordered after the kernels on s
    s.synchronize()
    ref, _ = reference_given_idx(v, w, x, idx, 0.0)
    check_close(out2, ref, "float16", "side stream")


def test_rejects_bad_inputs():
    v = Variant("float16", gated=True, drelu=False, bias=False, act="silu")
    w = to_dev(make_block(64, 40, v))
    ffn = cuda.CudaFFN(w["w_up"], w["w_down_t"], w_gate=w["w_gate"], act="silu")
    with pytest.raises(ValueError, match="tokens"):
        ffn.ffn_given_idx(torch.zeros(9, 64, device=DEV, dtype=torch.float16), torch.arange(3))
    with pytest.raises(ValueError, match="w_gate"):
        cuda.CudaFFN(w["w_up"], w["w_down_t"], w_gate=w["w_gate"].float())
    with pytest.raises(ValueError, match="predictor"):
        ffn(torch.zeros(1, 64, device=DEV, dtype=torch.float16))


# ------------------------------------------------------------------------------------------------
# Predictor + compaction, and the whole pipeline
# ------------------------------------------------------------------------------------------------


def predicted_sets(ffn, x, p, tau):
    """(kernel's index list, reference firing set, neurons too close to tau to call)."""
    idx, count = ffn.predict(x.to(DEV))
    m = int(count)
    got = idx[:m].cpu()
    logits = predictor_reference(x, *p)  # [T, n]
    best = logits.max(0).values
    ref = set(torch.nonzero(best > tau).flatten().tolist())
    close = set(torch.nonzero((best - tau).abs() <= 1e-4 * (1.0 + abs(tau))).flatten().tolist())
    return got, ref, close


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("d,n,r", [(64, 40, 16), (100, 77, 20), (576, 1536, 64), (203, 333, 100),
                                   (1000, 31, 8), (2050, 700, 256), (4096, 2048, 1024)])
def test_predictor_and_compaction(dtype, d, n, r):
    v = Variant(dtype, gated=True, drelu=False, bias=False, act="relu")
    w = to_dev(make_block(d, n, v))
    p = make_predictor(d, n, r, dtype)
    for T in (1, 2, 5, 8):
        x = make_x(T, d, dtype, seed=T)
        logits = predictor_reference(x, *p)
        best = logits.max(0).values
        for q in (1.0, 0.9, 0.5, 0.0):  # sparsity: none fire .. all fire
            if q >= 1.0:
                tau = float(best.max()) + 1.0
            elif q <= 0.0:
                tau = float(best.min()) - 1.0
            else:
                tau = gap_value(best, q)
            ffn = cuda.CudaFFN(w["w_up"], w["w_down_t"], w_gate=w["w_gate"], act="relu",
                               p1=p[0].to(DEV), pb1=p[1].to(DEV), p2=p[2].to(DEV),
                               pb2=p[3].to(DEV), tau=tau)
            got, ref, close = predicted_sets(ffn, x, p, tau)
            what = f"{dtype} d={d} n={n} r={r} T={T} q={q}"
            assert torch.equal(got, torch.sort(got).values), f"{what}: not ascending"
            assert len(set(got.tolist())) == got.numel(), f"{what}: duplicates"
            assert set(got.tolist()) ^ ref <= close, what
            if q >= 1.0:
                assert got.numel() == 0
            if q <= 0.0:
                assert got.numel() == n


@pytest.mark.parametrize("v", [
    Variant("float16", gated=True, drelu=False, bias=False, act="relu"),
    Variant("bfloat16", gated=True, drelu=True, bias=True, act="relu", threshold=True),
    Variant("float32", gated=False, drelu=False, bias=True, act="gelu", threshold=True),
    Variant("float16", gated=True, drelu=False, bias=False, act="silu", threshold=True),
], ids=lambda v: v.tag)
def test_hot_ffn_end_to_end(v):
    for (d, n, r) in [(576, 1536, 64), (203, 333, 32), (4096, 2048, 256)]:
        w = make_block(d, n, v)
        p = make_predictor(d, n, r, v.dtype)
        for T in (1, 4, 8):
            x = make_x(T, d, v.dtype, seed=T)
            best = predictor_reference(x, *p).max(0).values
            for q in (1.0, 0.8, 0.3, 0.0):
                tau = (float(best.max()) + 1.0 if q >= 1.0 else
                       float(best.min()) - 1.0 if q <= 0.0 else gap_value(best, q))
                ref_idx = torch.nonzero(best > tau).flatten()
                thr = pick_threshold(x, w, v, ref_idx) if ref_idx.numel() else (
                    0.5 if v.threshold else 0.0)
                wd = to_dev(w)
                w_up, w_down_t = wd.pop("w_up"), wd.pop("w_down_t")
                out, n_active = cuda.hot_ffn(
                    x.to(DEV), w_up, w_down_t, **wd,
                    p1=p[0].to(DEV), pb1=p[1].to(DEV), p2=p[2].to(DEV), pb2=p[3].to(DEV),
                    tau=tau, act=v.act, drelu=v.drelu, threshold=thr)
                what = f"{v.tag} d={d} n={n} r={r} T={T} q={q}"
                # With tau in a gap the kernel's list is the reference's (checked in the
                # predictor test); compare the block on the reference's list.
                ref, active = reference_given_idx(v, w, x, ref_idx, thr)
                check_close(out, ref, v.dtype, what)
                assert abs(int(n_active) - int(active.sum())) <= 2, what


def test_cuda_ffn_reuses_buffers_safely_across_calls():
    """Two calls in flight on one stream, different inputs: each result is its own."""
    v = Variant("float16", gated=True, drelu=False, bias=False, act="silu")
    d, n, r = 576, 1536, 64
    w = make_block(d, n, v)
    p = make_predictor(d, n, r, "float16")
    wd = to_dev(w)
    w_up, w_down_t = wd.pop("w_up"), wd.pop("w_down_t")
    ffn = cuda.CudaFFN(w_up, w_down_t, **wd, act="silu",
                       p1=p[0].to(DEV), pb1=p[1].to(DEV), p2=p[2].to(DEV), pb2=p[3].to(DEV),
                       tau=0.0)
    xs = [make_x(T, d, "float16", seed=10 + T) for T in (1, 8, 3)]
    outs = [ffn(x.to(DEV))[0] for x in xs]
    torch.cuda.synchronize()
    for x, out in zip(xs, outs):
        best = predictor_reference(x, *p).max(0).values
        ref_idx = torch.nonzero(best > 0.0).flatten()
        if ((best - 0.0).abs() < 1e-4).any():
            continue  # tau=0 landed on a logit: skip rather than flake
        ref, _ = reference_given_idx(v, w, x, ref_idx, 0.0)
        check_close(out, ref, "float16", f"T={x.shape[0]}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("d,n,T", [(64, 40, 1), (576, 1536, 1), (203, 333, 3), (100, 77, 8)])
def test_given_mask_compacts_on_the_device(dtype, d, n, T):
    """The hybrid path: a predictor's bool mask [T, n] on the device -> the rows set for any
    token (pi_compact_mask, no host sync) -> the block over them. The mask is a
    column slice of a wider one, as the hot part's is (rows strided)."""
    v = Variant(dtype=dtype, gated=True, drelu=False, bias=False, act="relu",
                         threshold=False)
    w = make_block(d, n, v)
    x = make_x(T, d, dtype)
    g = torch.Generator().manual_seed(d + n + T)
    wide = torch.rand(T, n + 37, generator=g) < 0.2
    mask = wide[:, :n]
    wd = to_dev(w)
    ffn = cuda.CudaFFN(wd.pop("w_up"), wd.pop("w_down_t"), **wd, act="relu")
    out, n_active = ffn.ffn_given_mask(x.to(DEV), wide.to(DEV)[:, :n])
    idx = mask.any(0).nonzero().flatten()
    ref, active = reference_given_idx(v, w, x, idx, 0.0)
    check_close(out, ref, dtype, f"mask d={d} n={n} T={T}")
    assert abs(int(n_active) - int(active.sum())) <= 2


def test_split_down_sums_every_call_in_range_order():
    """The down kernel's row ranges: the last block of each column slice adds the partial sums.
    Its arrival counts are zeroed by each call's compaction, so call after call writes out (a
    count left over would leave out unwritten), and the sum's order is fixed: the same mask
    gives the same bits whichever block finishes last."""
    v = Variant("float16", gated=True, drelu=False, bias=True, act="silu", threshold=False)
    d, n, T = 1000, 4096, 2
    w = make_block(d, n, v)
    wd = to_dev(w)
    ffn = cuda.CudaFFN(wd.pop("w_up"), wd.pop("w_down_t"), **wd, act="silu")
    assert ffn.kernels.n_split(n, d, DEV.index or 0) > 1  # several ranges per column slice
    g = torch.Generator().manual_seed(5)
    x = make_x(T, d, "float16")
    firsts = []
    for density in (0.05, 0.5, 0.05, 1.0):
        mask = torch.rand(T, n, generator=g) < density
        out, n_active = ffn.ffn_given_mask(x.to(DEV), mask.to(DEV))
        again, _ = ffn.ffn_given_mask(x.to(DEV), mask.to(DEV))
        assert torch.equal(out, again), f"density {density}: two calls differ"
        ref, active = reference_given_idx(v, w, x, mask.any(0).nonzero().flatten(), 0.0)
        check_close(out, ref, "float16", f"density {density}")
        assert abs(int(n_active) - int(active.sum())) <= 2
        firsts.append(out)
    assert not torch.equal(firsts[0], firsts[1])
    # one token, captured in a CUDA graph and replayed over new masks: each as called directly
    x1 = x[:1].to(DEV)
    static = torch.zeros(1, n, dtype=torch.bool, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ffn.ffn_given_mask(x1, static)  # warm up where the graph is captured
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        replayed, _ = ffn.ffn_given_mask(x1, static)
    for density in (0.05, 0.6, 0.05):
        mask = (torch.rand(1, n, generator=g) < density).to(DEV)
        static.copy_(mask)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, ffn.ffn_given_mask(x1, mask)[0]), f"replay at {density}"


@pytest.mark.parametrize("missing", ["b_gate", "b_up"])
def test_a_gated_block_with_one_bias_runs_with_zeros_for_the_other(missing):
    """The bias variants read both biases of a gated block; a block that has only one gets
    zeros for the other, as the reference reads None."""
    g = torch.Generator().manual_seed(3)
    d, n = 256, 300
    w = dict(w_gate=torch.randn(n, d, generator=g) * d**-0.5,
             w_up=torch.randn(n, d, generator=g) * d**-0.5,
             w_down_t=torch.randn(n, d, generator=g) * n**-0.5,
             b_gate=torch.randn(n, generator=g) * 0.3, b_up=torch.randn(n, generator=g) * 0.3)
    w[missing] = None
    x = torch.randn(2, d, generator=g)
    idx = torch.arange(0, n, 2)
    ref, _ = ffn_reference(x, **w, act="relu", idx=idx, compute_dtype=torch.float64)
    dev = {k: None if t is None else t.to(DEV) for k, t in w.items()}
    out, _ = cuda.ffn_given_idx(x.to(DEV), dev.pop("w_up"), dev.pop("w_down_t"), idx.to(DEV),
                                act="relu", **dev)
    torch.cuda.synchronize()
    assert (out.double().cpu() - ref).abs().max().item() <= 1e-4 * (1 + ref.abs().max().item())
