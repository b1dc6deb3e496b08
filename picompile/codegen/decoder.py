"""The decoder-step C library (picompile/kernels/decoder.c): a decode token (or a few: a token and
those drafted after it) through a whole pre-norm decoder stack (runtime/decoder.py's Family) per
call, glue (norms, RoPE, KV cache, attention) around picompile's dense and sparse FFN kernels,
which it calls through function pointers.

One library for all models and dtypes (the weight-bearing kernels carry the dtype), built from
the package's `kernels/decoder.c` by the compiler, flags and build cache of the other C kernels
(`picompile.codegen.c`), and loaded with ctypes. The C structs it reads are mirrored here.
"""

from __future__ import annotations

import ctypes

from picompile.codegen import c

_vp, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class Linear(ctypes.Structure):
    """pi_linear: y [out_features] = W x + b through pi_dense (kernels/dense.c)."""
    _fields_ = [("fn", _vp), ("w", _vp), ("b", _vp), ("out_features", _i64)]


class FFN(ctypes.Structure):
    """pi_ffn: the arguments of codegen/c.py's ffn() and, with a predictor, predict()."""
    _fields_ = [("fn", _vp), ("w_gate", _vp), ("w_up", _vp), ("w_down_t", _vp),
                ("b_gate", _vp), ("b_up", _vp), ("b_down", _vp), ("n_ff", _i64),
                ("threshold", _f32), ("predict", _vp), ("p1", _vp), ("pb1", _vp), ("p2t", _vp),
                ("pb2", _vp), ("rank", _i64), ("tau", _f32)]


class Layer(ctypes.Structure):
    """pi_layer: one decoder layer's weights (by pointer) and KV cache."""
    _fields_ = [("attn_norm", _vp), ("attn_norm_b", _vp), ("ffn_norm", _vp), ("ffn_norm_b", _vp),
                ("q_norm", _vp), ("k_norm", _vp), ("post_attn_norm", _vp), ("post_ffn_norm", _vp),
                ("rope_cos", _vp), ("rope_sin", _vp), ("window", _i64), ("q", Linear),
                ("k", Linear), ("v", Linear), ("o", Linear), ("ffn", FFN), ("k_cache", _vp),
                ("v_cache", _vp), ("qkv_fn", _vp)]


class Decoder(ctypes.Structure):
    """pi_decoder: the whole stack."""
    _fields_ = [("n_layers", _i64), ("d", _i64), ("n_heads", _i64), ("n_kv_heads", _i64),
                ("head_dim", _i64), ("max_len", _i64), ("vocab", _i64), ("layer_norm", _i64),
                ("parallel", _i64), ("qkv_per_head", _i64), ("rot_dim", _i64), ("kv_dtype", _i64), ("eps", _f32),
                ("scale", _f32), ("embed_scale", _f32),
                ("attn_softcap", _f32), ("logit_softcap", _f32), ("residual_scale", _f32),
                ("logit_divisor", _f32), ("pos_embed", _vp),
                ("layers", ctypes.POINTER(Layer)), ("final_norm", _vp), ("final_norm_b", _vp),
                ("lm_head", Linear), ("n_active", _vp), ("work", _vp), ("mask", _vp)]


def source() -> str:
    """The text of picompile/kernels/decoder.c (package data)."""
    return c.package_source("decoder.c")


def load() -> ctypes.CDLL:
    """The loaded decoder library (built on first use). Raises CompilerNotFound, BuildFailed or
    LoadFailed."""
    return c.load_package_library("decoder.c", {
        "pi_decoder_step": ([ctypes.POINTER(Decoder), _i64, _i64, _vp, _vp], ctypes.c_int),
        "pi_decoder_step_max": ([], ctypes.c_int),
        "pi_decoder_work_floats": ([ctypes.POINTER(Decoder)], _i64),
        "pi_decoder_set_num_threads": ([ctypes.c_int], None),
        "pi_decoder_kv_16bit": ([], ctypes.c_int),
        "pi_decoder_softmax_exp": ([_vp, _i64, _f32], _f32),
    })


def function_pointer(fn) -> int:
    """The address of a ctypes foreign function, for the structs' `fn` fields."""
    return ctypes.cast(fn, ctypes.c_void_p).value
