"""The cold-worker C library (picompile/kernels/cold_worker.c): one FFN call on a thread of its
own, started once the inputs have landed in pinned memory, so the hybrid runtime's CPU half runs
while the calling thread launches the GPU half. Built and cached like the decoder library
(c.load_package_library); the job struct it reads is mirrored here.
"""

from __future__ import annotations

import ctypes
import functools

from picompile.codegen import c

_vp, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class Job(ctypes.Structure):
    """pi_cold_job: the arguments of the block's ffn() over its cold rows, and the `ready` flag."""
    _fields_ = [("fn", _vp), ("w_gate", _vp), ("w_up", _vp), ("w_down_t", _vp),
                ("b_gate", _vp), ("b_up", _vp), ("b_down", _vp), ("n_ff", _i64), ("d", _i64),
                ("T", _i64), ("threshold", _f32), ("x", _vp), ("mask", _vp), ("out", _vp),
                ("ready", _vp), ("threads", _i32)]


# pi_cold_wait's error codes (see kernels/cold_worker.c)
ERRORS = {-1: "the cold FFN kernel ran out of memory for its partial outputs",
          -3: "the device never copied the block's input to the host (timed out)",
          -4: "no cold job outstanding"}


@functools.lru_cache(maxsize=1)  # once per process: the hybrid runtime calls it per block
def load() -> ctypes.CDLL:
    """The loaded library (built on first use). Raises CompilerNotFound, BuildFailed or LoadFailed."""
    return c.load_package_library("cold_worker.c", {
        "pi_cold_start": ([ctypes.POINTER(Job)], ctypes.c_int),
        "pi_cold_wait": ([], _i64),
        "pi_cold_last_seconds": ([ctypes.POINTER(ctypes.c_double)] * 2, None),
    })
