"""The dense linear C kernel (picompile/kernels/dense.c via picompile/codegen/dense.py) against
F.linear, DenseLinear, and the lower_linears pass on tiny HF models.

Kernel results are compared with F.linear in float64 over the weights as stored: float16 and
bfloat16 weights convert to float32 exactly, so the only error is the kernel's float32
accumulation, bounded relative to sum_k |x_k w_k| (+ |b|). Module-level tests compare with the
layer's own F.linear in the model's dtype, where that dtype's rounding sets the tolerance.
"""

from __future__ import annotations

import ctypes

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from picompile.codegen import c, dense
from picompile.passes.lower import lower_linears
from picompile.runtime.dense_linear import DenseLinear
from picompile.runtime.sparse_ffn import SparseFFN
from tests import zoo

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SIZES = (1, 7, 64, 576, 577, 1536)
# |kernel - exact| <= ACC_TOL * sum_k |x_k w_k| (+ |b|): float32 accumulation (any weight dtype)
ACC_TOL = 1e-5
# Model outputs in the model's dtype, kernel (float32 accumulation, rounded once) against torch's
# F.linear in that dtype, through a 2-layer model: relative to the logits' scale.
MODEL_TOL = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 1e-1}


@pytest.fixture(scope="module", autouse=True)
def _kernels_built():
    for name in DTYPES:
        if dense.try_load(name) is None:
            why = dense.why_no_kernel(torch.zeros(1, 1, dtype=DTYPES[name]))
            pytest.skip(f"no dense C kernel: {why}")


def make_x(gen: torch.Generator, T: int, K: int, layout: str) -> torch.Tensor:
    """x [T, K] float32, contiguous or not."""
    if layout == "transposed":
        return torch.randn(K, T, generator=gen).t()
    if layout == "strided":
        return torch.randn(T, 2 * K + 1, generator=gen)[:, 1::2]
    return torch.randn(T, K, generator=gen)


def check(W: torch.Tensor, b: torch.Tensor | None, x: torch.Tensor, **build) -> None:
    kernel = dense.dense_kernel_for(W, b, **build)
    assert kernel is not None
    out = kernel(x)
    assert out.dtype == torch.float32 and out.shape == (x.shape[0], W.shape[0])
    xd, Wd = x.double(), W.double()
    bd = None if b is None else b.double()
    ref = F.linear(xd, Wd, bd)
    bound = F.linear(xd.abs(), Wd.abs(), None if bd is None else bd.abs())
    err = (out.double() - ref).abs()
    worst = (err - ACC_TOL * bound).max().item()
    assert worst <= 1e-30, (f"W {W.dtype} {tuple(W.shape)} T={x.shape[0]} bias={b is not None}: "
                            f"max error {err.max().item():.3g}")


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_kernel_shapes(dtype, bias):
    """Every (K, O) in SIZES x SIZES, T cycling 1..8, x contiguous or not; all T for one shape."""
    gen = torch.Generator().manual_seed(2 * list(DTYPES).index(dtype) + bias)
    dt = DTYPES[dtype]
    cases = [(K, O, 1 + i % 8) for i, (K, O) in enumerate((K, O) for K in SIZES for O in SIZES)]
    cases += [(577, 64, T) for T in range(1, 9)]
    for i, (K, O, T) in enumerate(cases):
        W = torch.randn(O, K, generator=gen).to(dt)
        b = torch.randn(O, generator=gen).to(dt) if bias else None
        check(W, b, make_x(gen, T, K, ("contiguous", "transposed", "strided")[i % 3]))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_kernel_lm_head(dtype):
    """SmolLM2's LM head: 49152 x 576, one token and eight."""
    gen = torch.Generator().manual_seed(7)
    W = torch.randn(49152, 576, generator=gen).to(DTYPES[dtype])
    for T in (1, 8):
        check(W, None, make_x(gen, T, 576, "strided"))


BUILDS = {  # ISA (as pi_dense_variant names it) -> dense_kernel_for's build options
    "scalar": dict(tuning={"SCALAR": 1}),
    "avx2": dict(avx512=False),
    "avx2-prefetch": dict(avx512=False, tuning={"PF_BYTES": 4096}),  # as default_tuning on Intel
    "avx2-no-prefetch": dict(avx512=False, tuning={"PF_BYTES": 0}),  # and elsewhere
    "avx512": dict(avx512=True),
    "avx512-dynamic": dict(avx512=True, tuning={"DYNAMIC": 1}),
}


@pytest.mark.parametrize("build", list(BUILDS))
def test_kernel_builds(build):
    """Every code path the library can be built with: vector bodies, tails, the scalar fallback;
    float16 subnormals and values near the float16 range convert exactly."""
    if build.startswith("avx512") and not c.avx512_available():
        pytest.skip("no AVX-512F on this CPU")
    if build.startswith("avx2") and "-mavx2" not in c.build_flags():
        pytest.skip("no AVX2 / FMA / F16C on this CPU")
    gen = torch.Generator().manual_seed(5)
    for dtype, dt in DTYPES.items():
        kernel = dense.dense_kernel_for(torch.zeros(1, 1, dtype=dt), **BUILDS[build])
        assert kernel.variant == f"{dtype} {build.split('-')[0]}"
        for i, (K, O, T) in enumerate([(1, 3, 1), (7, 5, 2), (15, 17, 3), (16, 16, 4), (33, 40, 5),
                                       (64, 64, 8), (577, 130, 6), (1536, 200, 7), (200, 1, 1)]):
            W = torch.randn(O, K, generator=gen)
            if dtype == "float16":  # subnormals and large values
                W[:, ::5] *= 1e-5
                W[:, 1::7] *= 1e4
            W = W.to(dt)
            b = torch.randn(O, generator=gen).to(dt) if i % 2 else None
            check(W, b, make_x(gen, T, K, ("contiguous", "strided")[i % 2]), **BUILDS[build])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(K=st.integers(1, 700), O=st.integers(1, 300), T=st.integers(1, 8),
       dtype=st.sampled_from(list(DTYPES)), bias=st.booleans(),
       layout=st.sampled_from(["contiguous", "transposed", "strided"]),
       xdtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       seed=st.integers(0, 2**31 - 1))
def test_kernel_property(K, O, T, dtype, bias, layout, xdtype, seed):
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(O, K, generator=gen).to(DTYPES[dtype])
    b = torch.randn(O, generator=gen).to(DTYPES[dtype]) if bias else None
    x = make_x(gen, T, K, layout).to(xdtype)  # the kernel reads x as float32 (exact here)
    check(W, b, x)


def test_kernel_many_tokens_and_none():
    """T > 8 runs in groups of 8; T = 0 gives an empty result."""
    gen = torch.Generator().manual_seed(3)
    W, b = torch.randn(100, 65, generator=gen), torch.randn(100, generator=gen)
    check(W, b, torch.randn(19, 65, generator=gen))
    assert dense.dense_kernel_for(W, b)(torch.zeros(0, 65)).shape == (0, 100)
    with pytest.raises(ValueError):
        dense.dense_kernel_for(W, b)(torch.zeros(2, 64))


def assert_thread_count_independent(kernel, x: torch.Tensor) -> None:
    """kernel(x) on 1 and on 2 threads: bit for bit the same."""
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x)
        torch.set_num_threads(2)
        two = kernel(x)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two)


def test_kernel_thread_count_independent():
    gen = torch.Generator().manual_seed(4)
    W = torch.randn(4096, 576, generator=gen).half()
    x = torch.randn(3, 576, generator=gen)
    assert_thread_count_independent(dense.dense_kernel_for(W), x)


@pytest.mark.parametrize("variant", list(dense.VARIANTS))
def test_multi_is_one_call_per_matrix(variant):
    """pi_dense_multi (the decoder's q, k and v in one call) over 3 matrices of one format and
    input width, with and without biases, equals pi_dense on each, bit for bit."""
    from picompile import quant

    gen = torch.Generator().manual_seed(5)
    K, T = 96, 2
    Os = (200, 24, 5)  # many chunks, one chunk, a tail
    if variant in dense.QFORMATS:
        Ws = [quant.quantize(torch.randn(O, K, generator=gen), variant) for O in Os]
    else:
        Ws = [torch.randn(O, K, generator=gen).to(dense.DTYPES[variant]) for O in Os]
    bs = [None, torch.randn(24, generator=gen), torch.randn(5, generator=gen)]
    if variant not in dense.QFORMATS:
        bs = [None if b is None else b.to(dense.DTYPES[variant]) for b in bs]
    x = torch.randn(T, K, generator=gen)
    lib = dense.load(variant)
    lib.pi_set_num_threads(2)
    lib._pi_threads = None
    ptrs = lambda ts: (ctypes.c_void_p * 3)(*[None if t is None else t.data_ptr() for t in ts])  # noqa: E731
    outs = [torch.full((T, O), float("nan")) for O in Os]
    lib.pi_dense_multi(x.data_ptr(), T, K, 3, ptrs(Ws), (ctypes.c_int64 * 3)(*Os), ptrs(bs),
                       ptrs(outs))
    for W, b, O, got in zip(Ws, bs, Os, outs):
        want = torch.empty(T, O)
        lib.pi_dense(x.data_ptr(), T, K, W.data_ptr(), O, None if b is None else b.data_ptr(),
                     want.data_ptr())
        assert torch.equal(got, want), (variant, O)


def test_no_kernel(monkeypatch):
    assert dense.dense_kernel_for(torch.zeros(4, 4, dtype=torch.float64)) is None
    assert "float64" in dense.why_no_kernel(torch.zeros(4, 4, dtype=torch.float64))
    assert dense.dense_kernel_for(torch.zeros(4, 4, device="meta")) is None
    assert "not on the CPU" in dense.why_no_kernel(torch.zeros(4, 4, device="meta"))
    assert dense.dense_kernel_for(torch.zeros(2, 4, 4)) is None
    assert dense.dense_kernel_for(torch.zeros(4, 4), torch.zeros(3)) is None
    monkeypatch.setenv("PICOMPILE_REFERENCE", "1")
    assert dense.dense_kernel_for(torch.zeros(4, 4)) is None
    lin = DenseLinear.from_linear(nn.Linear(4, 3))
    assert lin.kernel is None and lin.path == "reference (PICOMPILE_REFERENCE set)"


# ---------------------------------------------------------------------------------------------
# DenseLinear
# ---------------------------------------------------------------------------------------------


def test_dense_linear_module():
    torch.manual_seed(0)
    lin = nn.Linear(40, 24)
    mod = DenseLinear.from_linear(lin)
    assert mod.weight is lin.weight and mod.bias is lin.bias
    assert mod.path.startswith("C float32") and "path=C float32" in repr(mod)
    for shape in [(1, 40), (2, 3, 40), (8, 40), (9, 40), (2, 5, 40), (0, 40)]:
        x = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(mod(x), lin(x), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        x = torch.randn(12, 40)  # prefill: F.linear itself
        assert torch.equal(mod(x), mod.forward_native(x))
    # autograd through the kernel path gives F.linear's gradients
    x = torch.randn(3, 40, requires_grad=True)
    mod(x).square().sum().backward()
    g = (x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone())
    x.grad = lin.weight.grad = lin.bias.grad = None
    lin(x).square().sum().backward()
    for a, e in zip(g, (x.grad, lin.weight.grad, lin.bias.grad)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_dense_linear_rebinds():
    torch.manual_seed(1)
    lin = nn.Linear(16, 8, bias=False)
    mod = DenseLinear.from_linear(lin)
    x = torch.randn(2, 16)
    with torch.no_grad():
        lin.weight.mul_(2)  # in place: the kernel reads the same storage
        torch.testing.assert_close(mod(x), lin(x))
        lin.weight.data = torch.randn(8, 16)  # storage swapped: bound again
        torch.testing.assert_close(mod(x), lin(x))
    mod.half()
    assert mod.path.startswith("C float16") and mod.weight.dtype == torch.float16
    with torch.no_grad():
        out = mod(x.half())
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, F.linear(x.half(), mod.weight), rtol=2e-3, atol=2e-3)
    mod.to(torch.float64)
    assert mod.kernel is None and "float64" in mod.path
    with torch.no_grad():
        torch.testing.assert_close(mod(x.double()), F.linear(x.double(), mod.weight))


# ---------------------------------------------------------------------------------------------
# lower_linears on models
# ---------------------------------------------------------------------------------------------


def ids_for(n: int) -> torch.Tensor:
    return torch.randint(0, zoo.VOCAB, (1, n), generator=torch.Generator().manual_seed(n))


@pytest.mark.parametrize("arch", ["llama_relu", "opt", "gemma"])
def test_lower_hf_models(arch):
    model = zoo.make(arch)
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    n_params = sum(p.numel() for p in model.parameters())
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == (arch in ("opt", "gemma"))

    paths = lower_linears(model)

    linears = [n for n, m in ref.named_modules() if type(m) is nn.Linear]
    assert sorted(paths) == sorted(linears) and "lm_head" in paths
    assert all(p.startswith("C float32") for p in paths.values()), paths
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert list(model.state_dict()) == keys
    assert sum(p.numel() for p in model.parameters()) == n_params
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    with torch.no_grad():
        for n in (1, 5, 8, 12):  # decode sizes through the kernel, 12: prefill through F.linear
            torch.testing.assert_close(zoo.logits(model, ids_for(n)), zoo.logits(ref, ids_for(n)),
                                       rtol=1e-5, atol=1e-5)
        gen = dict(max_new_tokens=6, do_sample=False)
        assert torch.equal(model.generate(ids_for(4), **gen), ref.generate(ids_for(4), **gen))

    # .half() after lowering: rebound to the float16 kernel, tie kept, still F.linear's answer
    model.half()
    ref.half()
    lowered = [m for m in model.modules() if isinstance(m, DenseLinear)]
    assert lowered and all(m.path.startswith("C float16") for m in lowered)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    with torch.no_grad():
        a, e = zoo.logits(model, ids_for(5)), zoo.logits(ref, ids_for(5))
    assert a.dtype == torch.float16
    assert (a.float() - e.float()).abs().max() <= MODEL_TOL[torch.float16] * e.float().abs().max()

    # pickled whole (torch.save of the module): the kernels are selected again on loading
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.lm_head.kernel is not None and loaded.lm_head.path.startswith("C float16")
    assert (loaded.lm_head.weight is loaded.get_input_embeddings().weight) == tied
    with torch.no_grad():
        assert torch.equal(zoo.logits(loaded, ids_for(5)), a)


def test_lower_compiled_model_skips_sparse_ffn():
    import picompile

    model = zoo.make("llama_relu")
    ref = copy.deepcopy(model)
    cm = picompile.compile(model, quiet=True)  # compile lowers the other linears itself
    paths = cm.linear_paths
    assert paths and not any(".mlp." in n for n in paths)  # the FFNs are SparseFFNs now
    assert all(p.startswith(("C ", "reference")) for p in paths.values())
    assert lower_linears(cm) == {}  # nothing left to lower
    assert any(isinstance(m, SparseFFN) for m in cm.modules())
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(cm, ids_for(5)), zoo.logits(ref, ids_for(5)),
                                   rtol=1e-5, atol=1e-5)


class _OwnForward(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class _Shared(nn.Module):
    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.a, self.b = lin, lin

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_lower_graph_module_subclass_and_shared():
    torch.manual_seed(2)
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)))
    hooked = nn.Linear(8, 8)
    hooked.register_forward_hook(lambda m, i, o: o)
    shared = nn.Sequential(_Shared(nn.Linear(8, 8)), _OwnForward(8, 8), hooked)  # untraced
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = gm(x), shared(x)
    assert sorted(lower_linears(gm)) == ["0", "2"]  # a GraphModule calling its Linears by name
    assert isinstance(gm.get_submodule("0"), DenseLinear)
    paths = lower_linears(shared)
    assert sorted(p for p, v in paths.items() if v.startswith("C ")) == ["0.a", "0.b"]
    assert "_OwnForward" in paths["1"] and "hooks" in paths["2"] and shared[2] is hooked
    assert shared[0].a is shared[0].b and isinstance(shared[0].a, DenseLinear)
    assert isinstance(shared[1], _OwnForward)
    with torch.no_grad():
        torch.testing.assert_close((gm(x), shared(x)), expected, rtol=1e-5, atol=1e-5)
    assert lower_linears(nn.Linear(4, 4)) == {}  # the model itself is never replaced
    with torch.no_grad():  # K = 0: the bias alone, as F.linear gives it
        w0, b0 = torch.zeros(3, 0), torch.randn(3)
        x0 = torch.zeros(2, 0)
        assert torch.equal(dense.dense_kernel_for(w0, b0)(x0), F.linear(x0, w0, b0))


def test_build_failure_falls_back(monkeypatch, tmp_path):
    """A compiler that fails: no kernel, F.linear runs, the cause is named, one warning."""
    cc = tmp_path / "badcc"
    cc.write_text("#!/bin/sh\necho 'fatal error: no such thing' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("PICOMPILE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(c, "_warned", False)  # the one picompile C-kernel warning
    lin = nn.Linear(8, 4)
    with pytest.warns(RuntimeWarning, match="no dense C kernel"):
        mod = DenseLinear.from_linear(lin)
    assert mod.kernel is None and "C build failed" in mod.path and "fatal error" in mod.path
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(mod(x), lin(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per process
        assert DenseLinear.from_linear(nn.Linear(8, 4)).kernel is None


def test_float16_prefill_runs_the_kernel():
    """float16 weights (config.PREFILL_KERNEL_FORMATS): more than 8 tokens run the kernel too
    (torch's CPU float16 GEMM is slow), in groups of 8, within float32 rounding of F.linear over
    the same weights widened; float32 and bfloat16 keep F.linear."""
    torch.manual_seed(2)
    lin = nn.Linear(64, 40).half()
    mod = DenseLinear.from_linear(lin)
    x = torch.randn(3, 11, 64).half()
    with torch.no_grad():
        got = mod(x)
        assert got.dtype == torch.float16 and got.shape == (3, 11, 40)
        assert torch.equal(got.reshape(-1, 40)[:8], mod.kernel(x.reshape(-1, 64)[:8]).half())
        want = F.linear(x.float(), lin.weight.float(), lin.bias.float())
        torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)
    for dt in (torch.float32, torch.bfloat16):
        mod = DenseLinear.from_linear(nn.Linear(64, 40).to(dt))
        x = torch.randn(12, 64).to(dt)
        with torch.no_grad():
            assert torch.equal(mod(x), F.linear(x, mod.weight, mod.bias))


@pytest.mark.parametrize("vendor,expected", [("GenuineIntel", ["-DPI_PF_BYTES=4096"]),
                                             ("AuthenticAMD", [])])
def test_default_tuning_per_vendor_and_overridden(monkeypatch, vendor, expected):
    """Software prefetches in the weight stream on Intel CPUs (their hardware prefetchers stop
    at 4 KiB pages), none elsewhere; a caller's tuning takes precedence."""
    monkeypatch.setattr(c, "cpu_vendor", lambda: vendor)
    assert [f for f in dense.flags("q4_1") if f.startswith("-DPI_PF")] == expected
    assert "-DPI_PF_BYTES=0" in dense.flags("float32", tuning={"PF_BYTES": 0})
    assert "-DPI_PF_BYTES=512" in dense.flags("float32", tuning={"PF_BYTES": 512})
