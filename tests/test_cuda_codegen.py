"""CUDA code generation, checked without a GPU: every variant's source is well formed and builds
with nvcc for sm_80 and sm_90 (one nvcc call per arch for all variants, both archs at once).

The kernels themselves are run against ffn_reference in test_cuda_kernels_gpu.py (marked gpu)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import shutil
import sys

import pytest

from picompile.codegen import cuda
from picompile.plan import BlockPlan, Decisions

VARIANTS = cuda.all_variants()
NVCC = cuda.nvcc_path()
needs_nvcc = pytest.mark.skipif(
    NVCC is None and shutil.which("nvcc") is None, reason="nvcc not found (PATH, CUDA_HOME)"
)


# ------------------------------------------------------------------------------------------------
# Sources (no compiler needed)
# ------------------------------------------------------------------------------------------------


def test_all_variants_enumerates_the_space():
    assert len(VARIANTS) == len(set(VARIANTS)) == 108  # 3 dtypes x (4 plain + 4 gated + 1 dReLU) x 4
    assert len({v.tag for v in VARIANTS}) == len(VARIANTS)
    for v in VARIANTS:
        assert re.fullmatch(r"[a-z0-9_]+", v.tag)
        assert not v.drelu or (v.gated and v.act == "relu")
    assert {v.dtype for v in VARIANTS} == set(cuda.DTYPES)
    assert {v.act for v in VARIANTS} == set(cuda.ACTS)


def test_variant_validation():
    with pytest.raises(ValueError, match="dtype"):
        cuda.CudaVariant(dtype="float64")
    with pytest.raises(ValueError, match="act"):
        cuda.CudaVariant(act="tanh")
    with pytest.raises(ValueError, match="gated"):
        cuda.CudaVariant(gated=False, drelu=True)


def test_variant_for_block():
    block = BlockPlan(name="m.mlp", module="m", kind="drelu", act="relu", d_model=8, d_ff=16,
                      bias=True, dtype="bfloat16", decided=Decisions(threshold=0.25))
    v = cuda.CudaVariant.for_block(block)
    assert v == cuda.CudaVariant("bfloat16", gated=True, drelu=True, bias=True, act="relu",
                                 threshold=True)
    block = dataclasses.replace(block, kind="plain", act="gelu", bias=False, decided=Decisions(),
                                dtype="float32")
    assert cuda.CudaVariant.for_block(block) == cuda.CudaVariant(
        "float32", gated=False, drelu=False, bias=False, act="gelu", threshold=False)


def _kernel_defs(src: str) -> dict[str, str]:
    """extern "C" kernel name -> its parameter list text."""
    pat = re.compile(r'extern "C" __global__ void(?: __launch_bounds__\([^)]*\))? (\w+)\('
                     r'(.*?\)[ \t]*(?://[^\n]*)?)\n\{', re.S)
    return {m.group(1): m.group(2) for m in pat.finditer(src)}


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.tag)
def test_source_has_the_kernels_with_shape_comments(v):
    src = cuda.source(v)
    defs = _kernel_defs(src)
    assert set(v.kernel_names().values()) == set(defs)
    for name, params in defs.items():
        lines = [ln for ln in params.strip().splitlines() if ln.strip()]
        assert lines, name
        for ln in lines:  # one parameter per line, each with a comment (shape or meaning)
            assert "//" in ln, f"{name}: parameter without a comment: {ln.strip()}"
        if name.startswith(("pi_gate_up", "pi_down_1", "pi_down_b", "pi_pred")):
            assert re.search(r"\[\w+, \w+\]", params), f"{name}: no [rows, cols] shape comment"
    # No headers beyond the two allowed ones (none, in fact), and no fast math.
    includes = re.findall(r"#include\s*[<\"]([^>\"]+)", src)
    assert set(includes) <= {"cuda_fp16.h", "cuda_bf16.h"}
    assert "use_fast_math" not in " ".join(cuda.NVCC_FLAGS)
    # The variant is baked in as constants.
    b = "true" if v.gated else "false"
    assert f"static const bool gated = {b};" in src
    assert f"PiVariant_{v.tag}" in src


def test_sources_differ_where_variants_differ():
    sources = {v: cuda.source(v) for v in VARIANTS}
    assert len(set(sources.values())) == len(VARIANTS)
    for v in VARIANTS:
        for field, value in (("dtype", None), ("gated", not v.gated), ("bias", not v.bias),
                             ("act", None), ("threshold", not v.threshold)):
            choices = ([value] if value is not None
                       else [x for x in (cuda.DTYPES if field == "dtype" else cuda.ACTS)
                             if x != getattr(v, field)])
            for c in choices:
                try:
                    w = dataclasses.replace(v, **{field: c})
                except ValueError:  # e.g. plain dReLU
                    continue
                assert cuda.source(w) != sources[v], (v, field, c)
    # What changes is what the field means.
    base = cuda.CudaVariant("float16", gated=True, drelu=False, bias=False, act="silu")
    src = sources[base]
    assert "expf(-v)" in src and "PiF16" in src
    assert "erff(" in cuda.source(dataclasses.replace(base, act="gelu"))
    assert "tanhf(" in cuda.source(dataclasses.replace(base, act="gelu_tanh"))
    assert "PiBF16" in cuda.source(dataclasses.replace(base, dtype="bfloat16"))
    assert "static const bool threshold = true;" in cuda.source(dataclasses.replace(base, threshold=True))
    assert "static const bool drelu = true;" in cuda.source(
        dataclasses.replace(base, drelu=True, act="relu"))


def test_combined_source_defines_each_kernel_once():
    src = cuda.combined_source(VARIANTS)
    names = [m.group(1) for m in re.finditer(r'__global__ void(?: __launch_bounds__\([^)]*\))? (\w+)\(', src)]
    # Guards drop repeated prelude / dtype blocks, so count what survives the preprocessor: every
    # name is textually repeated, but each guarded block is entered once. Emulate the guards.
    seen, defined = set(), []
    for block in re.split(r"(?=#ifndef PICOMPILE_CUDA_)", src):
        m = re.match(r"#ifndef (PICOMPILE_CUDA_\w+)", block)
        if m:
            if m.group(1) in seen:
                continue
            seen.add(m.group(1))
        defined += re.findall(r'__global__ void(?: __launch_bounds__\([^)]*\))? (\w+)\(', block)
    assert len(defined) == len(set(defined))
    expected = {n for v in VARIANTS for n in v.kernel_names().values()}
    assert set(defined) == expected == set(names)
    # 3 dtypes x 7 dtype kernels + mask bits + compaction + 2 gate/up kernels per variant
    assert len(defined) == 3 * 7 + 2 + 2 * len(VARIANTS)


# ------------------------------------------------------------------------------------------------
# nvcc
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cubins():
    """Start the all-variants build of every arch at once (two nvcc processes on two cores)."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(cuda.ARCHS))
    futures = {arch: pool.submit(cuda.compile_many_with_nvcc, VARIANTS, arch) for arch in cuda.ARCHS}
    yield futures
    pool.shutdown(wait=True)


@needs_nvcc
@pytest.mark.parametrize("arch", cuda.ARCHS)
def test_nvcc_builds_every_variant(cubins, arch):
    path = cubins[arch].result()
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and path.suffix == ".cubin"
    for v in VARIANTS:
        for name in v.kernel_names().values():
            assert name.encode() in data, f"{name} missing from the {arch} cubin"


@needs_nvcc
@pytest.mark.parametrize("dtype", cuda.DTYPES)
def test_compile_with_nvcc_one_variant(dtype):
    v = cuda.CudaVariant(dtype, gated=True, drelu=False, bias=True, act="gelu_tanh", threshold=True)
    path = cuda.compile_with_nvcc(v, "sm_90")
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF"
    assert all(name.encode() in data for name in v.kernel_names().values())
    assert cuda.compile_with_nvcc(v, "sm_90") == path  # cached


@needs_nvcc
def test_nvcc_failure_names_stderr(tmp_path, monkeypatch):
    monkeypatch.setenv("PICOMPILE_CACHE_DIR", str(tmp_path))
    bad = "extern \"C\" __global__ void k(int* p) { this_is_not_defined(p); }\n"
    with pytest.raises(cuda.NvccError) as e:
        cuda.compile_source_with_nvcc(bad, "sm_80")
    assert "this_is_not_defined" in str(e.value) and "stderr" in str(e.value)
    assert not list(tmp_path.glob("*.cubin"))  # nothing cached


def test_nvcc_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(cuda.NVCC_ENV, "/nonexistent/nvcc")
    assert cuda.nvcc_path() is None
    with pytest.raises(cuda.NvccError, match="nvcc not found"):
        cuda.compile_with_nvcc(VARIANTS[0], "sm_90")


def test_bad_arch():
    with pytest.raises(ValueError, match="sm_80"):
        cuda.compile_with_nvcc(VARIANTS[0], "compute_90")


# ------------------------------------------------------------------------------------------------
# The GPU side without a GPU: imports fine, clear errors
# ------------------------------------------------------------------------------------------------


def test_load_without_cupy_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    with pytest.raises(cuda.CudaUnavailable, match=r"picompile\[cuda13\]"):
        cuda.load(VARIANTS[0])


def test_cuda_ffn_rejects_cpu_tensors():
    import torch

    w = torch.zeros(4, 8)
    with pytest.raises(cuda.CudaUnavailable, match="CUDA tensors"):
        cuda.CudaFFN(w, w)
