"""CUDA kernels for the hot (GPU-resident) rows of an activation-sparse FFN block.

The math is the contract of `picompile.runtime.sparse_ffn` (see its docstring and `ffn_reference`),
restricted to the hot rows: neurons are permuted hot-first, so rows 0..n_hot-1 of w_gate, w_up,
w_down_t and of the predictor's p2 live on the GPU. Per call (T <= 8 tokens) the pipeline is:

  1. predictor   z = relu(p1 x + pb1)            p1 [r, d], r <= 1024          pi_pred_hidden_*
                 logits = p2 z + pb2, fire iff logit > tau (any token)       pi_pred_mask_*
                 -> a bitmask, one uint32 word per 32 hot neurons
  2. compaction  bitmask -> dense ascending int32 index list + count         pi_compact
                 (or a bool mask [T, n], any token on)                       pi_compact_mask
                 (one block, ballot/popc + block prefix sum: deterministic order; it also
                 zeroes the counters the next two kernels add to, saving their launches)
  3. gate / up   one warp per listed row, 16-byte loads, fp32 accumulation,  pi_gate_up_*
                 the activation fused, the ReLU zero-gate skip (the up row is then never read),
                 the |h| > threshold test; h [T, cap] fp32
  4. down        out[t] = sum_i h[t, i] * w_down_t[idx[i]] (+ b_down)        pi_down_*
                 race-free: each block owns a slice of d and a contiguous range of the list; with
                 more than one range per slice, the slice's last block to finish sums the
                 per-range partials in range order (deterministic, no atomics on out).

In a CUDA graph each kernel costs a few microseconds whatever it reads, which at 5-10% of the rows
is most of a call: hence the compaction and the down sums inside their neighbours' launches.

Small batches (T = 2..8) use the union of the per-token predictions: a row is listed when any
token fires, it is loaded once for all T tokens, and h is computed for every token on it (the
ReLU / threshold test then zeroes the per-token inactive ones, exactly as `ffn_reference` with
that index list and no `allowed` mask does; the CPU kernel gives each token its own, and a split
block's cold rows take the union too, runtime/hybrid.py). T = 1 has its own kernels (`*_1_*`,
the token loops compile away).

Every variant (`picompile.codegen.variant.Variant`, the type the C generator uses too) is its own
source, assembled from package data: picompile/kernels/ffn_cuda.cuh (number formats, loads, warp
sums, activations and every kernel body as a template, include-guarded), then, with the dtype's
#defines in front, ffn_cuda_dtype.cuh (the predictor and down kernels), then, with the variant's
#defines in front, ffn_cuda_variant.cuh (the gate/up kernels, the body instantiated on the
variant). Kernel names carry the dtype or the variant tag, so any set of variants also makes one
translation unit, each part once (`combined_source`, what the CI compile test builds in one nvcc
call per arch). The kernels files are spliced in (`build.splice_headers`): a source is one text,
for NVRTC and for the build cache's key.

Quantized variants (dtype q8_0 / q4_0 / q4_1, down rows q8_0) read GGUF blocks and dequantize
them in registers (ffn_cuda_q.cuh, with qdecode.h's decoding, which a host test checks against
picompile.quant bit for bit), fp32 accumulation; x, biases and the predictor are float32. The rows
are the CPU's SparseFFN rows as they are (gate / up rows in the dot layout, down rows in GGUF's),
and gate / up rows are dotted with x rounded to integer blocks (pi_round_x,
quant.round_activations), as the reference and the C kernels do: results match ffn_reference up
to float summation order.

No system headers are included: float16 / bfloat16 are read as raw 16-bit words and widened with
one PTX `cvt` (f16) or a shift (bf16), so the same source builds with nvcc and with NVRTC (cupy).

Fast math: not used (no --use_fast_math, no -use_fast_math in NVRTC). The kernels are memory bound
(a few FLOPs per weight byte), so approximate math buys nothing measurable, while it would swap
tanhf for tanh.approx (relative error ~2^-11, enough to break the fp32 tolerance of gelu_tanh),
expf for ex2.approx (silu) and flush denormals.

Running: `load(v)` compiles a variant with NVRTC through cupy (default; the device's own arch, and
independent of the local nvcc's CUDA version, which may be newer than the driver) or, with
backend="nvcc" / PICOMPILE_CUDA_BACKEND=nvcc, from the cubin of `compile_with_nvcc`. Launches go
on PyTorch's current stream; tensors are passed as raw data_ptr()s, never copied. cupy is
imported lazily: this module imports (and generates / compiles sources) without it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import warnings
from pathlib import Path

from picompile import quant
from picompile.activations import ACT_MACROS
from picompile.codegen.build import BuildFailed, compile_cached, package_source, splice_headers
from picompile.codegen.variant import ACTS, DTYPES, QFORMATS, Variant
from picompile.config import KERNEL_MAX_TOKENS

ARCHS = ("sm_80", "sm_90")

MAX_TOKENS = KERNEL_MAX_TOKENS  # the small-batch kernels are built for this many tokens
# quant_linear: above this many tokens, row tiles dequantized and multiplied by cuBLAS (the
# kernels read the whole weight once per MAX_TOKENS tokens)
QLINEAR_KERNEL_MAX_TOKENS = 4 * MAX_TOKENS
MAX_SMEM_BYTES = 48 * 1024  # the predictor keeps z [T, r] fp32 in (default-size) shared memory

# nvcc flags (fast math left out on purpose: see the module docstring).
NVCC_FLAGS = ["-O3", "-std=c++17", "-x", "cu"]
BACKEND_ENV = "PICOMPILE_CUDA_BACKEND"  # "nvrtc" (default) | "nvcc"
NVCC_ENV = "PICOMPILE_NVCC"  # path to nvcc, else $PATH, $CUDA_HOME/bin, /usr/local/cuda/bin

# Per float dtype: its number format in ffn_cuda.cuh and that format's elements per 16 B (VEC).
_FORMATS = {
    "float32": ("PiF32", 4),
    "float16": ("PiF16", 8),
    "bfloat16": ("PiBF16", 8),
}

# Per GGUF block format: its code in qdecode.h. Quantized variants read gate / up rows in one of
# them and down rows in q8_0 (DOWN_QFORMAT); x, biases and the predictor are float32.
_QFORMATS = {"q8_0": "PQD_Q8_0", "q4_0": "PQD_Q4_0", "q4_1": "PQD_Q4_1"}
DOWN_QFORMAT = "q8_0"
_Q_DOWN_VEC = 8  # PiQRows::VEC: down columns per thread

# Block sizes; the kernels' __launch_bounds__ (ffn_cuda.cuh's PI_* macros) use the same numbers.
_WARPS_PER_BLOCK = 8  # pred_hidden, pred_mask, gate_up: 256 threads
_DOWN_THREADS = 128
_COMPACT_THREADS = 1024
_MAX_SPLIT = 64  # down: at most this many row ranges (partials) per column slice


class CudaUnavailable(RuntimeError):
    """cupy or a CUDA device is missing where a GPU path was asked for."""


class NvccError(BuildFailed):
    """nvcc is missing or failed; the message carries its stderr."""


# ------------------------------------------------------------------------------------------------
# Variants
# ------------------------------------------------------------------------------------------------


def _check(v: Variant) -> None:
    """The CUDA kernels read float weights all of one dtype, or GGUF gate / up rows (any of
    QFORMATS) with q8_0 down rows."""
    if v.quantized:
        if v.down_dtype != DOWN_QFORMAT:
            raise ValueError(f"the CUDA kernels take {v.dtype} gate / up rows with "
                             f"{DOWN_QFORMAT} down rows, not {v.down_dtype!r} down")
    elif v.dtype not in _FORMATS or v.down_dtype != v.dtype:
        raise ValueError(f"the CUDA kernels take weights in one dtype of {DTYPES} (or "
                         f"{QFORMATS} gate / up rows with {DOWN_QFORMAT} down rows), not "
                         f"{v.dtype!r} gate / up and {v.down_dtype!r} down")


def _dtype_tag(v: Variant) -> str:
    """The suffix of v's predictor and down kernels (ffn_cuda_dtype.cuh): the dtype's short name,
    or for quantized variants "f32_q8_0" (float32 x, predictor and b_down; q8_0 down rows),
    which all of them share."""
    return f"f32_{v.down_dtype}" if v.quantized else v.dtag


def _x_format(v: Variant) -> str:
    """The float dtype of x, the biases and the predictor: the weights' dtype, float32 for
    quantized variants."""
    return "float32" if v.quantized else v.dtype


def _rows_format(fmt: str, dot: bool = False) -> str:
    """The row format struct (ffn_cuda.cuh's PiRows, ffn_cuda_q.cuh's PiQRows) of rows in
    `fmt`. dot: rows in the dot layout (SparseFFN's gate / up rows; down rows are GGUF's)."""
    if fmt in _QFORMATS:
        return f"PiQRows<{_QFORMATS[fmt]}, {int(dot)}>"
    return f"PiRows<{_FORMATS[fmt][0]}>"


def kernel_names(v: Variant) -> dict[str, str]:
    """Role -> extern "C" kernel name in `source(v)`."""
    dt = _dtype_tag(v)
    quantized = {"round_x": "pi_round_x", "qlinear_1": f"pi_qlinear_1_{v.dtype}",
                 "qlinear_b": f"pi_qlinear_b_{v.dtype}"} if v.quantized else {}
    return {
        "pred_hidden_1": f"pi_pred_hidden_1_{dt}",
        "pred_hidden_b": f"pi_pred_hidden_b_{dt}",
        "pred_mask_1": f"pi_pred_mask_1_{dt}",
        "pred_mask_b": f"pi_pred_mask_b_{dt}",
        "compact": "pi_compact",
        "compact_mask": "pi_compact_mask",
        "gate_up_1": f"pi_gate_up_1_{v.tag}",
        "gate_up_b": f"pi_gate_up_b_{v.tag}",
        "down_1": f"pi_down_1_{dt}",
        "down_b": f"pi_down_b_{dt}",
        **quantized,
    }


def all_variants(quantized: bool = True) -> list[Variant]:
    """Every variant the compiler can ask for: dtype x kind x act x bias x threshold, where dReLU
    blocks come with act="relu" only (relu(gate) * relu(up); `source` still accepts any act);
    dtype: the float DTYPES, then (quantized) the QFORMATS with q8_0 down rows."""
    out = []
    for dtype in DTYPES + (QFORMATS if quantized else ()):
        for gated, drelu, acts in ((False, False, ACTS), (True, False, ACTS), (True, True, ("relu",))):
            for act in acts:
                for bias in (False, True):
                    for threshold in (False, True):
                        out.append(Variant(dtype, gated, drelu, bias, act, threshold,
                                           DOWN_QFORMAT if dtype in QFORMATS else None))
    return out


# ------------------------------------------------------------------------------------------------
# Sources: the kernel files, specialised by #defines
# ------------------------------------------------------------------------------------------------


def _dtype_part(v: Variant) -> str:
    """ffn_cuda_dtype.cuh for v's dtype (_dtype_tag): the predictor and down kernels."""
    return (f"#define PI_DT {_dtype_tag(v)}\n"
            f"#define PI_FMT {_FORMATS[_x_format(v)][0]}\n"
            f"#define PI_ROWS {_rows_format(v.down_dtype)}\n"
            '#include "ffn_cuda_dtype.cuh"\n')


def _qlinear_part(fmt: str) -> str:
    """ffn_cuda_qlinear.cuh for one block format: the dense linear kernels on its rows."""
    return (f"#define PI_QTAG {fmt}\n"
            f"#define PI_QF {_QFORMATS[fmt]}\n"
            '#include "ffn_cuda_qlinear.cuh"\n')


def _variant_part(v: Variant) -> str:
    """ffn_cuda_variant.cuh for one variant: its gate/up kernels."""
    return (f"#define PI_TAG {v.tag}\n"
            f"#define PI_FMT {_FORMATS[_x_format(v)][0]}\n"
            f"#define PI_ROWS {_rows_format(v.dtype, dot=True)}\n"
            f"#define PI_GATED {int(v.gated)}\n"
            f"#define PI_DRELU {int(v.drelu)}\n"
            f"#define PI_BIAS {int(v.bias)}\n"
            f"#define PI_ACT {ACT_MACROS[v.act]}\n"
            f"#define PI_THRESHOLD {int(v.threshold)}\n"
            '#include "ffn_cuda_variant.cuh"\n')


def combined_source(variants) -> str:
    """The CUDA C source of `variants` as one translation unit: ffn_cuda.cuh, then the dtype
    kernels of each dtype (once, before its first variant; ffn_cuda_q.cuh once before the first
    quantized one, the dense linear kernels of a quantized format once before its first variant)
    and the gate/up kernels of each variant, the kernels headers spliced in."""
    variants = list(dict.fromkeys(variants))
    parts = [f"// picompile CUDA source, generated by picompile/codegen/cuda.py from "
             f"picompile/kernels/ffn_cuda*.cuh: {len(variants)} variant(s)\n",
             '#include "ffn_cuda.cuh"\n']
    dtypes, qformats = set(), set()
    for v in variants:
        _check(v)
        if v.quantized and not qformats:
            parts.append('#include "ffn_cuda_q.cuh"\n')
        if v.quantized and v.dtype not in qformats:
            qformats.add(v.dtype)
            parts.append(_qlinear_part(v.dtype))
        if _dtype_tag(v) not in dtypes:
            dtypes.add(_dtype_tag(v))
            parts.append(_dtype_part(v))
        parts.append(_variant_part(v))
    return splice_headers("".join(parts))


def source(v: Variant) -> str:
    """The CUDA C source of one variant: ffn_cuda.cuh, its dtype's kernels, its gate/up kernels."""
    return combined_source([v])


# ------------------------------------------------------------------------------------------------
# nvcc
# ------------------------------------------------------------------------------------------------


def nvcc_path() -> str | None:
    """nvcc to use: $PICOMPILE_NVCC, else on $PATH, else $CUDA_HOME/bin, /usr/local/cuda/bin."""
    env = os.environ.get(NVCC_ENV)
    if env:
        return env if (os.path.isfile(env) and os.access(env, os.X_OK)) else None
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            cand = os.path.join(home, "bin", "nvcc")
            if os.path.isfile(cand) and os.access(cand, os.X_OK):
                return cand
    return None


def _check_arch(arch: str) -> None:
    if not (arch.startswith("sm_") and arch[3:].rstrip("af").isdigit()):
        raise ValueError(f"arch must look like 'sm_80' / 'sm_90', not {arch!r}")


def compile_source_with_nvcc(src: str, arch: str, *, tag: str = "") -> Path:
    """Compile CUDA source to a cubin for `arch` through the build cache (the same path as the C
    libraries: build.compile_cached). -> its path."""
    _check_arch(arch)
    nvcc = nvcc_path()
    if nvcc is None:
        raise NvccError(
            "nvcc not found (set PICOMPILE_NVCC, put nvcc on PATH or set CUDA_HOME); it is only "
            "needed for backend='nvcc' and the compile checks: the default backend compiles with "
            "NVRTC through cupy"
        )
    flags = ["-cubin", f"-arch={arch}", *NVCC_FLAGS]
    return compile_cached(src, [nvcc], flags, suffix=".cubin", tag=f"cuda:{arch}:{tag}",
                          what=f"nvcc ({arch})", timeout=None, error=NvccError,
                          identity_label="nvcc does not run: set PICOMPILE_NVCC")


def compile_with_nvcc(v: Variant, arch: str) -> Path:
    """nvcc -cubin -arch=<arch> -O3 one variant (no fast math, see above). -> cached cubin path.

    Raises NvccError naming nvcc's stderr on failure, or saying that nvcc is absent."""
    return compile_source_with_nvcc(source(v), arch, tag=v.tag)


def compile_many_with_nvcc(variants, arch: str) -> Path:
    """All `variants` in one translation unit and one nvcc call (the CI compile check)."""
    variants = list(variants)
    return compile_source_with_nvcc(combined_source(variants), arch, tag=f"{len(variants)}-variants")


# ------------------------------------------------------------------------------------------------
# Loading and launching (cupy, lazily imported)
# ------------------------------------------------------------------------------------------------


def _cupy():
    try:
        import cupy
    except ImportError as e:
        raise CudaUnavailable(
            "the CUDA kernels need cupy: pip install 'picompile[cuda13]' (CUDA 13) or "
            "'picompile[cuda12]' (CUDA 12), matching your driver's CUDA version"
        ) from e
    return cupy


def _torch_dtype(name: str):
    import torch

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def load(v: Variant, backend: str | None = None) -> CudaKernels:
    """Compile (NVRTC via cupy by default, or nvcc's cubin; None: $PICOMPILE_CUDA_BACKEND) and
    load one variant, once per backend."""
    return _load(v, _backend(backend))


def _backend(backend: str | None = None) -> str:
    return backend or os.environ.get(BACKEND_ENV, "nvrtc")


@functools.lru_cache(maxsize=None)
def _load(v: Variant, backend: str) -> CudaKernels:
    return CudaKernels(v, _raw_module(source(v), backend, v.tag))


def _raw_module(src: str, backend: str, tag: str):
    """src as a cupy module on the current device: NVRTC's build ("nvrtc") or nvcc's cubin for
    the device's arch ("nvcc", cached under `tag`)."""
    cp = _cupy()
    if backend == "nvrtc":
        return cp.RawModule(code=src)
    if backend == "nvcc":
        cc = cp.cuda.Device().compute_capability  # e.g. "90"
        return cp.RawModule(path=str(compile_source_with_nvcc(src, f"sm_{cc}", tag=tag)))
    raise ValueError(f"backend must be 'nvrtc' or 'nvcc', not {backend!r}")


def _ptr(t) -> object:
    import numpy as np

    return np.uint64(0 if t is None else t.data_ptr())


def _i32(v: int):
    import numpy as np

    return np.int32(v)


def _f32(v: float):
    import numpy as np

    return np.float32(v)


def _aligned16(*ts) -> bool:
    return all(t is None or t.data_ptr() % 16 == 0 for t in ts)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=64)
def _cupy_stream(index: int, ptr: int):
    """cupy's wrapper of the CUDA stream `ptr` (PyTorch's), made once per stream: building one
    per launch costs host time on every block of every token."""
    cp = _cupy()
    # CuPy 14 deprecates ExternalStream for the CUDA stream protocol (Stream.from_external);
    # it still works the same, and older CuPy has nothing else: kept, without the warning.
    with cp.cuda.Device(index), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return cp.cuda.ExternalStream(ptr, index)
        except TypeError:  # older cupy: ExternalStream(ptr)
            return cp.cuda.ExternalStream(ptr)


@contextlib.contextmanager
def torch_stream(device):
    """Make PyTorch's current stream on `device` cupy's current stream (and its device current)."""
    import torch

    cp = _cupy()
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _cupy_stream(index, torch.cuda.current_stream(index).cuda_stream)
    with cp.cuda.Device(index), stream:
        yield stream


class CudaKernels:
    """One loaded variant: a launch method per kernel, on cupy's current stream (use
    `torch_stream(device)` around them). Arguments are torch CUDA tensors, passed by pointer;
    shapes are documented at each kernel in `source`."""

    def __init__(self, variant: Variant, module):
        self.variant = variant
        self.module = module
        self.names = kernel_names(variant)
        self.vec = _FORMATS[_x_format(variant)][1]  # x's elements per 16-byte load
        # down columns per thread: one 16-byte load of a float row, or 8 of a q8_0 block
        self.down_vec = _Q_DOWN_VEC if variant.quantized else self.vec
        self._fns: dict[str, object] = {}

    def _fn(self, role: str):
        fn = self._fns.get(role)
        if fn is None:
            fn = self._fns[role] = self.module.get_function(self.names[role])
        return fn

    def _launch(self, role, grid, block, args, shared_mem=0):
        self._fn(role)(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem)

    def _sms(self, t) -> int:
        return _sm_count(t.device.index)

    def pred_hidden(self, x, p1, pb1, z) -> None:
        """x [T, d], p1 [r, d], pb1 [r] -> z [T, r] fp32."""
        T, d = x.shape
        r = p1.shape[0]
        vec = int(d % self.vec == 0 and _aligned16(x, p1))
        blocks = max(1, min(math.ceil(r / _WARPS_PER_BLOCK), 8 * self._sms(x)))
        self._launch("pred_hidden_1" if T == 1 else "pred_hidden_b", (blocks,),
                     (_WARPS_PER_BLOCK * 32,),
                     (_ptr(x), _ptr(p1), _ptr(pb1), _ptr(z), _i32(T), _i32(d), _i32(r), _i32(vec)))

    def pred_mask(self, z, T: int, p2, pb2, tau: float, mask) -> None:
        """z [T, r] fp32, p2 [n_hot, r], pb2 [n_hot] -> mask [ceil(n_hot / 32)] int32 bits."""
        n_hot, r = p2.shape
        smem = T * r * 4
        if smem > MAX_SMEM_BYTES:
            raise ValueError(f"predictor rank {r} x {T} tokens needs {smem} B of shared memory")
        n_words = math.ceil(n_hot / 32)
        vec = int(r % self.vec == 0 and _aligned16(p2))
        blocks = max(1, min(math.ceil(n_words / _WARPS_PER_BLOCK), 8 * self._sms(z)))
        self._launch("pred_mask_1" if T == 1 else "pred_mask_b", (blocks,),
                     (_WARPS_PER_BLOCK * 32,),
                     (_ptr(z), _ptr(p2), _ptr(pb2), _f32(tau), _ptr(mask), _i32(T), _i32(r),
                      _i32(n_hot), _i32(vec)),
                     shared_mem=smem)

    def compact(self, mask, n_words: int, idx, count, counters) -> None:
        """mask [n_words] bits -> idx [32 n_words] (ascending; `count` of them), count [1];
        counters [k] int32 zeroed (what gate_up and down add to)."""
        self._launch("compact", (1,), (_COMPACT_THREADS,),
                     (_ptr(mask), _i32(n_words), _ptr(idx), _ptr(count), _ptr(counters),
                      _i32(counters.numel())))

    def compact_mask(self, mask, idx, count, counters) -> None:
        """mask [T, n] bool (rows may be strided, columns contiguous) -> idx [n], the neurons on
        for any token (ascending; `count` of them), count [1]; counters zeroed, as compact."""
        T, n = mask.shape
        self._launch("compact_mask", (1,), (_COMPACT_THREADS,),
                     (_ptr(mask), _i32(T), _i32(n), _i32(mask.stride(0)), _ptr(idx), _ptr(count),
                      _ptr(counters), _i32(counters.numel())))

    def gate_up(self, x, w_gate, w_up, b_gate, b_up, idx, count, cap: int, threshold: float,
                h, n_active) -> None:
        """x [T, d]; rows idx[:count] (count <= cap) of w_gate / w_up -> h [T, cap] fp32."""
        T, d = x.shape
        # quantized rows are read byte by byte: only x's alignment matters
        rows_aligned = self.variant.quantized or _aligned16(w_gate, w_up)
        vec = int(d % self.vec == 0 and _aligned16(x) and rows_aligned)
        blocks = max(1, min(math.ceil(cap / _WARPS_PER_BLOCK), 8 * self._sms(x)))
        self._launch("gate_up_1" if T == 1 else "gate_up_b", (blocks,), (_WARPS_PER_BLOCK * 32,),
                     (_ptr(x), _ptr(w_gate), _ptr(w_up), _ptr(b_gate), _ptr(b_up), _ptr(idx),
                      _ptr(count), _f32(threshold), _ptr(h), _ptr(n_active), _i32(T), _i32(d),
                      _i32(cap), _i32(vec)))

    def round_x(self, x, xr, fmt: str) -> None:
        """x [T, d] fp32 -> xr [T, d] fp32: rounded to integer blocks as rows of `fmt` read it
        (quant.round_activations)."""
        n_blocks = x.numel() // 32
        levels = quant.format_of(fmt).activation_levels
        blocks = max(1, min(math.ceil(n_blocks / 256), 8 * self._sms(x)))
        self._launch("round_x", (blocks,), (256,), (_ptr(x), _ptr(xr), _i32(n_blocks), _f32(levels)))

    def qlinear(self, xr, w, bias, y) -> None:
        """xr [T, k] fp32 (T <= 8, rounded by round_x for this variant's format), w [o, k / 32
        * block bytes] uint8 rows of the format in the dot layout, bias [o] fp32 or None ->
        y [T, o] fp32."""
        T, k = xr.shape
        o = w.shape[0]
        if not 1 <= T <= MAX_TOKENS:  # the kernels hold MAX_TOKENS accumulators per lane
            raise ValueError(f"qlinear takes 1 to {MAX_TOKENS} tokens a launch, got {T}")
        vec = int(_aligned16(xr))
        blocks = max(1, min(math.ceil(o / _WARPS_PER_BLOCK), 8 * self._sms(xr)))
        self._launch("qlinear_1" if T == 1 else "qlinear_b", (blocks,), (_WARPS_PER_BLOCK * 32,),
                     (_ptr(w), _ptr(xr), _ptr(bias), _ptr(y), _i32(T), _i32(k), _i32(o),
                      _i32(vec)))

    def down_slices(self, d: int) -> int:
        """Column slices of the down kernel's grid (its `arrive` counters)."""
        return math.ceil(d / (_DOWN_THREADS * self.down_vec))

    def n_split(self, cap: int, d: int, device_index: int) -> int:
        """Row ranges per column slice of the down projection (1: no partial sums); with
        several, each slice's last block to finish adds theirs up."""
        want = math.ceil(2 * _sm_count(device_index) / self.down_slices(d))
        return max(1, min(_MAX_SPLIT, cap // 32, want))

    def down(self, h, cap: int, idx, count, w_down_t, b_down, out, accumulate: bool,
             arrive) -> None:
        """out [T, d] (+)= h [T, cap] over rows idx[:count] of w_down_t (+ b_down). arrive
        [down_slices(d)] int32 zeros, counted up by the blocks."""
        import torch

        T, d = out.shape
        vec = int(d % self.down_vec == 0 and _aligned16(w_down_t))
        col_blocks, n_split = self.down_slices(d), self.n_split(cap, d, out.device.index)
        partial = None
        if n_split > 1:
            partial = torch.empty(n_split * T * d, dtype=torch.float32, device=out.device)
        self._launch("down_1" if T == 1 else "down_b", (col_blocks, n_split), (_DOWN_THREADS,),
                     (_ptr(h), _i32(cap), _ptr(idx), _ptr(count), _ptr(w_down_t), _ptr(b_down),
                      _ptr(out), _ptr(partial), _ptr(arrive), _i32(T), _i32(d), _i32(vec),
                      _i32(int(accumulate))))
        # `partial` is freed to torch's caching allocator on this (the current) stream: reuse by a
        # later allocation on the same stream is ordered after the kernel.


# ------------------------------------------------------------------------------------------------
# The block on the GPU
# ------------------------------------------------------------------------------------------------


def memcpy_async(dst, src) -> None:
    """cudaMemcpyAsync(dst, src) on PyTorch's current stream: contiguous tensors of one dtype and
    size, at least one on a CUDA device, a host side pinned (a graph-capturable copy)."""
    if not (dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype
            and dst.numel() == src.numel()):
        raise ValueError(f"memcpy_async: {tuple(dst.shape)} {dst.dtype} <- {tuple(src.shape)} "
                         f"{src.dtype} (contiguous tensors of one dtype and size only)")
    import torch

    cp = _cupy()
    device = dst.device if dst.device.type == "cuda" else src.device
    stream = torch.cuda.current_stream(device).cuda_stream
    cp.cuda.runtime.memcpyAsync(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size(),
                                cp.cuda.runtime.memcpyDefault, stream)


HOST_WAIT_SOURCE = "host_wait.cu"
# Longer than any cold part takes, shorter than a hang anyone waits out: past it the device
# goes on and says so (wait_value's gave_up).
HOST_WAIT_TIMEOUT_S = 20.0


@functools.lru_cache(maxsize=None)
def _host_wait_kernel(device_index: int, backend: str):
    with _cupy().cuda.Device(device_index):
        module = _raw_module(package_source(HOST_WAIT_SOURCE), backend, "wait")
        return module.get_function("pi_wait_value")


def wait_value(flag, value, gave_up, timeout_s: float = HOST_WAIT_TIMEOUT_S) -> None:
    """Queue on PyTorch's current stream a wait until flag [1] int32 (pinned host memory the
    host writes) equals value [1] int32 (on the device): the stream's later work runs after the
    host has written what the flag announces. Past timeout_s the device goes on and sets
    gave_up [1] int32 (pinned) to 1. Nothing waits on the host; a CUDA graph captures it as a
    kernel node (kernels/host_wait.cu)."""
    import torch

    for name, t in (("flag", flag), ("gave_up", gave_up)):
        if t.device.type != "cpu" or not t.is_pinned() or t.dtype != torch.int32:
            raise ValueError(f"wait_value: {name} must be a pinned int32 host tensor")
    _require_cuda(value)
    index = value.device.index if value.device.index is not None else torch.cuda.current_device()
    kernel = _host_wait_kernel(index, _backend())
    with torch_stream(value.device):
        kernel((1,), (1,), (_ptr(flag), _ptr(value), _ptr(gave_up), _u64(int(timeout_s * 1e9))))


@functools.lru_cache(maxsize=None)
def host_wait_works(device_index: int) -> str:
    """Whether the device and the host see each other's writes to pinned memory (what the
    hybrid's hand-offs rely on): the pinned pointer is the device's too (unified addressing;
    asked of CUDA first, since a kernel reading a pointer that is not would end the CUDA
    context), a wait for a flag another thread sets a moment after the launch ends (wait_value),
    and a copy from the device into a pinned flag shows to a host thread spinning on it without
    a synchronize (the cold worker's wait for `ready`). -> "" where they do, else why not. Once
    per device and process; each direction bounded by a 2 s timeout."""
    import threading
    import time

    import torch

    cp = _cupy()
    device = torch.device("cuda", device_index)
    flag, gave_up = (torch.zeros(1, dtype=torch.int32, pin_memory=True) for _ in range(2))
    try:
        with cp.cuda.Device(device_index):
            mapped = cp.cuda.runtime.pointerGetAttributes(flag.data_ptr()).devicePointer
    except (AttributeError, cp.cuda.runtime.CUDARuntimeError) as e:
        return f"CUDA does not say where pinned memory is on the device ({e})"
    if mapped != flag.data_ptr():
        return ("pinned host memory has another address on the device (no unified "
                "addressing): the device cannot wait for the cold worker's flags")
    value = torch.ones(1, dtype=torch.int32, device=device)
    setter = threading.Timer(0.01, flag.fill_, args=(1,))  # a thread of its own: a launch may
    setter.start()  # block (CUDA_LAUNCH_BLOCKING=1) until the wait ends
    try:
        with torch.cuda.device(device):
            wait_value(flag, value, gave_up, timeout_s=2.0)
            torch.cuda.current_stream(device).synchronize()
    finally:
        setter.join()
    if int(gave_up):
        return ("the GPU does not see the host's writes to pinned memory within 2 s (a wait "
                "for a flag the host set gave up)")
    seen = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    with torch.cuda.device(device):
        seen.copy_(torch.full((1,), 7, dtype=torch.int32, device=device), non_blocking=True)
    deadline = time.monotonic() + 2.0
    while int(seen) != 7 and time.monotonic() < deadline:
        time.sleep(1e-4)
    if int(seen) != 7:
        return ("the host does not see the GPU's copies into pinned memory within 2 s without "
                "a synchronize (the cold worker waits for its input that way)")
    return ""


def _u64(v: int):
    import numpy as np

    return np.uint64(v)


def _require_cuda(t) -> None:
    if not t.is_cuda:
        raise CudaUnavailable(f"the CUDA kernels need CUDA tensors (got one on {t.device}); use "
                              "the C / reference path on the CPU")


class CudaFFN:
    """The hot rows of one FFN block on the GPU: predictor -> compaction -> gate/up -> down.

    All tensors are torch CUDA tensors on one device, contiguous, in one dtype (weights, biases,
    x and the predictor; x is cast if it differs): w_up / w_gate / w_down_t [n_hot, d],
    b_up / b_gate [n_hot], b_down [d] (optional: leave it to whoever adds the cold part),
    predictor p1 [r, d], pb1 [r], p2 [n_hot, r], pb2 [n_hot], neuron j fires iff
    p2[j] . relu(p1 x + pb1) + pb2[j] > tau.

    Quantized (`qformat` "q8_0" | "q4_0" | "q4_1"): w_gate / w_up are uint8 row blocks [n_hot,
    quant.row_bytes(d, qformat)] as SparseFFN holds them (in the dot layout,
    quant.interleave_blocks), w_down_t q8_0 rows in GGUF's layout (`down_qformat` "q8_0", the
    default for uint8 down rows); biases, the predictor and x are float32. Gate / up rows
    are dotted with x rounded to integer blocks, as in ffn_reference.

    Calls return (out [T, d] float32, n_active), n_active a 0-d int32 CUDA tensor counting the
    active (token, neuron) pairs (int() of it synchronizes). Nothing here synchronizes."""

    def __init__(self, w_up, w_down_t, *, w_gate=None, b_gate=None, b_up=None, b_down=None,
                 act: str = "relu", drelu: bool = False, threshold: float = 0.0,
                 p1=None, pb1=None, p2=None, pb2=None, tau: float = 0.0,
                 qformat: str | None = None, down_qformat: str | None = None,
                 backend: str | None = None):
        import torch

        _require_cuda(w_up)
        dtype = qformat or str(w_up.dtype).removeprefix("torch.")
        down = dtype
        if qformat is not None:
            down = down_qformat or (qformat if w_down_t.dtype == torch.uint8
                                    else str(w_down_t.dtype).removeprefix("torch."))
        bias = b_up is not None or b_gate is not None
        self.variant = Variant(
            dtype=dtype, gated=w_gate is not None, drelu=drelu, bias=bias, act=act,
            threshold=float(threshold) != 0.0, down_dtype=down,
        )
        _check(self.variant)
        self.threshold = float(threshold)
        self.tau = float(tau)
        self.device = w_up.device
        n_rows = w_up.shape[0]
        d = (w_up.shape[1] // quant.format_of(qformat).block_bytes * quant.BLOCK
             if qformat is not None else w_up.shape[1])
        self.n_rows, self.d = n_rows, d
        want = _torch_dtype(_x_format(self.variant))  # x, biases, predictor
        # gate / up and down rows, in elements of their tensors (bytes when quantized: uint8)
        rows = (n_rows, self.variant.row_bytes(d) // w_up.element_size())
        down_rows = (n_rows, self.variant.row_bytes(d, down) // w_down_t.element_size())

        def check(t, name, shape, required=False, dtype=None):
            if t is None:
                if required:
                    raise ValueError(f"{name} is required for variant {self.variant.tag}")
                return None
            dt = dtype or want
            if t.device != self.device or t.dtype != dt:
                raise ValueError(f"{name}: expected {dt} on {self.device}, got {t.dtype} "
                                 f"on {t.device}")
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
            return t.contiguous()

        # the bias variants read both of a gated block's biases: the one it lacks is zeros
        if bias and b_up is None:
            b_up = torch.zeros(n_rows, dtype=want, device=self.device)
        if bias and self.variant.gated and b_gate is None:
            b_gate = torch.zeros(n_rows, dtype=want, device=self.device)
        q = torch.uint8 if qformat is not None else None
        self.w_up = check(w_up, "w_up", rows, dtype=q)
        self.w_down_t = check(w_down_t, "w_down_t", down_rows, True, dtype=q)
        self.w_gate = check(w_gate, "w_gate", rows, dtype=q)
        self.b_up = check(b_up, "b_up", (n_rows,), bias)
        self.b_gate = check(b_gate, "b_gate", (n_rows,), self.variant.gated and self.variant.bias)
        self.b_down = check(b_down, "b_down", (d,))
        self.p1 = self.pb1 = self.p2 = self.pb2 = None
        if p1 is not None:
            r = p1.shape[0]
            self.p1 = check(p1, "p1", (r, d))
            self.pb1 = check(pb1, "pb1", (r,), True)
            self.p2 = check(p2, "p2", (n_rows, r), True)
            self.pb2 = check(pb2, "pb2", (n_rows,), True)
        self.kernels = load(self.variant, backend)
        self.last_idx = None  # device tensors of the last predicted call: idx [n_rows], count [1]
        self.last_count = None

    # -- pieces ----------------------------------------------------------------------------------
    def _x(self, x):
        if x.dim() != 2 or x.shape[1] != self.d:
            raise ValueError(f"x: expected [T, {self.d}], got {tuple(x.shape)}")
        if not 1 <= x.shape[0] <= MAX_TOKENS:
            raise ValueError(f"the CUDA kernels take 1..{MAX_TOKENS} tokens, got {x.shape[0]} "
                             "(prefill goes through dense BLAS)")
        if x.device != self.device:
            raise ValueError(f"x is on {x.device}, the weights on {self.device}")
        return x.to(_torch_dtype(_x_format(self.variant))).contiguous()

    def _out(self, out, T):
        import torch

        if out is None:
            return torch.empty(T, self.d, dtype=torch.float32, device=self.device)
        if (tuple(out.shape) != (T, self.d) or out.dtype != torch.float32
                or out.device != self.device or not out.is_contiguous()):
            raise ValueError(f"out: expected contiguous float32 [{T}, {self.d}] on {self.device}")
        return out

    def predict(self, x):
        """-> (idx [n_rows] int32, count [1] int32), device tensors: idx[:count] are the rows
        predicted to fire for some token, ascending."""

        if self.p1 is None:
            raise ValueError("this CudaFFN has no predictor (p1, pb1, p2, pb2)")
        x = self._x(x)
        with torch_stream(self.device):
            return self._predict(x, self._counters())

    def _counters(self, zeroed: bool = False):
        """-> int32 [1 + column slices] on the device: n_active, then the down kernel's arrivals
        per column slice. Zeroed by the compaction kernel that runs first, else here."""
        import torch

        n = 1 + self.kernels.down_slices(self.d)
        make = torch.zeros if zeroed else torch.empty
        return make(n, dtype=torch.int32, device=self.device)

    def _predict(self, x, counters):
        """-> (idx, count) of the predicted rows; counters zeroed."""
        import torch

        T = x.shape[0]
        r = self.p1.shape[0]
        n_words = max(1, math.ceil(self.n_rows / 32))
        z = torch.empty(T, r, dtype=torch.float32, device=self.device)
        run = self.n_rows > 0 and r > 0  # the predictor then writes every word of the mask
        mask = (torch.empty if run else torch.zeros)(n_words, dtype=torch.int32,
                                                     device=self.device)
        idx = torch.empty(max(1, self.n_rows), dtype=torch.int32, device=self.device)
        count = torch.empty(1, dtype=torch.int32, device=self.device)
        if run:
            self.kernels.pred_hidden(x, self.p1, self.pb1, z)
            self.kernels.pred_mask(z, T, self.p2, self.pb2, self.tau, mask)
        self.kernels.compact(mask, n_words, idx, count, counters)
        return idx, count

    def _run(self, x, idx, count, cap, out, accumulate, counters):
        """gate / up, then down, over rows idx[:count] (count <= cap); counters zeroed."""
        import torch

        T = x.shape[0]
        if self.variant.dtype in quant.FORMATS:  # gate / up rows read x rounded
            xr = torch.empty_like(x)
            self.kernels.round_x(x, xr, self.variant.dtype)
            x = xr
        h = torch.empty(T, max(1, cap), dtype=torch.float32, device=self.device)
        n_active, arrive = counters[0], counters[1:]
        self.kernels.gate_up(x, self.w_gate, self.w_up, self.b_gate, self.b_up, idx, count,
                             max(1, cap), self.threshold, h, n_active)
        self.kernels.down(h, max(1, cap), idx, count, self.w_down_t, self.b_down, out, accumulate,
                          arrive)
        return out, n_active

    # -- entry points ----------------------------------------------------------------------------
    def __call__(self, x, *, out=None, accumulate: bool = False):
        """x [T, d] -> (out [T, d] fp32, n_active): the predicted hot rows (union over tokens)."""

        if self.p1 is None:
            raise ValueError("this CudaFFN has no predictor; use ffn_given_idx")
        x = self._x(x)
        out = self._out(out, x.shape[0])
        with torch_stream(self.device):
            counters = self._counters()
            idx, count = self._predict(x, counters)
            self.last_idx, self.last_count = idx, count
            return self._run(x, idx, count, self.n_rows, out, accumulate, counters)

    def ffn_given_mask(self, x, mask, *, out=None, accumulate: bool = False):
        """x [T, d], mask [T, n_rows] bool on the device (a predictor's decision) -> (out,
        n_active) over the rows set for any token. Compacted on the device: no host sync."""
        import torch

        x = self._x(x)
        out = self._out(out, x.shape[0])
        if tuple(mask.shape[-1:]) != (self.n_rows,):
            raise ValueError(f"mask: expected [T, {self.n_rows}], got {tuple(mask.shape)}")
        if mask.dtype != torch.bool or mask.device != self.device or mask.dim() != 2:
            raise ValueError(f"mask: expected bool [T, {self.n_rows}] on {self.device}")
        if mask.stride(1) != 1:
            mask = mask.contiguous()
        with torch_stream(self.device):
            idx = torch.empty(max(1, self.n_rows), dtype=torch.int32, device=self.device)
            count = torch.empty(1, dtype=torch.int32, device=self.device)
            counters = self._counters()
            self.kernels.compact_mask(mask, idx, count, counters)
            return self._run(x, idx, count, self.n_rows, out, accumulate, counters)

    def ffn_given_idx(self, x, idx, *, out=None, accumulate: bool = False):
        """x [T, d], idx [m] rows (any order, int32 or int64, on the device) -> (out, n_active);
        matches ffn_reference(..., idx=idx) on the same weights."""
        import torch

        x = self._x(x)
        out = self._out(out, x.shape[0])
        idx = idx.to(device=self.device, dtype=torch.int32).contiguous()
        m = idx.numel()
        with torch_stream(self.device):
            count = torch.full((1,), m, dtype=torch.int32, device=self.device)
            return self._run(x, idx, count, m, out, accumulate, self._counters(zeroed=True))


def hot_ffn(x, w_up, w_down_t, *, w_gate=None, b_gate=None, b_up=None, b_down=None,
            p1, pb1, p2, pb2, tau: float, act: str = "relu", drelu: bool = False,
            threshold: float = 0.0, out=None, accumulate: bool = False, qformat=None,
            down_qformat=None, backend=None):
    """One call of the hot rows: predictor -> compaction -> gate/up -> down.
    -> (out [T, d] fp32, n_active 0-d int32 CUDA tensor). See CudaFFN."""
    ffn = CudaFFN(w_up, w_down_t, w_gate=w_gate, b_gate=b_gate, b_up=b_up, b_down=b_down,
                  act=act, drelu=drelu, threshold=threshold, p1=p1, pb1=pb1, p2=p2, pb2=pb2,
                  tau=tau, qformat=qformat, down_qformat=down_qformat, backend=backend)
    return ffn(x, out=out, accumulate=accumulate)


def ffn_given_idx(x, w_up, w_down_t, idx, *, w_gate=None, b_gate=None, b_up=None, b_down=None,
                  act: str = "relu", drelu: bool = False, threshold: float = 0.0, out=None,
                  accumulate: bool = False, qformat=None, down_qformat=None, backend=None):
    """The block over the rows idx (no predictor); same keywords as ffn_reference.
    -> (out [T, d] fp32, n_active 0-d int32 CUDA tensor)."""
    ffn = CudaFFN(w_up, w_down_t, w_gate=w_gate, b_gate=b_gate, b_up=b_up, b_down=b_down,
                  act=act, drelu=drelu, threshold=threshold, qformat=qformat,
                  down_qformat=down_qformat, backend=backend)
    return ffn.ffn_given_idx(x, idx, out=out, accumulate=accumulate)


def linear_variant(fmt: str) -> Variant:
    """The variant whose module holds the dense linear kernels of block format `fmt` (every
    quantized variant of that format does; this one is the simplest)."""
    return Variant(fmt, gated=False, drelu=False, bias=False, act="relu", down_dtype=DOWN_QFORMAT)


def quant_linear(x, qweight, fmt: str, bias=None, backend=None):
    """x [T, k] (float, CUDA) through a quantized linear layer on the GPU: qweight [o, k / 32 *
    block bytes] uint8, GGUF blocks of `fmt` in the dot layout (QuantLinear.qweight), bias [o]
    float32 or None -> y [T, o] fp32 = round_activations(x) @ dequantize(qweight).T + bias,
    quant.round_activations and quant.dequantize's arithmetic up to float summation order.
    Tokens go through the kernels in groups of 8 (every group reads the weight once); above
    QLINEAR_KERNEL_MAX_TOKENS, row tiles are dequantized and multiplied
    (quant.linear_dequantized). Nothing synchronizes."""
    import torch

    _require_cuda(x)
    if x.dim() != 2 or x.shape[1] % quant.BLOCK:
        raise ValueError(f"quant_linear: x is [T, k] with k a multiple of {quant.BLOCK}, got "
                         f"{tuple(x.shape)}")
    T, k = x.shape
    o = qweight.shape[0] if qweight.dim() == 2 else -1
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or \
            qweight.shape[1] != quant.row_bytes(k, fmt) or qweight.device != x.device:
        raise ValueError(f"quant_linear: {fmt} rows for {k} inputs are uint8 [o, "
                         f"{quant.row_bytes(k, fmt)}] on {x.device}; got {qweight.dtype} "
                         f"{tuple(qweight.shape)} on {qweight.device}")
    if bias is not None and tuple(bias.shape) != (o,):
        raise ValueError(f"quant_linear: bias is [{o}], got {tuple(bias.shape)}")
    kernels = load(linear_variant(fmt), backend)
    x = x.to(torch.float32).contiguous()
    qweight = qweight.contiguous()
    bias = None if bias is None else bias.to(device=x.device, dtype=torch.float32).contiguous()
    y = torch.empty(T, o, dtype=torch.float32, device=x.device)
    with torch_stream(x.device):
        xr = torch.empty_like(x)
        if T:
            kernels.round_x(x, xr, fmt)
        if T > QLINEAR_KERNEL_MAX_TOKENS:
            return quant.linear_dequantized(xr, qweight, fmt, bias, out=y)
        for t0 in range(0, T, MAX_TOKENS):
            kernels.qlinear(xr[t0 : t0 + MAX_TOKENS], qweight, bias, y[t0 : t0 + MAX_TOKENS])
    return y
