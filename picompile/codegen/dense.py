"""The dense linear C kernel (picompile/kernels/dense.c): decode GEMV and small-T GEMM.

One shared library per weight format and vector width, built from the package's `kernels/dense.c`
with `-DPI_WDTYPE=...` by the same compiler, flags and build cache as
the C FFN kernels (`picompile.codegen.c.build_library`), and loaded with
ctypes (the GIL is released during a call). The AVX2 build runs one token; where the CPU has
AVX-512F, a second build with `-mavx512f` runs AVX512_MIN_TOKENS tokens and more (measured on
AMD EPYC Zen 4 with benchmarks/gemv.py: 256-bit vectors read memory faster for one token,
512-bit ones halve the instructions where several tokens make the loop compute-bound).

    kernel = dense_kernel_for(weight [O, K], bias [O] | None)   # None: no kernel, use F.linear
    out = kernel(x [T, K])                                      # -> [T, O] float32

computes `x @ weight.T + bias` with float32 accumulation, each weight row read once for all T
tokens (T <= 8; more tokens are done in groups of 8). The bias is read in the weight's dtype (as
F.linear uses it). The kernel reads the weight and bias through raw pointers: it keeps the
(contiguous) tensors alive, and sees in-place updates of contiguous ones; after a dtype / device
change or a reassigned `.data`, bind again (runtime.dense_linear.DenseLinear does).

Weight formats ("variants" of the library) are of two kinds, kept apart here:

- torch dtypes of float weights (DTYPES: "float32", "float16", "bfloat16"): W is that tensor;
- block-quantized formats of picompile.quant (QFORMATS: "q8_0", "q4_0", "q4_1"), which are no
  torch dtype: W is the uint8 tensor [O, K / 32 * block_bytes] of GGUF's blocks, the bias float32.

    qweight = quant.interleave_blocks(blocks [O, row_bytes] uint8, "q4_0")  # the kernel's layout
    kernel = quant_kernel_for(qweight, "q4_0", K, bias [O] | None)
    out = kernel(x [T, K])                                      # -> [T, O] float32

computes `x @ quant.dequantize(blocks, fmt, K).T + bias` over x rounded to integer blocks
(quant.round_activations), the blocks dotted in integers. Rows are read in qblocks.h's dot
layout (interleave_blocks: each run of 8 blocks of a row interleaved, so their sums and scales
fill vector lanes).
"""

from __future__ import annotations

import ctypes
import logging
import math
import pathlib
import threading
from typing import Callable

import torch

from picompile import quant
from picompile.codegen import c
from picompile.config import reference_forced

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
QFORMATS = ("q8_0", "q4_0", "q4_1")  # picompile.quant's block formats: uint8 weights, no dtype
VARIANTS = (*DTYPES, *QFORMATS)  # what one library is built for
# PI_WDTYPE in dense.c
_WDTYPE_CODE = {"float32": 0, "float16": 1, "bfloat16": 2, "q8_0": 3, "q4_0": 4, "q4_1": 5}
MAX_TOKENS = 8  # tokens per pass over the weights (PI_MAXTOK in dense.c)
AVX512_MIN_TOKENS = 3  # calls with fewer tokens run the AVX2 build (see above)
# The same for the quantized formats: dequantizing makes the loop compute-bound, and the AVX-512
# build was faster from one token on (benchmarks/dense_quant.py --isa, AMD EPYC Zen 4).
AVX512_MIN_TOKENS_Q = {"q8_0": 1, "q4_0": 1, "q4_1": 1}

DenseKernel = Callable[[torch.Tensor], torch.Tensor]


def source() -> str:
    """The text of picompile/kernels/dense.c (package data, headers spliced in)."""
    return c.package_source("dense.c")


def default_tuning() -> dict[str, int]:
    """dense.c's knobs for this CPU. Intel: software prefetches 4 KiB ahead in the weight stream
    (its hardware prefetchers stop at 4 KiB pages; 1.1x to 1.4x GB/s on a Xeon Cascade Lake for
    one token, float and quantized, benchmarks/dense_prefetch.py); elsewhere none (AMD EPYC Zen 4:
    its hardware prefetchers were as fast, benchmarks/gemv.py)."""
    return {"PF_BYTES": 4096} if c.cpu_vendor() == "GenuineIntel" else {}


def flags(variant: str, avx512: bool = False, tuning: dict[str, int] | None = None) -> list[str]:
    """Compiler flags of the library for weight format `variant` (a VARIANTS name: a float dtype
    or a quantized format): c.build_flags() plus the variant's -D flags (and -mavx512f).
    `tuning` adds -DPI_<name>=<int> over default_tuning()'s (tests, benchmarks)."""
    if variant not in VARIANTS:
        raise ValueError(f"unsupported weight format {variant!r} "
                         f"(the dense kernel takes {VARIANTS})")
    out = [*c.build_flags(), f"-DPI_WDTYPE={_WDTYPE_CODE[variant]}"]
    if avx512:
        out.append("-mavx512f")
        if variant in quant.FORMATS and quant.format_of(variant).activation_bits == 8 and {
                "avx512vl", "avx512bw", "avx512_vnni"} <= c.cpu_flags():
            out += ["-mavx512vl", "-mavx512bw", "-mavx512vnni"]  # integer dots: vpdpbusd
    knobs = {**default_tuning(), **(tuning or {})}
    out += [f"-DPI_{k}={int(v)}" for k, v in sorted(knobs.items())]
    return out


def build(variant: str, avx512: bool = False, tuning: dict[str, int] | None = None) -> pathlib.Path:
    """Compile (or fetch from the build cache) the library for one weight format; its path."""
    return c.build_library(source(), flags(variant, avx512, tuning), tag="picompile-dense")


_vp, _i64 = ctypes.c_void_p, ctypes.c_int64
_DENSE_ARGTYPES = [_vp, _i64, _i64, _vp, _i64, _vp, _vp]  # x, T, K, W, O, b, out
# x, T, K, n, W[n], O[n], b[n], out[n]
_DENSE_MULTI_ARGTYPES = [_vp, _i64, _i64, ctypes.c_int, _vp, _vp, _vp, _vp]

_libs: dict[tuple, ctypes.CDLL] = {}
_libs_lock = threading.Lock()
_failures: dict[str, str] = {}  # variant -> why its library is not available (last failed try)
_errors: dict[tuple, Exception] = {}  # load key -> its build / load error: not retried per layer


def load(variant: str, avx512: bool = False, tuning: dict[str, int] | None = None) -> ctypes.CDLL:
    """The loaded library for a weight format (built on first use). Raises on any failure (the
    same error again, without rebuilding, for the same compiler and flags in this process)."""
    cc = c.compiler()
    fl = flags(variant, avx512, tuning)
    key = (tuple(cc), tuple(fl))
    with _libs_lock:
        lib = _libs.get(key)
        if lib is None:
            if key in _errors:
                raise _errors[key]
            try:
                path = build(variant, avx512, tuning)
                try:
                    lib = ctypes.CDLL(str(path))
                    for symbol in ("pi_dense", "pi_dense_multi", "pi_set_num_threads",
                                   "pi_dense_variant"):
                        getattr(lib, symbol)
                except (OSError, AttributeError) as e:
                    raise c.LoadFailed(f"{path}: {e}") from e
            except Exception as e:
                _errors[key] = e
                raise
            lib.pi_dense.argtypes = _DENSE_ARGTYPES
            lib.pi_dense.restype = None
            lib.pi_dense_multi.argtypes = _DENSE_MULTI_ARGTYPES
            lib.pi_dense_multi.restype = None
            lib.pi_set_num_threads.argtypes = [ctypes.c_int]
            lib.pi_set_num_threads.restype = None
            lib.pi_dense_variant.argtypes = []
            lib.pi_dense_variant.restype = ctypes.c_char_p
            if variant in QFORMATS:
                lib.pi_dequantize.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                              ctypes.c_int, ctypes.c_void_p]
                lib.pi_dequantize.restype = None
            lib._pi_threads = None  # last value given to pi_set_num_threads
            _libs[key] = lib
    return lib


def try_load(variant: str) -> ctypes.CDLL | None:
    """load(variant), or None (no compiler, failed build or load): the cause is kept for
    why_no_kernel, and the first failure of the process is warned about once."""
    try:
        lib = load(variant)
    except Exception as e:  # noqa: BLE001 - a failed build must never break the model
        if isinstance(e, c.CompilerNotFound):
            why = e.label
        elif isinstance(e, c.BuildFailed):
            why = f"C build failed: {e.summary}"
        else:
            lines = str(e).strip().splitlines()
            why = f"C kernel failed: {lines[0] if lines else type(e).__name__}"
        _failures[variant] = " ".join(why.split())[:200]
        log.debug("dense C kernel (%s) unavailable", variant, exc_info=True)
        # One warning per process for all of picompile's C kernels (FFN and dense alike).
        c._warn_once(f"picompile: no dense C kernel ({_failures[variant]}): linear layers run "
                     "torch's F.linear; set PICOMPILE_REFERENCE=1 to silence this")
        return None
    _failures.pop(variant, None)
    return lib


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def why_no_kernel(weight: torch.Tensor, bias: torch.Tensor | None = None) -> str:
    """The path label when dense_kernel_for(weight, bias) gives None: "reference (<cause>)"."""
    if reference_forced():
        return "reference (PICOMPILE_REFERENCE set)"
    if _dtype_name(weight) not in DTYPES:
        return f"reference (no dense C kernel for {_dtype_name(weight)})"
    if weight.dim() != 2 or (bias is not None and bias.shape != (weight.shape[0],)):
        return "reference (not a [O, K] weight with an [O] bias)"
    if any(t is not None and t.device.type != "cpu" for t in (weight, bias)):
        return "reference (weights not on the CPU)"
    reason = _failures.get(_dtype_name(weight))
    return f"reference ({reason})" if reason else "reference (C kernel not selected)"


def _set_threads(lib: ctypes.CDLL) -> None:
    """The kernel uses as many OpenMP threads as torch does."""
    nt = torch.get_num_threads()
    if lib._pi_threads != nt:
        lib.pi_set_num_threads(nt)
        lib._pi_threads = nt


def _wide_lib(variant: str) -> ctypes.CDLL | None:
    """The AVX-512 build for several tokens, where the CPU has AVX-512F and it builds."""
    if not c.avx512_available():
        return None
    try:
        return load(variant, avx512=True)
    except Exception:  # noqa: BLE001 - the AVX2 build serves all token counts then
        log.debug("dense C kernel (%s, AVX-512) unavailable", variant, exc_info=True)
        return None


def dense_kernel_for(weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     avx512: bool | None = None,
                     tuning: dict[str, int] | None = None) -> DenseKernel | None:
    """A C kernel computing `x @ weight.T + bias` -> float32 on the CPU, for x [T, K] (or
    [..., K] -> [..., O]) of any float dtype, strides and device; or None when there is none
    (PICOMPILE_REFERENCE set, no compiler / failed build, weight dtype not float32 / float16 /
    bfloat16, tensors not on the CPU, shapes not [O, K] and [O]).

    avx512 None: the AVX2 build for fewer than AVX512_MIN_TOKENS tokens, the AVX-512 one (where
    available) for more; True / False: that build for every call (it must build: raises
    otherwise). `tuning`: -DPI_<name>=<int> knobs of dense.c (tests, benchmarks)."""
    if reference_forced():
        return None
    dtype = _dtype_name(weight)
    if dtype not in DTYPES or weight.dim() != 2:
        return None
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        return None
    if any(t is not None and t.device.type != "cpu" for t in (weight, bias)):
        return None
    # Kept referenced by the kernel: the C code reads them through raw pointers. For contiguous
    # tensors of the weight's dtype these are the tensors themselves (no copy).
    w = weight.detach().contiguous()
    b = None if bias is None else bias.detach().to(weight.dtype).contiguous()
    O, K = w.shape
    return _bind(dtype, w, b, O, K, avx512, tuning, AVX512_MIN_TOKENS)


def why_no_quant_kernel(qweight: torch.Tensor, fmt: str, in_features: int,
                        bias: torch.Tensor | None = None) -> str:
    """The path label when quant_kernel_for(...) gives None: "reference (<cause>)"."""
    if reference_forced():
        return "reference (PICOMPILE_REFERENCE set)"
    if fmt not in QFORMATS:
        return f"reference (no dense C kernel for the format {fmt!r})"
    why = _quant_shape_error(qweight, fmt, in_features, bias)
    if why:
        return f"reference ({why})"
    if any(t is not None and t.device.type != "cpu" for t in (qweight, bias)):
        return "reference (weights not on the CPU)"
    reason = _failures.get(fmt)
    return f"reference ({reason})" if reason else "reference (C kernel not selected)"


def _quant_shape_error(qweight: torch.Tensor, fmt: str, in_features: int,
                       bias: torch.Tensor | None) -> str:
    from picompile import quant

    if in_features <= 0 or in_features % quant.BLOCK:
        return f"{in_features} input features, not a multiple of {quant.BLOCK}"
    rb = quant.row_bytes(in_features, fmt)
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] != rb:
        return (f"a {fmt} weight of {in_features} input features is uint8 [O, {rb}], got "
                f"{str(qweight.dtype).removeprefix('torch.')} {tuple(qweight.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != qweight.shape[0]
                             or not bias.is_floating_point()):
        return f"the bias is not a float [{qweight.shape[0]}]"
    return ""


def quant_kernel_for(qweight: torch.Tensor, fmt: str, in_features: int,
                     bias: torch.Tensor | None = None, *, avx512: bool | None = None,
                     tuning: dict[str, int] | None = None) -> DenseKernel | None:
    """A C kernel computing `x @ quant.dequantize(quant.deinterleave_blocks(qweight, fmt), fmt,
    in_features).T + bias` -> float32 on the CPU, for x [T, K] (or [..., K] -> [..., O]),
    K = in_features, qweight in the kernel's layout (quant.interleave_blocks); or None when
    there is none (PICOMPILE_REFERENCE set, no compiler / failed build, tensors not on the CPU;
    why_no_quant_kernel says which). Raises ValueError for a format that is not in QFORMATS or
    shapes that do not fit it (uint8 [O, quant.row_bytes(K, fmt)], K a multiple of 32, bias [O]).

    The kernel's `weight` is the uint8 tensor of blocks, `bias` float32 (a copy where the given
    one is not contiguous float32). avx512 / tuning as in dense_kernel_for (the AVX-512 build
    from AVX512_MIN_TOKENS_Q[fmt] tokens)."""
    if fmt not in QFORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}: choose one of {QFORMATS}")
    why = _quant_shape_error(qweight, fmt, in_features, bias)
    if why:
        raise ValueError(f"no {fmt} dense kernel: {why}")
    if reference_forced():
        return None
    if any(t is not None and t.device.type != "cpu" for t in (qweight, bias)):
        return None
    w = qweight.detach().contiguous()
    b = None if bias is None else bias.detach().to(torch.float32).contiguous()
    return _bind(fmt, w, b, w.shape[0], in_features, avx512, tuning, AVX512_MIN_TOKENS_Q[fmt])


def _bind(variant: str, w: torch.Tensor, b: torch.Tensor | None, O: int, K: int,
          avx512: bool | None, tuning: dict[str, int] | None,
          wide_from: int) -> DenseKernel | None:
    """The kernel over the contiguous CPU tensors w (weights in the variant's layout) and b
    (bias or None), which it keeps referenced; None where the library is not available (and
    avx512 / tuning are not given). The AVX-512 build, where there is one, runs `wide_from`
    tokens and more (avx512 None)."""
    if avx512 is None and tuning is None:
        lib = try_load(variant)
        if lib is None:
            return None
        wide = _wide_lib(variant)
    else:
        lib, wide = load(variant, bool(avx512), tuning), None
    if wide is not None and wide_from <= 1:  # the AVX-512 build for every call
        lib, wide = wide, None
    w_ptr, b_ptr = w.data_ptr(), (None if b is None else b.data_ptr())
    libs = (lib,) * wide_from + ((wide or lib),)  # by min(T, wide_from)
    f32 = torch.float32

    def kernel(x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> out [T, O] float32 = x @ W.T + b (also x [..., K] -> [..., O])."""
        if x.dtype is not f32 or not x.is_contiguous() or not x.is_cpu:
            x = x.detach().to(device="cpu", dtype=f32).contiguous()
        shape = x.shape
        if not shape or shape[-1] != K:
            raise ValueError(f"dense kernel input must be [T, {K}], got {tuple(shape)}")
        T = x.numel() // K if K else math.prod(shape[:-1])
        out = x.new_empty(*shape[:-1], O)  # float32 on the CPU, as x is now
        if T and O:
            use = libs[min(T, wide_from)]
            nt = torch.get_num_threads()
            if use._pi_threads != nt:  # as many OpenMP threads as torch uses
                use.pi_set_num_threads(nt)
                use._pi_threads = nt
            use.pi_dense(x.data_ptr(), T, K, w_ptr, O, b_ptr, out.data_ptr())
        return out

    kernel.weight = w  # type: ignore[attr-defined]
    kernel.bias = b  # type: ignore[attr-defined]
    kernel.library = lib  # type: ignore[attr-defined]
    kernel.library_for = lambda T: libs[min(T, wide_from)]  # type: ignore[attr-defined]
    kernel.variant = lib.pi_dense_variant().decode()  # type: ignore[attr-defined]
    if wide is not None:
        kernel.variant += f" (avx512 for T >= {wide_from})"  # type: ignore[attr-defined]
    return kernel


def dequantize(q: torch.Tensor, fmt: str, cols: int, dot_layout: bool,
               out: torch.Tensor | None = None) -> torch.Tensor | None:
    """uint8 [rows, row_bytes] blocks of `fmt` (rows in the dot layout when `dot_layout`,
    else GGUF's) -> float32 [rows, cols] (into `out` when given: contiguous float32 of that
    shape), in C; None where the library is not available (the caller then runs
    quant.dequantize). Equal to quant.dequantize of the GGUF layout, bit for bit: what
    prefill's BLAS reads, made in one pass instead of torch's elementwise ops."""
    if reference_forced() or q.device.type != "cpu":
        return None
    lib = try_load(fmt)
    if lib is None:
        return None
    q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape[0], cols, dtype=torch.float32)
    elif out.shape != (q.shape[0], cols) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float32 {(q.shape[0], cols)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    _set_threads(lib)
    lib.pi_dequantize(q.data_ptr(), q.shape[0], cols, int(dot_layout), out.data_ptr())
    return out
