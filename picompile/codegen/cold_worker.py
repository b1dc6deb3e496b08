"""The cold-worker C library (picompile/kernels/cold_worker.c): a batch of FFN calls on a thread
of its own, each started once its inputs have landed in pinned memory and announced done through
a flag the device waits for, so the hybrid runtime's CPU half runs while the device runs the GPU
half. Built and cached like the decoder library
(c.load_package_library); the job struct it reads is mirrored here.
"""

from __future__ import annotations

import ctypes
import functools

from picompile.codegen import c

_vp, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
MAX_JOBS = 1024  # PI_MAX_JOBS: blocks in one batch


class Job(ctypes.Structure):
    """pi_cold_job: the arguments of the block's ffn() over its cold rows, its `ready` flag (the
    inputs landed) and its `done` flag (the output written)."""
    _fields_ = [("fn", _vp), ("w_gate", _vp), ("w_up", _vp), ("w_down_t", _vp),
                ("b_gate", _vp), ("b_up", _vp), ("b_down", _vp), ("n_ff", _i64), ("d", _i64),
                ("T", _i64), ("threshold", _f32), ("x", _vp), ("mask", _vp), ("out", _vp),
                ("ready", _vp), ("threads", _i32), ("done", _vp)]


# pi_cold_start's and pi_cold_wait's error codes (see kernels/cold_worker.c)
START_ERRORS = {-1: "a batch of cold jobs is still outstanding",
                -2: "the cold worker's thread could not be started",
                -5: f"a batch of cold jobs must hold 1 to {MAX_JOBS} jobs"}
WAIT_ERRORS = {-1: "the cold FFN kernel ran out of memory for its partial outputs",
               -3: "the device never copied the block's input to the host (timed out)",
               -4: "no cold job outstanding",
               -6: "the cold worker did not finish its batch (timed out; it hangs)"}


@functools.lru_cache(maxsize=1)  # once per process: the hybrid runtime calls it per block
def load() -> ctypes.CDLL:
    """The loaded library (built on first use). Raises CompilerNotFound, BuildFailed or LoadFailed."""
    return c.load_package_library("cold_worker.c", {
        "pi_cold_start": ([ctypes.POINTER(Job), _i32, _i32], ctypes.c_int),
        "pi_cold_wait": ([_vp], _i64),
        "pi_cold_last_seconds": ([_i32] + [ctypes.POINTER(ctypes.c_double)] * 2, None),
        "pi_wait_value": ([_vp, _i32], _i32),
        "pi_set_flag": ([_vp, _i32], None),
    })
