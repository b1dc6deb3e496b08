"""CUDA code generation, checked without a GPU: every variant's source is well formed and builds
with nvcc for sm_80 and sm_90 (one nvcc call per arch for all variants, both archs at once).

The kernels themselves are run against ffn_reference in test_cuda_kernels_gpu.py (marked gpu)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import fnmatch
import importlib.resources
import pathlib
import re
import shutil
import sys

import pytest

from picompile.activations import ACT_MACROS, ACTIVATIONS
from picompile.codegen import build, cuda
from picompile.codegen.variant import QFORMATS, Variant
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
    # (3 dtypes + 3 GGUF formats) x (5 plain + 5 gated + 1 dReLU) x 4 (bias, threshold)
    assert len(VARIANTS) == len(set(VARIANTS)) == 6 * (2 * len(ACTIVATIONS) + 1) * 4 == 264
    assert len({v.tag for v in VARIANTS}) == len(VARIANTS)
    for v in VARIANTS:
        assert re.fullmatch(r"[a-z0-9_]+", v.tag)
        assert not v.drelu or (v.gated and v.act == "relu")
        assert v.down_dtype == ("q8_0" if v.quantized else v.dtype)
    assert {v.dtype for v in VARIANTS} == set(cuda.DTYPES) | set(QFORMATS)
    assert cuda.all_variants(quantized=False) == [v for v in VARIANTS if not v.quantized]
    assert {v.act for v in VARIANTS} == set(cuda.ACTS) == set(ACTIVATIONS)


def test_variant_validation():
    with pytest.raises(ValueError, match="dtype"):
        Variant("float64", gated=True, drelu=False, bias=False, act="silu")
    with pytest.raises(ValueError, match="act"):
        Variant("float16", gated=True, drelu=False, bias=False, act="tanh")
    with pytest.raises(ValueError, match="gated"):
        Variant("float16", gated=False, drelu=True, bias=False, act="relu")
    # One variant type for C and CUDA: the CUDA kernels refuse what only the C ones take.
    with pytest.raises(ValueError, match="CUDA kernels take"):
        cuda.source(Variant("q4_0", gated=True, drelu=False, bias=False, act="relu"))  # q4_0 down
    with pytest.raises(ValueError, match="CUDA kernels take"):
        cuda.source(Variant("q4_1", gated=True, drelu=False, bias=False, act="relu",
                            down_dtype="float32"))
    with pytest.raises(ValueError, match="CUDA kernels take"):
        cuda.source(Variant("float16", gated=True, drelu=False, bias=False, act="relu",
                            down_dtype="q8_0"))
    cuda.source(Variant("q8_0", gated=True, drelu=False, bias=False, act="relu"))  # q8_0 down: fine
    with pytest.raises(ValueError, match="CUDA kernels take"):
        cuda.source(Variant("float16", gated=True, drelu=False, bias=False, act="relu",
                            down_dtype="float32"))


def test_variant_for_block():
    block = BlockPlan(name="m.mlp", module="m", kind="drelu", act="relu", d_model=8, d_ff=16,
                      bias=True, dtype="bfloat16", decided=Decisions(threshold=0.25))
    v = Variant.for_block(block)
    assert v == Variant("bfloat16", gated=True, drelu=True, bias=True, act="relu", threshold=True)
    assert v.kind == block.kind
    block = dataclasses.replace(block, kind="plain", act="gelu", bias=False, decided=Decisions(),
                                dtype="float32")
    assert Variant.for_block(block) == Variant(
        "float32", gated=False, drelu=False, bias=False, act="gelu", threshold=False)


_KERNEL = re.compile(r'extern "C" __global__ void(?: __launch_bounds__\([^)]*\))?\s+'
                     r'(PI_CAT\(\w+, PI_(?:DT|TAG|QTAG)\)|\w+)\((.*?\)[ \t]*(?://[^\n]*)?)\n\{', re.S)


def _kernel_defs(src: str) -> list[tuple[str, str]]:
    """(extern "C" kernel name, its parameter list text) of each kernel a source defines, in order,
    with the name macros expanded as the preprocessor does: PI_CAT(pi_down_1_, PI_DT) after
    `#define PI_DT f16` is pi_down_1_f16 (PI_TAG: a variant's, PI_QTAG: a block format's). (Each
    part of a source is there once; test below.)"""
    out = []
    suffix = {}
    for part in re.split(r"(?=^#define PI_(?:DT|TAG|QTAG) )", src, flags=re.M):
        m = re.match(r"#define (PI_DT|PI_TAG|PI_QTAG) (\w+)", part)
        if m:
            suffix[m.group(1)] = m.group(2)
        for name, params in _KERNEL.findall(part):
            call = re.fullmatch(r"PI_CAT\((\w+), (PI_\w+)\)", name)
            out.append((call.group(1) + suffix[call.group(2)] if call else name, params))
    return out


def test_kernel_files_document_every_parameter():
    """Each extern "C" kernel of the .cuh files: one parameter per line, each with a comment."""
    files = importlib.resources.files("picompile") / "kernels"
    n = 0
    for name in ("ffn_cuda.cuh", "ffn_cuda_dtype.cuh", "ffn_cuda_variant.cuh", "ffn_cuda_q.cuh",
                 "ffn_cuda_qlinear.cuh"):
        for kernel, params in _KERNEL.findall((files / name).read_text()):
            n += 1
            lines = [ln for ln in params.strip().splitlines() if ln.strip()]
            assert lines, kernel
            for ln in lines:
                assert "//" in ln, f"{kernel}: parameter without a comment: {ln.strip()}"
            if re.search(r"pi_(gate_up|down_1|down_b|pred|qlinear)", kernel):
                assert re.search(r"\[\w+, \w+\]", params), f"{kernel}: no [rows, cols] shape comment"
    # compaction (of bits, of a bool mask); per dtype; per variant; rounding of x; per block
    # format (dense linear layers)
    assert n == 2 + 6 + 2 + 1 + 2


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.tag)
def test_source_has_the_kernels(v):
    src = cuda.source(v)
    names = [name for name, _ in _kernel_defs(src)]
    assert sorted(names) == sorted(cuda.kernel_names(v).values())
    # Self-contained: the kernels headers are spliced in, no other header is included (nvcc and
    # NVRTC compile the same text), and no fast math.
    includes = re.findall(r"#include\s*[<\"]([^>\"]+)", src)
    assert set(includes) <= {"cuda_fp16.h", "cuda_bf16.h"}
    assert "use_fast_math" not in " ".join(cuda.NVCC_FLAGS)
    # The variant is baked in by #defines in front of the kernel files.
    assert f"#define PI_TAG {v.tag}\n" in src
    assert f"#define PI_GATED {int(v.gated)}\n" in src
    assert f"#define PI_ACT {ACT_MACROS[v.act]}\n" in src


def test_sources_differ_where_variants_differ():
    sources = {v: cuda.source(v) for v in VARIANTS}
    assert len(set(sources.values())) == len(VARIANTS)
    for v in VARIANTS:
        for field, value in (("dtype", None), ("gated", not v.gated), ("bias", not v.bias),
                             ("act", None), ("threshold", not v.threshold)):
            formats = cuda.DTYPES + QFORMATS
            choices = ([value] if value is not None
                       else [x for x in (formats if field == "dtype" else cuda.ACTS)
                             if x != getattr(v, field)])
            for c in choices:
                # (the CUDA kernels take one float dtype, or GGUF rows with q8_0 down rows)
                down = "q8_0" if c in QFORMATS else c
                change = {"dtype": c, "down_dtype": down} if field == "dtype" else {field: c}
                try:
                    w = dataclasses.replace(v, **change)
                except ValueError:  # e.g. plain dReLU
                    continue
                assert cuda.source(w) != sources[v], (v, field, c)
    # What changes is what the field means.
    base = Variant("float16", gated=True, drelu=False, bias=False, act="silu")
    src = sources[base]
    assert "#define PI_ACT PIC_SILU\n" in src and "#define PI_FMT PiF16\n" in src
    assert "#define PI_ACT PIC_GELU\n" in cuda.source(dataclasses.replace(base, act="gelu"))
    assert "#define PI_ACT PIC_GELU_TANH\n" in cuda.source(dataclasses.replace(base, act="gelu_tanh"))
    bf16 = dataclasses.replace(base, dtype="bfloat16", down_dtype="bfloat16")
    assert "#define PI_FMT PiBF16\n" in cuda.source(bf16)
    assert "#define PI_THRESHOLD 1\n" in cuda.source(dataclasses.replace(base, threshold=True))
    assert "#define PI_DRELU 1\n" in cuda.source(dataclasses.replace(base, drelu=True, act="relu"))
    # ... and each activation macro selects its own implementation (shared numbering, act.h).
    prelude = (importlib.resources.files("picompile") / "kernels" / "ffn_cuda.cuh").read_text()
    for act, code in (("PIC_SILU", "expf(-v)"), ("PIC_GELU", "erff("), ("PIC_GELU_TANH", "tanhf(")):
        body = prelude.split(f"pi_act<{act}>(float v) {{", 1)[1].split("}", 1)[0]
        assert code in body, act
    act_h = (importlib.resources.files("picompile") / "kernels" / "act.h").read_text()
    for macro in ACT_MACROS.values():
        assert re.search(rf"^#define {macro} \d+$", act_h, re.M), macro


@pytest.mark.parametrize("fmt", QFORMATS)
def test_quantized_sources(fmt):
    """A quantized variant reads its gate / up rows as SparseFFN holds them (the dot layout,
    what quant.interleave_blocks makes), q8_0 down rows in GGUF's layout, x / biases / predictor in float32, and decodes blocks with qdecode.h (the header the
    host test checks); float sources carry none of it."""
    v = Variant(fmt, gated=True, drelu=False, bias=True, act="silu", down_dtype="q8_0")
    src = cuda.source(v)
    import torch

    from picompile import quant

    q = torch.arange(2 * 8 * quant.format_of(fmt).block_bytes, dtype=torch.int64).to(torch.uint8)
    q = q.reshape(2, -1)
    assert not torch.equal(quant.interleave_blocks(q, fmt), q)  # the layouts differ
    code = {"q8_0": "PQD_Q8_0", "q4_0": "PQD_Q4_0", "q4_1": "PQD_Q4_1"}[fmt]
    assert f"#define PI_ROWS PiQRows<{code}, 1>\n" in src  # gate / up
    assert "#define PI_ROWS PiQRows<PQD_Q8_0, 0>\n" in src  # down
    assert "#define PI_DT f32_q8_0\n" in src and "#define PI_FMT PiF16" not in src
    assert src.count("#define PI_FMT PiF32\n") == 2
    assert "pqd_row_block(" in src and "pi_round_x" in cuda.kernel_names(v).values()
    assert "pqd_" not in cuda.source(dataclasses.replace(v, dtype="float32", down_dtype="float32"))


def test_combined_source_defines_each_kernel_once():
    src = cuda.combined_source(VARIANTS + VARIANTS[:3])  # repeats are dropped
    assert src.count("#define PICOMPILE_CUDA_PRELUDE") == 1
    assert src.count("#define PICOMPILE_CUDA_Q") == src.count("#define PICOMPILE_QDECODE_H") == 1
    # the float dtypes, and f32_q8_0: every quantized variant's predictor and q8_0 down rows
    assert src.count("#define PI_DT ") == len(cuda.DTYPES) + 1
    assert src.count("#define PI_TAG ") == len(VARIANTS)
    assert src.count("#define PI_QTAG ") == len(cuda.QFORMATS)  # dense linear kernels
    defined = [name for name, _ in _kernel_defs(src)]
    assert len(defined) == len(set(defined))
    expected = {n for v in VARIANTS for n in cuda.kernel_names(v).values()}
    assert set(defined) == expected
    # 4 dtype parts x 6 kernels + 2 compactions + rounding + 2 gate/up kernels per
    # variant + 2 dense linear kernels per block format
    assert len(defined) == 4 * 6 + 3 + 2 * len(VARIANTS) + 2 * len(cuda.QFORMATS)


def test_kernel_sources_are_package_data():
    """The kernel files are found through importlib.resources, and pyproject's package-data
    globs name every one of them (so a wheel ships them)."""
    files = importlib.resources.files("picompile") / "kernels"
    names = sorted(f.name for f in files.iterdir() if f.is_file())
    for name in ("ffn.c", "qblocks.h", "act.h", "ffn_cuda.cuh", "ffn_cuda_dtype.cuh",
                 "ffn_cuda_variant.cuh", "ffn_cuda_q.cuh", "qdecode.h"):
        assert name in names
        assert build.package_source(name)  # spliced without error
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"
    globs = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["picompile"]
    for name in names:
        assert any(fnmatch.fnmatch(f"kernels/{name}", g) for g in globs), name


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
        for name in cuda.kernel_names(v).values():
            assert name.encode() in data, f"{name} missing from the {arch} cubin"


@needs_nvcc
@pytest.mark.parametrize("dtype", cuda.DTYPES + QFORMATS)
def test_compile_with_nvcc_one_variant(dtype):
    v = Variant(dtype, gated=True, drelu=False, bias=True, act="gelu_tanh", threshold=True,
                down_dtype="q8_0" if dtype in QFORMATS else None)
    path = cuda.compile_with_nvcc(v, "sm_90")
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF"
    assert all(name.encode() in data for name in cuda.kernel_names(v).values())
    assert cuda.compile_with_nvcc(v, "sm_90") == path  # cached


@needs_nvcc
@pytest.mark.parametrize("arch", cuda.ARCHS)
def test_nvcc_builds_the_device_wait_for_the_host(arch):
    """kernels/host_wait.cu, the kernel the device decoder's graphs wait with for each split
    block's cold rows (its system-scope acquire load and the global timer need sm_70 and up)."""
    path = cuda.compile_source_with_nvcc(build.package_source(cuda.HOST_WAIT_SOURCE), arch,
                                         tag="wait")
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and b"pi_wait_value" in data


def test_the_device_wait_takes_a_pinned_int32_flag_only():
    import torch

    with pytest.raises(ValueError, match="flag must be a pinned int32 host tensor"):
        flag = torch.zeros(1, dtype=torch.int32)  # not pinned: the device cannot read it
        cuda.wait_value(flag, torch.zeros(1, dtype=torch.int32), flag)


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
