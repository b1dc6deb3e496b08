"""C code generation for SparseFFN: one small shared library per block variant.

A variant (`Variant`: weight formats, gated / plain / dReLU, bias, activation) is baked into the
kernel source (picompile/kernels/ffn.c, package data, with kernels/qblocks.h spliced in) as
#defines in front of it, compiled once with the system C compiler (`$CC`, default `cc`)
through the build cache (`picompile.codegen.cache`), and loaded with ctypes. `kernel_for(ffn)`
binds a module's weights to that library and returns the callable `SparseFFN.forward` uses:

    kernel(x [T, d] float tensor, threshold: float, idx: Tensor | None = None)
        -> (out [T, d] float32, n_active: int)

The math is the contract in `picompile/runtime/sparse_ffn.py`. The kernel is the small-batch
(decode) path: one fused pass per neuron, each weight row read once for all T tokens; for ReLU
blocks the up and down rows of a neuron are only read when its gate fired for some token.

Weight formats: float32 / float16 / bfloat16 elements (DTYPES), or GGUF's q8_0 / q4_0 / q4_1
blocks (QFORMATS, picompile/quant.py): uint8 [n_ff, d / 32 * block bytes], each neuron's row its
blocks of 32 weights along d: q8_0 rows dequantized in registers (F16C for the scales, FMA into
float32 accumulators), 4-bit gate / up rows dotted in integers with x rounded to int8 blocks
(picompile/kernels/qblocks.h, spliced into the source; those rows in its dot layout,
quant.interleave_blocks: each run of 8 blocks interleaved, the row still contiguous). The gate
and up rows share one format (`Variant.dtype`, PIC_WDTYPE), the down rows may have their own
(`Variant.down_dtype`, PIC_DDTYPE: e.g. q4_1 gate / up with q8_0 down, as the 4-bit formats'
down rows are). The C code reaches every row through `row_bytes(F, d)` / `row_at`, and does its three per-row operations (dot with up to 8
tokens, axpy into the partial outputs, prefetch) through `row_dot` / `row_axpy` /
`row_prefetch`, which take the format F as a compile-time argument and pick the float or the
quantized code; `gu_dot` (gate / up rows) and `down_axpy` (down rows) are their instances for
the variant's two formats. AVX2 + FMA + F16C where the CPU has them, else portable scalar C
(same source, see `build_flags`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import pathlib
import platform
import re
import shlex
import shutil
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from picompile import quant
from picompile.codegen.cache import cached_build
from picompile.config import reference_forced

log = logging.getLogger(__name__)

DTYPES = ("float32", "float16", "bfloat16")
QFORMATS = tuple(quant.FORMATS)  # GGUF block formats: "q8_0", "q4_0", "q4_1" (picompile/quant.py)
ACTS = ("relu", "silu", "gelu", "gelu_tanh")
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_FORMAT_MACROS = {"float32": "PIC_F32", "float16": "PIC_F16", "bfloat16": "PIC_BF16",
                  "q8_0": "PIC_Q8_0", "q4_0": "PIC_Q4_0", "q4_1": "PIC_Q4_1"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

Kernel = Callable[..., "tuple[torch.Tensor, int]"]


@dataclass(frozen=True)
class Variant:
    """Everything about a block that changes the generated code."""

    dtype: str  # gate / up format: "float32" | "float16" | "bfloat16" | "q8_0" | "q4_0" | "q4_1"
    gated: bool  # down(act(gate x) * up x); False: down(act(up x))
    drelu: bool  # gated with relu on the up branch too (implies gated)
    bias: bool  # the block has bias vectors (any of b_gate, b_up, b_down)
    act: str  # "relu" | "silu" | "gelu" | "gelu_tanh"
    down_dtype: str | None = None  # w_down_t's format (same choices); None: dtype's

    def __post_init__(self):
        if self.down_dtype is None:  # normalized: Variant(f, ...) == Variant(f, ..., down_dtype=f)
            object.__setattr__(self, "down_dtype", self.dtype)
        for what, fmt in (("weight dtype", self.dtype), ("down weight dtype", self.down_dtype)):
            if fmt not in DTYPES + QFORMATS:
                raise ValueError(f"unsupported {what} {fmt!r} (C kernels take "
                                 f"{DTYPES + QFORMATS})")
        if self.act not in ACTS:
            raise ValueError(f"unsupported activation {self.act!r}")
        if self.drelu and not self.gated:
            raise ValueError("a dReLU block is gated")

    @classmethod
    def of(cls, ffn) -> Variant:
        """The variant of a SparseFFN module. Float blocks are read in w_up's dtype throughout
        (the kernel converts the others); quantized ones: gate / up in `qformat`, down in
        `down_qformat`, or w_down_t's own float dtype where that is None."""
        qformat = getattr(ffn, "qformat", None)
        dtype = qformat or _dtype_name(ffn.w_up.dtype)
        down = dtype
        if qformat is not None:
            down = getattr(ffn, "down_qformat", None) or _dtype_name(ffn.w_down_t.dtype)
        return cls(
            dtype=dtype,
            gated=ffn.w_gate is not None,
            drelu=bool(ffn.drelu),
            bias=any(getattr(ffn, b) is not None for b in ("b_gate", "b_up", "b_down")),
            act=ffn.act,
            down_dtype=down,
        )

    @property
    def quantized(self) -> bool:
        """The gate and up rows are GGUF blocks (uint8), not float elements."""
        return self.dtype in QFORMATS

    def row_bytes(self, d: int, fmt: str | None = None) -> int:
        """Bytes of one weight row of d weights in `fmt` (None: the gate / up format, a neuron's
        row of w_gate or w_up; `down_dtype` for one of w_down_t)."""
        fmt = fmt or self.dtype
        if fmt in QFORMATS:
            return quant.row_bytes(d, fmt)
        return d * _TORCH_DTYPES[fmt].itemsize

    @property
    def name(self) -> str:
        kind = "drelu" if self.drelu else "gated" if self.gated else "plain"
        down = f"_down_{self.down_dtype}" if self.down_dtype != self.dtype else ""
        return f"{kind}_{self.act}_{self.dtype}{down}{'_bias' if self.bias else ''}"


# (gate / up, down) format pairs besides the uniform ones that picompile makes: compile(gguf=)
# keeps a file's 4-bit gate and up blocks and re-quantizes down along d to q8_0
# (passes/quantize.py). Other pairs are built on first use.
MIXED_FORMATS = (("q4_0", "q8_0"), ("q4_1", "q8_0"))


def all_variants() -> list[Variant]:
    formats = [(f, f) for f in DTYPES + QFORMATS] + list(MIXED_FORMATS)
    return [
        Variant(dtype, gated, drelu, bias, act, down_dtype=down)
        for dtype, down in formats
        for gated, drelu in ((False, False), (True, False), (True, True))
        for bias in (False, True)
        for act in ACTS
    ]


# ---------------------------------------------------------------------------------------------
# C source
# ---------------------------------------------------------------------------------------------

_HEADER = """\
/* picompile sparse FFN kernel, generated by picompile/codegen/c.py.
 * Variant: {name}
 *
 * Exported:
 *   void ffn(const float* x,        [T, d] float32, row-major, contiguous
 *            int64_t T, int64_t d, int64_t n_ff,
 *            const void* w_gate,    [n_ff, d] one row per neuron (NULL for a plain block)
 *            const void* w_up,      [n_ff, d]                      gate and up: PIC_WDTYPE
 *            const void* w_down_t,  [n_ff, d] (down projection weight, transposed): PIC_DDTYPE
 *                                   float formats: [n_ff, d] elements; quantized (q8_0, q4_0,
 *                                   q4_1): uint8 [n_ff, row_bytes(F, d)], each row its d / 32
 *                                   GGUF blocks (d a multiple of 32, which the caller checks);
 *                                   4-bit gate / up rows in qblocks.h's dot layout
 *            const float* b_gate,   [n_ff] or NULL
 *            const float* b_up,     [n_ff] or NULL
 *            const float* b_down,   [d] or NULL
 *            const int32_t* idx,    [m] candidate neurons, or NULL = all n_ff neurons
 *            int64_t m,
 *            const uint8_t* mask,   [T, n_ff] 0/1, or NULL; with idx NULL the candidates are
 *                                   the neurons set for any token (a predictor's output)
 *            float threshold,
 *            float* out,            [T, d] float32, written fully
 *            int64_t* n_active);    out: number of active (token, neuron) pairs; -1 = no memory
 *   int predict(const float* x,     [T, d] float32: the block input
 *               int64_t T, int64_t d, int64_t r, int64_t n_ff,
 *               const etype* p1,    [r, d]      the predictor's layers (etype: this library's
 *               const float* pb1,   [r]          gate / up dtype, float16 where those are
 *               const etype* p2t,   [r, n_ff]   quantized; picompile uses float16) p2t: the
 *                                               second layer's weight, transposed
 *               const float* pb2,   [n_ff]
 *               float tau,
 *               uint8_t* mask);     out [T, n_ff]: 1 where p2t^T relu(p1 x + pb1) + pb2 > tau
 *                                   returns 0, or -1 when out of memory
 *   void pic_set_num_threads(int n);  OpenMP threads for ffn (<= 0: the OpenMP default)
 *   const char* pic_variant(void);
 */
#define PIC_F32 0
#define PIC_F16 1
#define PIC_BF16 2
#define PIC_Q8_0 3   /* GGUF blocks of 32 weights: f16 d, int8 q[32]          w = d * q */
#define PIC_Q4_0 4   /*                            f16 d, uint8 qs[16]        w = d * (nibble - 8) */
#define PIC_Q4_1 5   /*                            f16 d, f16 m, uint8 qs[16] w = d * nibble + m */
#define PIC_RELU 0
#define PIC_SILU 1
#define PIC_GELU 2
#define PIC_GELU_TANH 3

#define PIC_WDTYPE {wdtype}   /* gate and up rows: {dtype} */
#define PIC_DDTYPE {ddtype}   /* down rows: {down_dtype} */
#define PIC_GATED {gated}     /* 1: h = act(gate x + b_gate) * (up x + b_up); 0: h = act(up x + b_up) */
#define PIC_DRELU {drelu}     /* 1: relu on the up branch too */
#define PIC_BIAS {bias}       /* 1: bias pointers may be non-NULL */
#define PIC_ACT {act_macro}   /* {act} */
/* 1: h is known after the first phase (plain blocks; gated blocks whose activation is nonzero
 * almost everywhere, SiLU / GELU: their up rows are needed anyway, and reading the block's gate
 * rows and then its up rows keeps both streams sequential), so the second phase reads only the
 * down rows of the active neurons. 0 (gated ReLU / dReLU): up rows only where the gate fired. */
#define PIC_H_FIRST (!PIC_GATED || PIC_ACT != PIC_RELU)
#define PIC_VARIANT "{name}"
"""



def source(v: Variant, tuning: dict[str, int] | None = None) -> str:
    """The generated C source of one variant (the variant baked in as #defines at the top).
    `tuning` overrides knobs such as PIC_PF_ROWS, PIC_DOWN_ROWS or PIC_BLOCK (for benchmarking:
    benchmarks/ffn_rows.py)."""
    extra = "".join(f"#define {k} {int(val)}\n" for k, val in (tuning or {}).items())
    return _HEADER.format(
        name=v.name,
        wdtype=_FORMAT_MACROS[v.dtype],
        dtype=v.dtype,
        ddtype=_FORMAT_MACROS[v.down_dtype],
        down_dtype=v.down_dtype,
        gated=int(v.gated),
        drelu=int(v.drelu),
        bias=int(v.bias),
        act_macro={"relu": "PIC_RELU", "silu": "PIC_SILU", "gelu": "PIC_GELU",
                   "gelu_tanh": "PIC_GELU_TANH"}[v.act],
        act=v.act,
    ) + extra + package_source("ffn.c")


# ---------------------------------------------------------------------------------------------
# Build and load
# ---------------------------------------------------------------------------------------------


class CompilerNotFound(RuntimeError):
    """No usable C compiler. `label`: the cause, short (for "reference (<label>)")."""

    def __init__(self, message: str, label: str = "no C compiler found: set $CC"):
        super().__init__(message)
        self.label = label


class BuildFailed(RuntimeError):
    """The C compiler ran and failed. str(): the command and the compiler's whole stderr;
    `summary`: its first error line."""

    def __init__(self, message: str, summary: str):
        super().__init__(message)
        self.summary = summary


class LoadFailed(RuntimeError):
    """The library was built (and matched its checksum) but does not load or lacks a symbol."""


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _first_error(stderr: str, build_dir: pathlib.Path) -> str | None:
    """The line of a compiler's stderr that says what went wrong (temporary paths removed):
    the first one naming an error, else the first that is not context ("In function 'f':",
    "collect2: ..."), else the first."""
    text = stderr.replace(str(build_dir) + os.sep, "")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    context = [ln for ln in lines if ln.endswith(":") or ln.startswith("collect2:")]
    rest = [ln for ln in lines if ln not in context]
    for ln in rest:
        if "error" in ln.lower():
            return _one_line(ln)
    return _one_line((rest or lines)[0]) if lines else None


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The x86 feature flags of this CPU (empty when /proc/cpuinfo has none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def build_flags() -> list[str]:
    flags = ["-O3", "-fopenmp", "-shared", "-fPIC"]
    if platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma", "f16c"} <= cpu_flags():
        flags += ["-mavx2", "-mfma", "-mf16c"]
    return flags


def compiler() -> list[str]:
    """The C compiler command ($CC or cc), as argv. Raises CompilerNotFound."""
    env_cc = os.environ.get("CC", "").strip()
    cc = env_cc or "cc"
    try:
        argv = shlex.split(cc)
    except ValueError as e:
        raise CompilerNotFound(f"no C compiler found ($CC={cc!r} does not parse: {e})") from e
    exe = shutil.which(argv[0]) if argv else None
    if exe is None:
        where = (f"$CC={cc} is not an executable" if env_cc
                 else "$CC is unset and `cc` is not on PATH")
        raise CompilerNotFound(f"no C compiler found ({where})")
    return [exe, *argv[1:]]


@functools.lru_cache(maxsize=8)
def _compiler_identity(argv: tuple[str, ...]) -> str:
    try:
        r = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=30)
        first = (r.stdout or r.stderr).splitlines()
        return f"{' '.join(argv)} | {first[0] if first else '?'} | {platform.machine()}"
    except (OSError, subprocess.SubprocessError) as e:
        raise CompilerNotFound(f"the C compiler {' '.join(argv)} does not run ({e})",
                               label="C compiler does not run: set $CC") from e


def build_with(cc: list[str], flags: list[str]) -> Callable[[pathlib.Path, pathlib.Path], None]:
    """The `build(src, out)` that cached_build calls: `cc flags -o out src -lm`, failures raised
    as BuildFailed with the compiler's first error line as the summary (shared with dense.py)."""
    def build(src: pathlib.Path, out: pathlib.Path) -> None:
        cmd = [*cc, *flags, "-o", str(out), str(src), "-lm"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired as e:
            raise BuildFailed(f"C compiler timed out ({shlex.join(cmd)})",
                              summary=f"{os.path.basename(cc[0])} timed out after 300 s") from e
        except OSError as e:
            raise BuildFailed(f"C compiler does not run ({shlex.join(cmd)}): {e}",
                              summary=_one_line(f"{os.path.basename(cc[0])}: {e}")) from e
        if r.returncode != 0:
            summary = (_first_error(r.stderr or "", src.parent)
                       or _first_error(r.stdout or "", src.parent))
            raise BuildFailed(
                f"C compiler failed ({shlex.join(cmd)}):\n{(r.stderr or r.stdout).strip()}",
                summary=summary or f"{os.path.basename(cc[0])} exited with status {r.returncode}",
            )

    return build


def package_source(name: str) -> str:
    """The text of picompile/kernels/<name> (package data), its `#include "<header>.h"` lines of
    kernels headers replaced by their text (splice_headers)."""
    import importlib.resources

    return splice_headers(importlib.resources.files("picompile").joinpath("kernels", name).read_text())


def splice_headers(text: str) -> str:
    """`text` with each line `#include "<name>.h"` replaced by picompile/kernels/<name>.h: a
    generated source is one self-contained file, so the build cache's key (a hash of it) covers
    the headers it uses."""
    return re.sub(r'^#include "(\w+\.h)"$', lambda m: package_source(m.group(1)), text,
                  flags=re.MULTILINE)


def load_package_library(name: str, symbols: dict[str, tuple[list, object]]) -> ctypes.CDLL:
    """picompile/kernels/<name> built with the kernels' compiler and flags (cached), loaded, and
    each of `symbols` ({function: (argtypes, restype)}) declared. Raises CompilerNotFound,
    BuildFailed or LoadFailed."""
    return _load_package_library(name, tuple(compiler()), tuple(build_flags()),
                                 tuple((k, tuple(a), r) for k, (a, r) in symbols.items()))


@functools.lru_cache(maxsize=16)
def _load_package_library(name, cc, flags, symbols) -> ctypes.CDLL:
    tag = f"picompile-{name} " + _compiler_identity(cc)
    path = cached_build(package_source(name), suffix=".so", flags=list(flags),
                        build=build_with(list(cc), list(flags)), tag=tag)
    try:
        lib = ctypes.CDLL(str(path))
        for fn, argtypes, restype in symbols:
            getattr(lib, fn).argtypes, getattr(lib, fn).restype = list(argtypes), restype
    except (OSError, AttributeError) as e:
        raise LoadFailed(f"{path}: {e}") from e
    return lib


def build(v: Variant) -> pathlib.Path:
    """Compile (or fetch from the cache) the shared library of a variant; its path."""
    cc = compiler()
    tag = "picompile-c " + _compiler_identity(tuple(cc))
    flags = build_flags()
    return cached_build(source(v), suffix=".so", flags=flags, build=build_with(cc, flags), tag=tag)


_c_int64, _vp = ctypes.c_int64, ctypes.c_void_p
_FFN_ARGTYPES = [
    _vp, _c_int64, _c_int64, _c_int64,  # x, T, d, n_ff
    _vp, _vp, _vp,  # w_gate, w_up, w_down_t
    _vp, _vp, _vp,  # b_gate, b_up, b_down
    _vp, _c_int64, _vp, ctypes.c_float,  # idx, m, mask, threshold
    _vp, ctypes.POINTER(_c_int64),  # out, n_active
]

_PREDICT_ARGTYPES = [
    _vp, _c_int64, _c_int64, _c_int64, _c_int64,  # x, T, d, r, n_ff
    _vp, _vp, _vp, _vp, ctypes.c_float, _vp,  # p1, pb1, p2t, pb2, tau, mask
]

_libs: dict[tuple, ctypes.CDLL] = {}
_libs_lock = threading.Lock()
_warned = False  # the one fallback warning of this process was given
_warn_lock = threading.Lock()
# Variant -> why its kernel is not available ("no C compiler found: set $CC", ...), from the last
# failed try_load; removed when a later one succeeds.
_failures: dict[Variant, str] = {}

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_SILENCE = "set PICOMPILE_REFERENCE=1 to run the reference path without this warning"


def _user_stacklevel() -> int:
    """The stacklevel, for warnings.warn called from the caller of this function, of the first
    frame outside picompile: the warning then names the user's line (compile(...), ...)."""
    frame, level = sys._getframe(1), 1  # the caller, which calls warnings.warn: stacklevel 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(
            _PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


def _warn_once(msg: str) -> None:
    """One RuntimeWarning per process, on one line (later ones go to the debug log only)."""
    global _warned
    msg = " ".join(msg.split())
    with _warn_lock:
        first, _warned = not _warned, True
    if not first:
        log.debug("%s", msg)
        return
    warnings.warn(msg, RuntimeWarning, stacklevel=_user_stacklevel())


def load(v: Variant) -> ctypes.CDLL:
    """The loaded library of a variant (built on first use). Raises on any failure."""
    cc = compiler()
    key = (v, tuple(cc), tuple(build_flags()))
    with _libs_lock:
        lib = _libs.get(key)
        if lib is None:
            path = build(v)  # verified against its checksum record: never a truncated file
            try:
                lib = ctypes.CDLL(str(path))
                for symbol in ("ffn", "predict", "pic_set_num_threads", "pic_variant"):
                    getattr(lib, symbol)
            except (OSError, AttributeError) as e:
                raise LoadFailed(f"{path}: {e}") from e
            lib.ffn.argtypes = _FFN_ARGTYPES
            lib.ffn.restype = None
            lib.predict.argtypes = _PREDICT_ARGTYPES
            lib.predict.restype = ctypes.c_int
            lib.pic_set_num_threads.argtypes = [ctypes.c_int]
            lib.pic_set_num_threads.restype = None
            lib.pic_variant.restype = ctypes.c_char_p
            lib._pic_threads = None  # last value given to pic_set_num_threads
            _libs[key] = lib
    return lib


def try_load(v: Variant) -> ctypes.CDLL | None:
    """load(v), or None when there is no compiler or the build or the load fails: the cause is
    kept for why_no_kernel, and one warning per process (the first failure) names it and the fix."""
    try:
        lib = load(v)
    except CompilerNotFound as e:
        _failures[v] = e.label
        _warn_once(
            f"picompile: {e}: the sparse FFN blocks run the slower PyTorch reference path. "
            "Fix: install gcc or clang (e.g. `apt-get install gcc`) or set $CC to a C compiler; "
            f"{_SILENCE}."
        )
    except BuildFailed as e:
        _failures[v] = f"C build failed: {e.summary}"
        _warn_once(
            f"picompile: building the C FFN kernel ({v.name}) failed: {e.summary} (full error in "
            "the debug log): the sparse FFN blocks run the slower PyTorch reference path. Fix: "
            f"check the C compiler ($CC) and OpenMP (libgomp); {_SILENCE}."
        )
        log.debug("C kernel build failed: %s", e)
    except LoadFailed as e:
        _failures[v] = f"C kernel failed to load: {_one_line(str(e))}"
        _warn_once(
            f"picompile: loading the C FFN kernel ({v.name}) failed: {_one_line(str(e))}: the "
            "sparse FFN blocks run the slower PyTorch reference path. Fix: check OpenMP "
            f"(libgomp) and the C compiler ($CC); {_SILENCE}."
        )
        log.debug("C kernel load failed", exc_info=True)
    except Exception as e:  # noqa: BLE001 - a failed build must never break the model
        lines = str(e).strip().splitlines()
        cause = _one_line(lines[0]) if lines else type(e).__name__
        _failures[v] = f"C build failed: {cause}"
        _warn_once(
            f"picompile: building the C FFN kernel ({v.name}) failed: {cause} (full error in the "
            "debug log): the sparse FFN blocks run the slower PyTorch reference path. Fix: check "
            f"the C compiler ($CC) and the build cache ($PICOMPILE_CACHE_DIR); {_SILENCE}."
        )
        log.debug("C kernel build failed", exc_info=True)
    else:
        _failures.pop(v, None)
        return lib
    return None


def why_no_kernel(block) -> str:
    """The execution-path label of a block (a SparseFFN, or a Variant) that kernel_for gave no C
    kernel: "reference (<cause>)", e.g. "reference (no C compiler found: set $CC)",
    "reference (C build failed: <the compiler's first error line>)",
    "reference (PICOMPILE_REFERENCE set)"."""
    if reference_forced():
        return "reference (PICOMPILE_REFERENCE set)"
    if isinstance(block, Variant):
        v = block
    else:
        try:
            v = Variant.of(block)
        except ValueError as e:
            return f"reference (no C kernel: {e})"
        tensors = [block.w_gate, block.w_up, block.w_down_t, block.b_gate, block.b_up, block.b_down]
        if any(t is not None and t.device.type != "cpu" for t in tensors):
            return "reference (weights not on the CPU)"
    reason = _failures.get(v)
    return f"reference ({reason})" if reason else "reference (C kernel not selected)"


def compile_all_variants(max_workers: int | None = None, formats=None) -> dict[Variant, pathlib.Path]:
    """Build every variant (whose gate / up format is in `formats`, if given) into the cache, in
    parallel; returns their library paths."""
    from concurrent.futures import ThreadPoolExecutor

    vs = [v for v in all_variants() if formats is None or v.dtype in formats]
    with ThreadPoolExecutor(max_workers or os.cpu_count() or 2) as pool:
        return dict(zip(vs, pool.map(build, vs)))


def _set_threads(lib: ctypes.CDLL) -> None:
    """The kernels use as many OpenMP threads as torch does."""
    nt = torch.get_num_threads()
    if lib._pic_threads != nt:
        lib.pic_set_num_threads(nt)
        lib._pic_threads = nt


_NO_CANDIDATES = torch.zeros(1, dtype=torch.int32)  # a non-NULL idx, used with m = 0


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def kernel_for(ffn) -> Kernel | None:
    """A C kernel bound to `ffn`'s weights, or None (reference forced, no compiler, failed build,
    weights not on the CPU, or a dtype / activation the C kernels do not cover: why_no_kernel(ffn)
    then gives the path's label, naming which)."""
    if reference_forced():
        return None
    try:
        v = Variant.of(ffn)
    except ValueError as e:
        log.debug("no C kernel for %s: %s", ffn, e)
        return None
    tensors = [ffn.w_gate, ffn.w_up, ffn.w_down_t, ffn.b_gate, ffn.b_up, ffn.b_down]
    if any(t is not None and t.device.type != "cpu" for t in tensors):
        return None
    lib = try_load(v)
    if lib is None:
        return None
    return _bind(lib, v, ffn)


def _bind(lib: ctypes.CDLL, v: Variant, ffn) -> Kernel:
    def weight(t, fmt):
        """t as the C code reads it: uint8 row blocks as they are, float elements converted."""
        if t is None:
            return None
        if fmt in QFORMATS:
            if t.dtype != torch.uint8:
                raise ValueError(f"{fmt} weights are uint8 row blocks, got {t.dtype}")
            return t.detach().contiguous()
        return t.detach().to(_TORCH_DTYPES[fmt]).contiguous()

    # Kept referenced by the closure: the C code reads them through raw pointers.
    w_gate, w_up = weight(ffn.w_gate, v.dtype), weight(ffn.w_up, v.dtype)
    w_down_t = weight(ffn.w_down_t, v.down_dtype)
    n_ff = w_up.shape[0]
    d = ffn.d_model if v.quantized else w_up.shape[1]
    if (v.dtype in QFORMATS or v.down_dtype in QFORMATS) and d % quant.BLOCK:
        raise ValueError(f"a {v.name} block needs d a multiple of {quant.BLOCK}, got {d}")

    def shape(t, fmt):  # [n_ff, d] in fmt's elements
        return (n_ff, v.row_bytes(d, fmt) // t.element_size())

    want = shape(w_up, v.dtype)
    if (w_up.shape != want or w_down_t.shape != shape(w_down_t, v.down_dtype)
            or (w_gate is not None and w_gate.shape != want)):
        raise ValueError(f"weight shapes disagree (d={d}, n_ff={n_ff}, {v.dtype} gate / up, "
                         f"{v.down_dtype} down): up {tuple(w_up.shape)}, down_t "
                         f"{tuple(w_down_t.shape)}, gate {None if w_gate is None else tuple(w_gate.shape)}")
    raw_biases = (ffn.b_gate, ffn.b_up, ffn.b_down)
    converted: dict = {}  # "biases": their float32 copies, made on first use
    ptrs = (_ptr(w_gate), _ptr(w_up), _ptr(w_down_t))
    fn = lib.ffn

    def float32_biases() -> tuple:
        biases = converted.get("biases")
        if biases is None:  # a racing first call just converts twice; one result is kept
            biases = converted.setdefault("biases", tuple(
                None if b is None else b.detach().to(torch.float32).contiguous() for b in raw_biases
            ))
        return biases

    def kernel(x: torch.Tensor, threshold: float = 0.0, idx: torch.Tensor | None = None,
               mask: torch.Tensor | None = None):
        """x [T, d] -> (out [T, d] float32, n_active: active (token, neuron) pairs).
        Candidates: idx [m] (neuron numbers), else mask [T, n_ff] bool (those set for any
        token), else all neurons."""
        biases = float32_biases()
        if x.dim() != 2 or x.shape[1] != d:
            raise ValueError(f"kernel input must be [T, {d}], got {tuple(x.shape)}")
        x = x.detach().to(device="cpu", dtype=torch.float32).contiguous()
        T = x.shape[0]
        out = torch.empty((T, d), dtype=torch.float32)
        if idx is not None:
            idx = idx.detach().reshape(-1)
            m = idx.numel()
            if m and (int(idx.min()) < 0 or int(idx.max()) >= n_ff):
                raise IndexError(f"candidate neuron index out of range [0, {n_ff})")
            idx = idx.to(device="cpu", dtype=torch.int32).contiguous()
            if m == 0:  # an empty tensor's data_ptr() may be NULL, which means "all neurons"
                idx = _NO_CANDIDATES
        else:
            m = n_ff
            if mask is not None:
                if mask.shape != (x.shape[0], n_ff) or mask.dtype != torch.bool:
                    raise ValueError(f"mask must be bool [{x.shape[0]}, {n_ff}], got "
                                     f"{mask.dtype} {tuple(mask.shape)}")
                mask = mask.to("cpu").contiguous()
        _set_threads(lib)
        n_active = ctypes.c_int64(0)
        fn(
            x.data_ptr(), T, d, n_ff, *ptrs, *(_ptr(b) for b in biases),
            _ptr(idx), m, _ptr(mask), float(threshold), out.data_ptr(), ctypes.byref(n_active),
        )
        if n_active.value < 0:
            raise MemoryError("C FFN kernel: out of memory for the partial outputs")
        return out, int(n_active.value)

    kernel.variant = v  # type: ignore[attr-defined]
    kernel.library = lib  # type: ignore[attr-defined]
    # Kept referenced by the kernel: the C code reads them through `ptrs` (a kernel outliving
    # its module must not read freed memory).
    kernel.weights = (w_gate, w_up, w_down_t)  # type: ignore[attr-defined]
    # The weight and bias pointers ffn() takes (w_gate, w_up, w_down_t, b_gate, b_up, b_down; None
    # for NULL), valid while the kernel lives: for callers from C (runtime/decoder.py).
    kernel.pointers = lambda: (*ptrs, *(_ptr(b) for b in float32_biases()))  # type: ignore[attr-defined]
    return kernel


# The predictor's matrices hold float16 values (Predictor keeps them so), read as float16: every
# variant library has `predict` for its weight dtype; any float16 one serves.
_PREDICTOR_VARIANT = Variant("float16", gated=False, drelu=False, bias=False, act="relu")


def predictor_kernel_for(pred) -> Callable[[torch.Tensor, float], torch.Tensor] | None:
    """A C kernel for a `passes.predictors.Predictor`, or None (as kernel_for):

        kernel(x [T, d] float tensor, tau) -> mask [T, n_ff] bool
    """
    if reference_forced():
        return None
    params = (pred.p1, pred.pb1, pred.p2, pred.pb2)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in params):
        return None
    lib = try_load(_PREDICTOR_VARIANT)
    if lib is None:
        return None
    # Kept referenced by the closure: the C code reads them through raw pointers.
    p1, p2t = (t.detach().to(torch.float16).contiguous() for t in (pred.p1, pred.p2.T))
    pb1, pb2 = (t.detach().contiguous() for t in (pred.pb1, pred.pb2))
    r, d = p1.shape
    n_ff = p2t.shape[1]
    fn = lib.predict

    def kernel(x: torch.Tensor, tau: float) -> torch.Tensor:
        """x [T, d] -> mask [T, n_ff] bool: the neurons predicted to fire, per token."""
        if x.dim() != 2 or x.shape[1] != d:
            raise ValueError(f"predictor input must be [T, {d}], got {tuple(x.shape)}")
        x = x.detach().to(device="cpu", dtype=torch.float32).contiguous()
        mask = torch.empty((x.shape[0], n_ff), dtype=torch.bool)
        _set_threads(lib)
        if fn(x.data_ptr(), x.shape[0], d, r, n_ff, p1.data_ptr(), pb1.data_ptr(), p2t.data_ptr(),
              pb2.data_ptr(), float(tau), mask.data_ptr()) != 0:
            raise MemoryError("C predictor kernel: out of memory")
        return mask

    kernel.library = lib  # type: ignore[attr-defined]
    # predict()'s matrix pointers (p1, pb1, p2t, pb2) and rank, for callers from C
    kernel.pointers = (p1.data_ptr(), pb1.data_ptr(), p2t.data_ptr(), pb2.data_ptr())  # type: ignore[attr-defined]
    kernel.rank = r  # type: ignore[attr-defined]
    return kernel
