"""Switches read by several layers (codegen, runtime), kept here so that neither imports the
other for them (PyTorch Inductor's config.py is the model)."""

from __future__ import annotations

import os

# Set PICOMPILE_REFERENCE=1 to force the plain-PyTorch path everywhere (debugging, bisecting).
REFERENCE_ENV = "PICOMPILE_REFERENCE"

# Up to this many tokens per call (decode, small batches) the kernels run; above it (prefill),
# dense BLAS with a mask beats per-neuron kernels.
KERNEL_MAX_TOKENS = 8

# Weight formats whose dense kernel runs prefill too (any number of tokens: it reads the weights
# once per group of 8, from cache for layers that fit there): those where it beat BLAS over a
# 512-token prompt on the reference machine (BENCHMARKS.md, sessions 11 and 15). The 4-bit
# formats dot integers with x rounded to 8 bits, which BLAS over dequantized weights cannot;
# torch's CPU float16 GEMM has no fast path. float32, bfloat16 and q8_0 take BLAS (q8_0's 16-bit
# x makes its kernel 0.6-1.2x of BLAS there).
PREFILL_KERNEL_FORMATS = frozenset({"q4_0", "q4_1", "float16"})


def reference_forced() -> bool:
    return os.environ.get(REFERENCE_ENV, "") not in ("", "0")


# OpenMP threads for the hybrid runtime's cold part (runtime/hybrid.py, cold_threads); unset:
# half of torch's thread count.
COLD_THREADS_ENV = "PICOMPILE_COLD_THREADS"


def cold_threads_override() -> int | None:
    value = os.environ.get(COLD_THREADS_ENV, "")
    return int(value) if value.strip() else None


# Set PICOMPILE_DECODER=0 to run each decode step through the model's modules (the per-module
# path) instead of picompile's whole-step decoders (runtime/decoder.py, device_decoder.py): for
# comparing the two, or bisecting.
DECODER_ENV = "PICOMPILE_DECODER"


def decoder_enabled() -> bool:
    return os.environ.get(DECODER_ENV, "1").strip() not in ("0", "false", "no")


# A prompt's uncached part of at most this many tokens runs through the C decoder's own steps
# (kernels/decoder.c, up to 8 tokens a step) instead of the model's prefill (runtime/decoder.py,
# Decoder.prefills): below it the modules' fixed cost per call is the larger. Set
# PICOMPILE_STEP_PREFILL=0 (or another count) to compare.
STEP_PREFILL_ENV = "PICOMPILE_STEP_PREFILL"
STEP_PREFILL_MAX_TOKENS = 32


def step_prefill_max_tokens() -> int:
    value = os.environ.get(STEP_PREFILL_ENV, "").strip()
    return int(value) if value else STEP_PREFILL_MAX_TOKENS

# Set PICOMPILE_PROMPT_CACHE=0 to prefill every prompt from its first token instead of reusing
# the keys and values the decoder's KV cache holds for its leading tokens (runtime/decoder.py,
# Stack.cached_prefix): for comparing the two, or bisecting.
PROMPT_CACHE_ENV = "PICOMPILE_PROMPT_CACHE"


def prompt_cache_enabled() -> bool:
    return os.environ.get(PROMPT_CACHE_ENV, "1").strip() not in ("0", "false", "no")


# Beside the prompt its KV cache holds, the C decoder keeps copies of the keys and values of up
# to PROMPT_SNAPSHOTS earlier prompts (of PROMPT_SNAPSHOT_MIN_TOKENS or more, at most
# PROMPT_SNAPSHOT_BYTES in all, the oldest dropped first): a server's other conversations, or
# a chat UI's title request between two turns of one, then prefill only their new tokens too.
PROMPT_SNAPSHOTS = 3
PROMPT_SNAPSHOT_MIN_TOKENS = 32
PROMPT_SNAPSHOT_BYTES = 2**30


# Set PICOMPILE_CUDA_GRAPHS=0 to run the GPU decode step's segments eagerly instead of replaying
# them as CUDA graphs (runtime/device_decoder.py): for comparing the two, or debugging.
CUDA_GRAPHS_ENV = "PICOMPILE_CUDA_GRAPHS"


def cuda_graphs_enabled() -> bool:
    return os.environ.get(CUDA_GRAPHS_ENV, "1").strip() not in ("0", "false", "no")

# The device decoder's KV cache grows by whole steps of this many positions (each growth
# captures its CUDA graphs again); placement counts max_context rounded up to it.
KV_CACHE_STEP = 64
