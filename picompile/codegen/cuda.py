"""CUDA kernels for the hot (GPU-resident) rows of an activation-sparse FFN block.

The math is the contract of `picompile.runtime.sparse_ffn` (see its docstring and `ffn_reference`),
restricted to the hot rows: neurons are permuted hot-first, so rows 0..n_hot-1 of w_gate, w_up,
w_down_t and of the predictor's p2 live on the GPU. Per call (T <= 8 tokens) the pipeline is:

  1. predictor   z = relu(p1 x + pb1)            p1 [r, d], r <= 1024          pi_pred_hidden_*
                 logits = p2 z + pb2, fire iff logit > tau (any token)       pi_pred_mask_*
                 -> a bitmask, one uint32 word per 32 hot neurons
  2. compaction  bitmask -> dense ascending int32 index list + count         pi_compact
                 (one block, ballot/popc + block prefix sum: deterministic order)
  3. gate / up   one warp per listed row, 16-byte loads, fp32 accumulation,  pi_gate_up_*
                 the activation fused, the ReLU zero-gate skip (the up row is then never read),
                 the |h| > threshold test; h [T, cap] fp32
  4. down        out[t] = sum_i h[t, i] * w_down_t[idx[i]] (+ b_down)        pi_down_*
                 race-free: each block owns a slice of d and a contiguous range of the list; with
                 more than one range per slice, per-range partials are summed by
                 pi_down_reduce_* in a fixed order (deterministic, no atomics on out).

Small batches (T = 2..8) use the union of the per-token predictions: a row is listed when any
token fires, it is loaded once for all T tokens, and h is computed for every token on it (the
ReLU / threshold test then zeroes the per-token inactive ones, exactly as `ffn_reference` with
that index list does). T = 1 has its own kernels (`*_1_*`, the token loops compile away).

Every variant (`CudaVariant`) is its own generated source: shared templates (number formats,
loads, warp sums, the kernel bodies) in a guarded prelude, then per dtype the predictor and down
kernels, then per variant a struct with the variant baked in as constants plus its activation, and
the gate/up kernels instantiated on it. Kernel names carry the dtype or the variant tag, and the
shared parts are include-guarded, so any set of variants also concatenates into one translation
unit (`combined_source`, what the CI compile test builds in one nvcc call per arch).

No headers are included: float16 / bfloat16 are read as raw 16-bit words and widened with one PTX
`cvt` (f16) or a shift (bf16), so the same source builds with nvcc and with NVRTC (cupy).

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
import string
import subprocess
from dataclasses import dataclass
from pathlib import Path

from picompile.config import KERNEL_MAX_TOKENS

DTYPES = ("float16", "bfloat16", "float32")
ACTS = ("relu", "silu", "gelu", "gelu_tanh")
ARCHS = ("sm_80", "sm_90")

MAX_TOKENS = KERNEL_MAX_TOKENS  # the small-batch kernels are built for this many tokens
MAX_SMEM_BYTES = 48 * 1024  # the predictor keeps z [T, r] fp32 in (default-size) shared memory

# nvcc flags (fast math left out on purpose: see the module docstring).
NVCC_FLAGS = ["-O3", "-std=c++17", "-x", "cu"]
BACKEND_ENV = "PICOMPILE_CUDA_BACKEND"  # "nvrtc" (default) | "nvcc"
NVCC_ENV = "PICOMPILE_NVCC"  # path to nvcc, else $PATH, $CUDA_HOME/bin, /usr/local/cuda/bin

# Per dtype: the prelude's number-format struct, the C element type, the tag, elements per 16 B.
_FORMATS = {
    "float32": ("PiF32", "float", "f32", 4),
    "float16": ("PiF16", "pi_u16", "f16", 8),
    "bfloat16": ("PiBF16", "pi_u16", "bf16", 8),
}

# Block sizes; the kernels' __launch_bounds__ below use the same numbers.
_WARPS_PER_BLOCK = 8  # pred_hidden, pred_mask, gate_up: 256 threads
_DOWN_THREADS = 128
_REDUCE_THREADS = 256
_COMPACT_THREADS = 1024
_MAX_SPLIT = 64  # down: at most this many row ranges (partials) per column slice


class CudaUnavailable(RuntimeError):
    """cupy or a CUDA device is missing where a GPU path was asked for."""


class NvccError(RuntimeError):
    """nvcc is missing or failed; the message carries its stderr."""


# ------------------------------------------------------------------------------------------------
# Variants
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CudaVariant:
    """What is baked into one generated source."""

    dtype: str = "float16"  # weights, biases, x and predictor weights: "float16" | "bfloat16" | "float32"
    gated: bool = True  # h = act(gate) * up   (else plain: h = act(up))
    drelu: bool = False  # gated with u = relu(up) (TurboSparse dReLU); needs gated
    bias: bool = False  # b_gate / b_up are added (b_down is optional at run time in every variant)
    act: str = "silu"  # one of ACTS
    threshold: bool = False  # a |h| > threshold test is compiled in (else exact: h != 0)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, not {self.dtype!r}")
        if self.act not in ACTS:
            raise ValueError(f"act must be one of {ACTS}, not {self.act!r}")
        if self.drelu and not self.gated:
            raise ValueError("drelu blocks are gated: CudaVariant(drelu=True) needs gated=True")

    @property
    def kind(self) -> str:
        return "drelu" if self.drelu else "gated" if self.gated else "plain"

    @property
    def dtag(self) -> str:
        return _FORMATS[self.dtype][2]

    @property
    def tag(self) -> str:
        """A C identifier naming the variant, e.g. "f16_gated_silu_nobias_exact"."""
        return "_".join(
            (self.dtag, self.kind, self.act, "bias" if self.bias else "nobias",
             "thr" if self.threshold else "exact")
        )

    @property
    def vec(self) -> int:
        """Elements per 16-byte load."""
        return _FORMATS[self.dtype][3]

    def kernel_names(self) -> dict[str, str]:
        """Role -> extern "C" kernel name in `source(self)`."""
        dt = self.dtag
        return {
            "pred_hidden_1": f"pi_pred_hidden_1_{dt}",
            "pred_hidden_b": f"pi_pred_hidden_b_{dt}",
            "pred_mask_1": f"pi_pred_mask_1_{dt}",
            "pred_mask_b": f"pi_pred_mask_b_{dt}",
            "compact": "pi_compact",
            "mask_bits": "pi_mask_bits",
            "gate_up_1": f"pi_gate_up_1_{self.tag}",
            "gate_up_b": f"pi_gate_up_b_{self.tag}",
            "down_1": f"pi_down_1_{dt}",
            "down_b": f"pi_down_b_{dt}",
            "down_reduce": f"pi_down_reduce_{dt}",
        }

    @classmethod
    def for_block(cls, block) -> CudaVariant:
        """The variant of a `picompile.plan.BlockPlan`."""
        return cls(
            dtype=block.dtype, gated=block.kind in ("gated", "drelu"), drelu=block.kind == "drelu",
            bias=bool(block.bias), act=block.act, threshold=float(block.decided.threshold) != 0.0,
        )


def all_variants() -> list[CudaVariant]:
    """Every variant the compiler can ask for: dtype x kind x act x bias x threshold, where dReLU
    blocks come with act="relu" only (relu(gate) * relu(up); `source` still accepts any act)."""
    out = []
    for dtype in DTYPES:
        for gated, drelu, acts in ((False, False, ACTS), (True, False, ACTS), (True, True, ("relu",))):
            for act in acts:
                for bias in (False, True):
                    for threshold in (False, True):
                        out.append(CudaVariant(dtype, gated, drelu, bias, act, threshold))
    return out


# ------------------------------------------------------------------------------------------------
# Source templates. string.Template ($name) so that C braces need no escaping.
# ------------------------------------------------------------------------------------------------

_PRELUDE = r"""
// ============================================================================================
// picompile CUDA prelude: number formats, loads, warp sums, and every kernel body as a template.
// Include-guarded so that any number of variants can share one translation unit.
// ============================================================================================
#ifndef PICOMPILE_CUDA_PRELUDE
#define PICOMPILE_CUDA_PRELUDE

#define PI_WARP 32
#define PI_FULL 0xffffffffu
#define PI_WARPS_PER_BLOCK 8      // pred_hidden, pred_mask, gate_up: 256 threads
#define PI_DOWN_THREADS 128       // down: threads per block, one tile of the index list each
#define PI_REDUCE_THREADS 256
#define PI_COMPACT_THREADS 1024
#define PI_MAXT 8                 // small-batch path: at most 8 tokens per call

typedef unsigned short pi_u16;    // float16 / bfloat16 as raw bits (no cuda_fp16.h needed)

// A number format: its element type, how many elements one 16-byte load holds (VEC), and how
// to widen them to fp32. All arithmetic is fp32.
struct PiF32 {
  typedef float elem;
  enum { VEC = 4 };
  static __device__ __forceinline__ float widen(float v) { return v; }
  static __device__ __forceinline__ void unpack(const uint4 q, float* f) {
    f[0] = __uint_as_float(q.x); f[1] = __uint_as_float(q.y);
    f[2] = __uint_as_float(q.z); f[3] = __uint_as_float(q.w);
  }
};

struct PiF16 {
  typedef pi_u16 elem;
  enum { VEC = 8 };
  static __device__ __forceinline__ float widen(pi_u16 v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
  }
  static __device__ __forceinline__ void unpack2(unsigned w, float* f) {
    f[0] = widen((pi_u16)(w & 0xffffu));  // little endian: the lower address is the low half
    f[1] = widen((pi_u16)(w >> 16));
  }
  static __device__ __forceinline__ void unpack(const uint4 q, float* f) {
    unpack2(q.x, f); unpack2(q.y, f + 2); unpack2(q.z, f + 4); unpack2(q.w, f + 6);
  }
};

struct PiBF16 {
  typedef pi_u16 elem;
  enum { VEC = 8 };
  static __device__ __forceinline__ float widen(pi_u16 v) {
    return __uint_as_float(((unsigned)v) << 16);  // bfloat16 is the top half of a float
  }
  static __device__ __forceinline__ void unpack2(unsigned w, float* f) {
    f[0] = __uint_as_float(w << 16);
    f[1] = __uint_as_float(w & 0xffff0000u);
  }
  static __device__ __forceinline__ void unpack(const uint4 q, float* f) {
    unpack2(q.x, f); unpack2(q.y, f + 2); unpack2(q.z, f + 4); unpack2(q.w, f + 6);
  }
};

// 16-byte loads: read-only (non-coherent) path for weights, plain path for x and shared memory.
__device__ __forceinline__ uint4 pi_ldg16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ uint4 pi_ld16(const void* p) {
  return *reinterpret_cast<const uint4*>(p);
}

// N consecutive elements of format F at p (16-byte aligned) as floats; N % F::VEC == 0.
template <class F, int N>
__device__ __forceinline__ void pi_load_run(const typename F::elem* p, float* f) {
#pragma unroll
  for (int q = 0; q < N / F::VEC; ++q) F::unpack(pi_ld16(p + q * F::VEC), f + q * F::VEC);
}

__device__ __forceinline__ float pi_warp_sum(float v) {
#pragma unroll
  for (int o = PI_WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(PI_FULL, v, o);
  return v;
}

// acc[t] += sum over this caller's part of the row of row[e] * x[t, e], for t < T.
//   row: [n] one weight row, format FW.   x: [T, x_stride] tokens, format FX (FW or fp32).
//   The caller's part: chunks (of FW::VEC elements) first, first + step, ...: a warp passes
//   (lane, 32) and reduces afterwards, a lone thread passes (0, 1).
//   vec: 16-byte loads allowed (n % FW::VEC == 0, row and x rows 16-byte aligned); else the
//   same parts element by element.
template <class FW, class FX, int MAXT>
__device__ __forceinline__ void pi_dot_part(const typename FW::elem* __restrict__ row,
                                            const typename FX::elem* x, int x_stride, int T,
                                            int n, int vec, int first, int step,
                                            float (&acc)[MAXT]) {
  if (vec) {
    const int n_chunks = n / FW::VEC;
#pragma unroll 4
    for (int c = first; c < n_chunks; c += step) {
      float w[FW::VEC];
      FW::unpack(pi_ldg16(row + c * FW::VEC), w);
#pragma unroll
      for (int t = 0; t < MAXT; ++t) {
        if (t < T) {
          float xv[FW::VEC];
          pi_load_run<FX, FW::VEC>(x + (size_t)t * x_stride + c * FW::VEC, xv);
#pragma unroll
          for (int k = 0; k < FW::VEC; ++k) acc[t] = fmaf(w[k], xv[k], acc[t]);
        }
      }
    }
  } else {
    // The same chunk ownership, element by element (unaligned rows or n % VEC != 0).
    for (int e = first * FW::VEC; e < n; e += step * FW::VEC) {
#pragma unroll
      for (int k = 0; k < FW::VEC; ++k) {
        if (e + k < n) {
          const float w = FW::widen(__ldg(row + e + k));
#pragma unroll
          for (int t = 0; t < MAXT; ++t)
            if (t < T) acc[t] = fmaf(w, FX::widen(x[(size_t)t * x_stride + e + k]), acc[t]);
        }
      }
    }
  }
}

// ---- 1a. predictor, layer 1: z[t, k] = relu(p1[k] . x[t] + pb1[k]); one warp per row k. ----
template <class F, int MAXT>
__device__ __forceinline__ void pi_pred_hidden_body(
    const typename F::elem* __restrict__ x, const typename F::elem* __restrict__ p1,
    const typename F::elem* __restrict__ pb1, float* __restrict__ z, int T, int d, int r,
    int vec) {
  const int lane = threadIdx.x & (PI_WARP - 1);
  const int first = (blockIdx.x * blockDim.x + threadIdx.x) / PI_WARP;
  const int step = (gridDim.x * blockDim.x) / PI_WARP;
  for (int k = first; k < r; k += step) {  // warp-uniform
    float acc[MAXT];
#pragma unroll
    for (int t = 0; t < MAXT; ++t) acc[t] = 0.0f;
    pi_dot_part<F, F, MAXT>(p1 + (size_t)k * d, x, d, T, d, vec, lane, PI_WARP, acc);
    const float b = F::widen(__ldg(pb1 + k));
#pragma unroll
    for (int t = 0; t < MAXT; ++t) {
      if (t < T) {
        const float s = pi_warp_sum(acc[t]) + b;
        if (lane == 0) z[(size_t)t * r + k] = fmaxf(s, 0.0f);
      }
    }
  }
}

// ---- 1b. predictor, layer 2: neuron j fires iff p2[j] . z[t] + pb2[j] > tau for some t. ----
// One thread per neuron (p2 rows are short, r <= 1024), one warp per 32 neurons = one mask word
// (__ballot_sync). z [T, r] is staged in shared memory (dynamic, T * r floats).
extern __shared__ float4 pi_dyn_smem[];

template <class F, int MAXT>
__device__ __forceinline__ void pi_pred_mask_body(
    const float* __restrict__ z, const typename F::elem* __restrict__ p2,
    const typename F::elem* __restrict__ pb2, float tau, unsigned* __restrict__ mask, int T,
    int r, int n_hot, int vec) {
  float* zs = reinterpret_cast<float*>(pi_dyn_smem);
  for (int e = threadIdx.x; e < T * r; e += blockDim.x) zs[e] = z[e];
  __syncthreads();
  const int lane = threadIdx.x & (PI_WARP - 1);
  const int first = (blockIdx.x * blockDim.x + threadIdx.x) / PI_WARP;
  const int step = (gridDim.x * blockDim.x) / PI_WARP;
  const int n_words = (n_hot + PI_WARP - 1) / PI_WARP;
  for (int w = first; w < n_words; w += step) {  // warp-uniform
    const int j = w * PI_WARP + lane;
    bool fire = false;
    if (j < n_hot) {
      float acc[MAXT];
#pragma unroll
      for (int t = 0; t < MAXT; ++t) acc[t] = 0.0f;
      pi_dot_part<F, PiF32, MAXT>(p2 + (size_t)j * r, zs, r, T, r, vec, 0, 1, acc);
      const float b = F::widen(__ldg(pb2 + j));
#pragma unroll
      for (int t = 0; t < MAXT; ++t)
        if (t < T) fire = fire || (acc[t] + b > tau);
    }
    const unsigned bits = __ballot_sync(PI_FULL, fire);
    if (lane == 0) mask[w] = bits;
  }
}

// ---- 2a. mask -> bitmask: a predictor's bool mask [T, n] (one byte each, rows `stride` bytes
// apart) -> bits [ceil(n / 32)], bit b of word w set when neuron 32 w + b is on for any token.
// One thread per word: the hybrid runtime's mask from PyTorch, in one launch, no host sync.
extern "C" __global__ void __launch_bounds__(256) pi_mask_bits(
    const unsigned char* __restrict__ mask,  // [T, stride] bool, n used per row
    int T,                                   //            tokens
    int n,                                   //            neurons
    int stride,                              //            bytes between rows (>= n)
    unsigned* __restrict__ bits)             // [ceil(n / 32)] out
{
  const int n_words = (n + PI_WARP - 1) / PI_WARP;
  for (int w = blockIdx.x * blockDim.x + threadIdx.x; w < n_words; w += gridDim.x * blockDim.x) {
    unsigned word = 0u;
    for (int t = 0; t < T; ++t) {
      const unsigned char* row = mask + (size_t)t * stride + (size_t)w * PI_WARP;
      const int in_word = min(PI_WARP, n - w * PI_WARP);
      for (int b = 0; b < in_word; ++b) word |= (row[b] != 0 ? 1u : 0u) << b;
    }
    bits[w] = word;
  }
}

// ---- 2. compaction: bitmask [n_words] -> idx (ascending neuron ids) + count. ----
// One block of PI_COMPACT_THREADS threads, one mask word per thread per pass: popc, a warp
// scan (__shfl_up_sync), a scan of the warp totals, then each thread writes its word's bits.
extern "C" __global__ void __launch_bounds__(PI_COMPACT_THREADS) pi_compact(
    const unsigned* __restrict__ mask,  // [n_words]  bit b of word w: neuron 32 w + b fires
    int n_words,                        //            = ceil(n_hot / 32)
    int* __restrict__ idx,              // [n_hot]    out: the firing neurons, ascending
    int* __restrict__ count)            // [1]        out: how many
{
  __shared__ int warp_off[PI_COMPACT_THREADS / PI_WARP];
  __shared__ int pass_total;
  const int tid = threadIdx.x, lane = tid & (PI_WARP - 1), wid = tid / PI_WARP;
  const int n_warps = blockDim.x / PI_WARP;
  int base = 0;
  for (int start = 0; start < n_words; start += blockDim.x) {
    const int w = start + tid;
    const unsigned bits = w < n_words ? mask[w] : 0u;
    const int c = __popc(bits);
    int incl = c;  // inclusive scan of c over the warp
#pragma unroll
    for (int o = 1; o < PI_WARP; o <<= 1) {
      const int y = __shfl_up_sync(PI_FULL, incl, o);
      if (lane >= o) incl += y;
    }
    if (lane == PI_WARP - 1) warp_off[wid] = incl;
    __syncthreads();
    if (wid == 0) {  // exclusive scan of the warp totals
      const int v = lane < n_warps ? warp_off[lane] : 0;
      int s = v;
#pragma unroll
      for (int o = 1; o < PI_WARP; o <<= 1) {
        const int y = __shfl_up_sync(PI_FULL, s, o);
        if (lane >= o) s += y;
      }
      if (lane < n_warps) warp_off[lane] = s - v;
      if (lane == PI_WARP - 1) pass_total = s;
    }
    __syncthreads();
    int pos = base + warp_off[wid] + incl - c;
    for (unsigned b = bits; b != 0u; b &= b - 1u) idx[pos++] = w * PI_WARP + (__ffs(b) - 1);
    base += pass_total;
    __syncthreads();  // warp_off / pass_total are rewritten by the next pass
  }
  if (tid == 0) *count = base;
}

// ---- 3. gate / up GEMV over the listed rows, activation fused; one warp per listed row. ----
// V: the variant (format, gated, drelu, bias, relu, threshold, act), see the variant structs.
template <class V, int MAXT>
__device__ __forceinline__ void pi_gate_up_body(
    const typename V::Fmt::elem* __restrict__ x, const typename V::Fmt::elem* __restrict__ w_gate,
    const typename V::Fmt::elem* __restrict__ w_up, const typename V::Fmt::elem* __restrict__ b_gate,
    const typename V::Fmt::elem* __restrict__ b_up, const int* __restrict__ idx,
    const int* __restrict__ count, float threshold, float* __restrict__ h,
    int* __restrict__ n_active, int T, int d, int h_stride, int vec) {
  typedef typename V::Fmt F;
  const int lane = threadIdx.x & (PI_WARP - 1);
  const int first = (blockIdx.x * blockDim.x + threadIdx.x) / PI_WARP;
  const int step = (gridDim.x * blockDim.x) / PI_WARP;
  const int m = *count;
  int n_on = 0;  // active (token, neuron) pairs seen by this warp
  for (int i = first; i < m; i += step) {  // warp-uniform
    const int j = idx[i];
    const size_t row = (size_t)j * d;
    float a[MAXT];  // gated: act(gate x + b_gate)
#pragma unroll
    for (int t = 0; t < MAXT; ++t) a[t] = 0.0f;
    bool need_up = true;
    if (V::gated) {
      float g[MAXT];
#pragma unroll
      for (int t = 0; t < MAXT; ++t) g[t] = 0.0f;
      pi_dot_part<F, F, MAXT>(w_gate + row, x, d, T, d, vec, lane, PI_WARP, g);
      const float bg = V::bias ? F::widen(__ldg(b_gate + j)) : 0.0f;
      bool any = false;
#pragma unroll
      for (int t = 0; t < MAXT; ++t) {
        if (t < T) {
          a[t] = V::act(pi_warp_sum(g[t]) + bg);
          any = any || a[t] != 0.0f;
        }
      }
      // ReLU gate zero for every token: h = 0 exactly, the up row is never read.
      need_up = any || !V::relu;
    }
    float u[MAXT];
#pragma unroll
    for (int t = 0; t < MAXT; ++t) u[t] = 0.0f;
    if (need_up) pi_dot_part<F, F, MAXT>(w_up + row, x, d, T, d, vec, lane, PI_WARP, u);
    const float bu = V::bias ? F::widen(__ldg(b_up + j)) : 0.0f;
#pragma unroll
    for (int t = 0; t < MAXT; ++t) {
      if (t < T) {
        float hv = 0.0f;
        if (need_up) {
          const float s = pi_warp_sum(u[t]) + bu;
          if (V::gated) hv = a[t] * (V::drelu ? fmaxf(s, 0.0f) : s);
          else hv = V::act(s);
        }
        const bool on = V::threshold ? fabsf(hv) > threshold : hv != 0.0f;
        if (!on) hv = 0.0f;
        n_on += on ? 1 : 0;
        if (lane == 0) h[(size_t)t * h_stride + i] = hv;
      }
    }
  }
  if (lane == 0 && n_on != 0) atomicAdd(n_active, n_on);  // one atomic per warp
}

// ---- 4. down: out[t, c] = sum_i h[t, i] * w_down_t[idx[i], c] (+ b_down[c] + old out). ----
// Grid (column slices, row ranges). A block owns PI_DOWN_THREADS * F::VEC columns (F::VEC per
// thread, one 16-byte load per row) and one contiguous range of the list, walked in tiles of
// PI_DOWN_THREADS entries: the tile's idx / h are staged in shared memory, keeping only rows with
// a nonzero h for some token (ballot, order kept), so the row loads of the inner loop depend on
// nothing but shared memory and pipeline. One range: the block writes out itself; several: it
// writes its partial sums and pi_down_reduce adds them up in range order. No atomics, no races.
template <class F, int MAXT>
__device__ __forceinline__ void pi_down_body(
    const float* __restrict__ h, int h_stride, const int* __restrict__ idx,
    const int* __restrict__ count, const typename F::elem* __restrict__ w_down_t,
    const typename F::elem* __restrict__ b_down, float* __restrict__ out,
    float* __restrict__ partial, int T, int d, int vec, int accumulate) {
  __shared__ int s_row[PI_DOWN_THREADS];
  __shared__ float s_h[MAXT][PI_DOWN_THREADS];
  __shared__ int s_warp[PI_DOWN_THREADS / PI_WARP];
  const int tid = threadIdx.x, lane = tid & (PI_WARP - 1), wid = tid / PI_WARP;
  const int col0 = (blockIdx.x * PI_DOWN_THREADS + tid) * F::VEC;
  const bool has_cols = col0 < d;
  const int m = *count;
  const int per_range = (m + gridDim.y - 1) / gridDim.y;
  const int begin = min(m, (int)blockIdx.y * per_range);
  const int end = min(m, begin + per_range);

  float acc[MAXT][F::VEC];
#pragma unroll
  for (int t = 0; t < MAXT; ++t)
#pragma unroll
    for (int k = 0; k < F::VEC; ++k) acc[t][k] = 0.0f;

  for (int tile = begin; tile < end; tile += PI_DOWN_THREADS) {  // block-uniform
    const int i = tile + tid;
    int j = 0;
    float hv[MAXT];
    bool keep = false;
#pragma unroll
    for (int t = 0; t < MAXT; ++t) hv[t] = 0.0f;
    if (i < end) {
      j = idx[i];
#pragma unroll
      for (int t = 0; t < MAXT; ++t) {
        if (t < T) {
          hv[t] = h[(size_t)t * h_stride + i];
          keep = keep || hv[t] != 0.0f;
        }
      }
    }
    const unsigned ballot = __ballot_sync(PI_FULL, keep);
    if (lane == 0) s_warp[wid] = __popc(ballot);
    __syncthreads();
    int pos = __popc(ballot & ((1u << lane) - 1u));
    int n_keep = 0;
#pragma unroll
    for (int q = 0; q < PI_DOWN_THREADS / PI_WARP; ++q) {
      if (q < wid) pos += s_warp[q];
      n_keep += s_warp[q];
    }
    if (keep) {
      s_row[pos] = j;
#pragma unroll
      for (int t = 0; t < MAXT; ++t) s_h[t][pos] = hv[t];
    }
    __syncthreads();
    if (has_cols) {
      const typename F::elem* cols = w_down_t + col0;
      if (vec) {
#pragma unroll 4
        for (int q = 0; q < n_keep; ++q) {
          float w[F::VEC];
          F::unpack(pi_ldg16(cols + (size_t)s_row[q] * d), w);
#pragma unroll
          for (int t = 0; t < MAXT; ++t) {
            if (t < T) {
              const float ht = s_h[t][q];
#pragma unroll
              for (int k = 0; k < F::VEC; ++k) acc[t][k] = fmaf(ht, w[k], acc[t][k]);
            }
          }
        }
      } else {
        for (int q = 0; q < n_keep; ++q) {
          const typename F::elem* p = cols + (size_t)s_row[q] * d;
          float w[F::VEC];
#pragma unroll
          for (int k = 0; k < F::VEC; ++k) w[k] = col0 + k < d ? F::widen(__ldg(p + k)) : 0.0f;
#pragma unroll
          for (int t = 0; t < MAXT; ++t) {
            if (t < T) {
              const float ht = s_h[t][q];
#pragma unroll
              for (int k = 0; k < F::VEC; ++k) acc[t][k] = fmaf(ht, w[k], acc[t][k]);
            }
          }
        }
      }
    }
    __syncthreads();  // s_row / s_h / s_warp are rewritten by the next tile
  }

  if (!has_cols) return;
#pragma unroll
  for (int t = 0; t < MAXT; ++t) {
    if (t < T) {
#pragma unroll
      for (int k = 0; k < F::VEC; ++k) {
        const int c = col0 + k;
        if (c < d) {
          if (gridDim.y == 1) {
            float v = acc[t][k];
            if (b_down != 0) v += F::widen(__ldg(b_down + c));
            if (accumulate) v += out[(size_t)t * d + c];
            out[(size_t)t * d + c] = v;
          } else {
            partial[((size_t)blockIdx.y * T + t) * d + c] = acc[t][k];
          }
        }
      }
    }
  }
}

// out[t, c] = sum over ranges s (in order) of partial[s, t, c]  (+ b_down[c]) (+ old out[t, c])
template <class F>
__device__ __forceinline__ void pi_down_reduce_body(
    const float* __restrict__ partial, const typename F::elem* __restrict__ b_down,
    float* __restrict__ out, int T, int d, int n_split, int accumulate) {
  const int n = T * d;
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x) {
    float v = 0.0f;
    for (int s = 0; s < n_split; ++s) v += partial[(size_t)s * n + e];
    if (b_down != 0) v += F::widen(__ldg(b_down + e % d));
    if (accumulate) v += out[e];
    out[e] = v;
  }
}

#endif  // PICOMPILE_CUDA_PRELUDE
"""

# Per dtype: the predictor and down kernels (they depend on nothing else of the variant).
_DTYPE_KERNELS = string.Template(r"""
// ============================================================================================
// $dtype kernels: predictor, down projection. Weights / x: $elem ($fmt), VEC = $vec per 16 B.
// ============================================================================================
#ifndef PICOMPILE_CUDA_$DT
#define PICOMPILE_CUDA_$DT

// 1a. predictor layer 1, batch-1 decode (T = 1) and small batch (T <= 8). Grid-stride, 1 warp/row.
extern "C" __global__ void __launch_bounds__(PI_WARPS_PER_BLOCK * PI_WARP) pi_pred_hidden_1_$dt(
    const $elem* __restrict__ x,    // [1, d]   the token
    const $elem* __restrict__ p1,   // [r, d]   predictor layer 1
    const $elem* __restrict__ pb1,  // [r]
    float* __restrict__ z,          // [1, r]   out: relu(p1 x + pb1), fp32
    int T,                          //          1 (the argument list is the batch one's)
    int d,                          //          model width
    int r,                          //          predictor rank
    int vec)                        //          1: 16-byte loads (d % $vec == 0, aligned)
{
  pi_pred_hidden_body<$fmt, 1>(x, p1, pb1, z, 1, d, r, vec);
}

extern "C" __global__ void __launch_bounds__(PI_WARPS_PER_BLOCK * PI_WARP) pi_pred_hidden_b_$dt(
    const $elem* __restrict__ x,    // [T, d]   the tokens
    const $elem* __restrict__ p1,   // [r, d]   predictor layer 1
    const $elem* __restrict__ pb1,  // [r]
    float* __restrict__ z,          // [T, r]   out: relu(x p1^T + pb1), fp32
    int T,                          //          tokens, 1..8
    int d,                          //          model width
    int r,                          //          predictor rank
    int vec)                        //          1: 16-byte loads (d % $vec == 0, aligned)
{
  pi_pred_hidden_body<$fmt, PI_MAXT>(x, p1, pb1, z, T, d, r, vec);
}

// 1b. predictor layer 2 + test: mask bit j = (p2[j] . z[t] + pb2[j] > tau for some t).
//     Dynamic shared memory: T * r * 4 bytes.
extern "C" __global__ void __launch_bounds__(PI_WARPS_PER_BLOCK * PI_WARP) pi_pred_mask_1_$dt(
    const float* __restrict__ z,     // [1, r]       from pi_pred_hidden
    const $elem* __restrict__ p2,    // [n_hot, r]   predictor layer 2, hot rows
    const $elem* __restrict__ pb2,   // [n_hot]
    float tau,                       //              fire iff logit > tau
    unsigned* __restrict__ mask,     // [ceil(n_hot / 32)]  out: firing bits
    int T,                           //              1
    int r,                           //              predictor rank, <= 1024
    int n_hot,                       //              hot neurons
    int vec)                         //              1: 16-byte loads (r % $vec == 0, aligned)
{
  pi_pred_mask_body<$fmt, 1>(z, p2, pb2, tau, mask, 1, r, n_hot, vec);
}

extern "C" __global__ void __launch_bounds__(PI_WARPS_PER_BLOCK * PI_WARP) pi_pred_mask_b_$dt(
    const float* __restrict__ z,     // [T, r]       from pi_pred_hidden
    const $elem* __restrict__ p2,    // [n_hot, r]   predictor layer 2, hot rows
    const $elem* __restrict__ pb2,   // [n_hot]
    float tau,                       //              fire iff logit > tau (union over tokens)
    unsigned* __restrict__ mask,     // [ceil(n_hot / 32)]  out: firing bits
    int T,                           //              tokens, 1..8
    int r,                           //              predictor rank, <= 1024
    int n_hot,                       //              hot neurons
    int vec)                         //              1: 16-byte loads (r % $vec == 0, aligned)
{
  pi_pred_mask_body<$fmt, PI_MAXT>(z, p2, pb2, tau, mask, T, r, n_hot, vec);
}

// 4. down projection over the listed rows. Grid (ceil(d / (PI_DOWN_THREADS * $vec)), n_split).
extern "C" __global__ void __launch_bounds__(PI_DOWN_THREADS) pi_down_1_$dt(
    const float* __restrict__ h,          // [1, h_stride]  h of listed row i at [0, i], fp32
    int h_stride,                         //                row stride of h (>= count)
    const int* __restrict__ idx,          // [count]        listed rows of w_down_t
    const int* __restrict__ count,        // [1]            list length (device)
    const $elem* __restrict__ w_down_t,   // [n_rows, d]    down weights, one row per neuron
    const $elem* __restrict__ b_down,     // [d] or null
    float* __restrict__ out,              // [1, d]         out (n_split == 1), fp32
    float* __restrict__ partial,          // [n_split, 1, d] partial sums (n_split > 1)
    int T,                                //                1
    int d,                                //                model width
    int vec,                              //                1: 16-byte loads (d % $vec == 0)
    int accumulate)                       //                1: out += ..., 0: out = ...
{
  pi_down_body<$fmt, 1>(h, h_stride, idx, count, w_down_t, b_down, out, partial, 1, d, vec,
                        accumulate);
}

extern "C" __global__ void __launch_bounds__(PI_DOWN_THREADS) pi_down_b_$dt(
    const float* __restrict__ h,          // [T, h_stride]  h of token t, listed row i at [t, i]
    int h_stride,                         //                row stride of h (>= count)
    const int* __restrict__ idx,          // [count]        listed rows of w_down_t
    const int* __restrict__ count,        // [1]            list length (device)
    const $elem* __restrict__ w_down_t,   // [n_rows, d]    down weights, one row per neuron
    const $elem* __restrict__ b_down,     // [d] or null
    float* __restrict__ out,              // [T, d]         out (n_split == 1), fp32
    float* __restrict__ partial,          // [n_split, T, d] partial sums (n_split > 1)
    int T,                                //                tokens, 1..8
    int d,                                //                model width
    int vec,                              //                1: 16-byte loads (d % $vec == 0)
    int accumulate)                       //                1: out += ..., 0: out = ...
{
  pi_down_body<$fmt, PI_MAXT>(h, h_stride, idx, count, w_down_t, b_down, out, partial, T, d,
                              vec, accumulate);
}

extern "C" __global__ void __launch_bounds__(PI_REDUCE_THREADS) pi_down_reduce_$dt(
    const float* __restrict__ partial,    // [n_split, T, d] from pi_down_*
    const $elem* __restrict__ b_down,     // [d] or null
    float* __restrict__ out,              // [T, d]          out, fp32
    int T,                                //                 tokens, 1..8
    int d,                                //                 model width
    int n_split,                          //                 row ranges
    int accumulate)                       //                 1: out += ..., 0: out = ...
{
  pi_down_reduce_body<$fmt>(partial, b_down, out, T, d, n_split, accumulate);
}

#endif  // PICOMPILE_CUDA_$DT
""")

# Per variant: the variant as constants, its activation, and the gate/up kernels.
_VARIANT_KERNELS = string.Template(r"""
// ============================================================================================
// variant $tag
//   dtype $dtype, $kind_doc, act $act, bias $bias_doc, $threshold_doc
// ============================================================================================
#ifndef PICOMPILE_CUDA_VARIANT_$tag
#define PICOMPILE_CUDA_VARIANT_$tag

struct PiVariant_$tag {
  typedef $fmt Fmt;                      // weights and x: $dtype
  static const bool gated = $gated;      // h = act(gate x + b_gate) * u   (else h = act(up x + b_up))
  static const bool drelu = $drelu;      // u = relu(up x + b_up)          (else u = up x + b_up)
  static const bool bias = $bias;        // b_gate / b_up are read
  static const bool relu = $relu;        // act is ReLU: a zero gate skips the up row
  static const bool threshold = $threshold;  // active iff |h| > threshold (else iff h != 0)
  static __device__ __forceinline__ float act(float v) {
    $act_code
  }
};

// 3. gate / up over the listed rows -> h, batch-1 decode (T = 1) and small batch (T <= 8).
//    Grid-stride: any grid works; one warp per listed row.
extern "C" __global__ void __launch_bounds__(PI_WARPS_PER_BLOCK * PI_WARP) pi_gate_up_1_$tag(
    const $elem* __restrict__ x,       // [1, d]        the token
    const $elem* __restrict__ w_gate,  // [n_rows, d]   gate rows (unused when plain)
    const $elem* __restrict__ w_up,    // [n_rows, d]   up rows
    const $elem* __restrict__ b_gate,  // [n_rows]      (read only with bias, gated)
    const $elem* __restrict__ b_up,    // [n_rows]      (read only with bias)
    const int* __restrict__ idx,       // [count]       listed rows
    const int* __restrict__ count,     // [1]           list length (device)
    float threshold,                   //               |h| > threshold (threshold variants)
    float* __restrict__ h,             // [1, h_stride] out: h of listed row i at [0, i], fp32
    int* __restrict__ n_active,        // [1]           += active (token, neuron) pairs
    int T,                             //               1
    int d,                             //               model width
    int h_stride,                      //               row stride of h (>= count)
    int vec)                           //               1: 16-byte loads (d % $vec == 0, aligned)
{
  pi_gate_up_body<PiVariant_$tag, 1>(x, w_gate, w_up, b_gate, b_up, idx, count, threshold, h,
                                      n_active, 1, d, h_stride, vec);
}

extern "C" __global__ void __launch_bounds__(PI_WARPS_PER_BLOCK * PI_WARP) pi_gate_up_b_$tag(
    const $elem* __restrict__ x,       // [T, d]        the tokens
    const $elem* __restrict__ w_gate,  // [n_rows, d]   gate rows (unused when plain)
    const $elem* __restrict__ w_up,    // [n_rows, d]   up rows
    const $elem* __restrict__ b_gate,  // [n_rows]      (read only with bias, gated)
    const $elem* __restrict__ b_up,    // [n_rows]      (read only with bias)
    const int* __restrict__ idx,       // [count]       listed rows (union over the tokens)
    const int* __restrict__ count,     // [1]           list length (device)
    float threshold,                   //               |h| > threshold (threshold variants)
    float* __restrict__ h,             // [T, h_stride] out: h of token t, listed row i at [t, i]
    int* __restrict__ n_active,        // [1]           += active (token, neuron) pairs
    int T,                             //               tokens, 1..8
    int d,                             //               model width
    int h_stride,                      //               row stride of h (>= count)
    int vec)                           //               1: 16-byte loads (d % $vec == 0, aligned)
{
  pi_gate_up_body<PiVariant_$tag, PI_MAXT>(x, w_gate, w_up, b_gate, b_up, idx, count, threshold,
                                            h, n_active, T, d, h_stride, vec);
}

#endif  // PICOMPILE_CUDA_VARIANT_$tag
""")

# The activations, fp32, as torch computes them (F.relu / F.silu / F.gelu / F.gelu(tanh)).
_ACT_CODE = {
    "relu": "return fmaxf(v, 0.0f);",
    "silu": "return v / (1.0f + expf(-v));  // v * sigmoid(v); -inf -> -0, +inf -> v",
    "gelu": "return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));  // erf GELU",
    "gelu_tanh": (
        "const float k = 0.79788456080286536f;  // sqrt(2 / pi)\n"
        "    return 0.5f * v * (1.0f + tanhf(k * (v + 0.044715f * v * v * v)));"
    ),
}


def _cbool(b: bool) -> str:
    return "true" if b else "false"


def _dtype_block(dtype: str) -> str:
    fmt, elem, dt, vec = _FORMATS[dtype]
    return _DTYPE_KERNELS.substitute(dtype=dtype, fmt=fmt, elem=elem, dt=dt, DT=dt.upper(), vec=vec)


def _variant_block(v: CudaVariant) -> str:
    fmt, elem, _, vec = _FORMATS[v.dtype]
    kind_doc = {
        "plain": "plain h = act(up x + b_up)",
        "gated": "gated h = act(gate x + b_gate) * (up x + b_up)",
        "drelu": "dReLU h = act(gate x + b_gate) * relu(up x + b_up)",
    }[v.kind]
    return _VARIANT_KERNELS.substitute(
        tag=v.tag, dtype=v.dtype, fmt=fmt, elem=elem, vec=vec, act=v.act, kind_doc=kind_doc,
        bias_doc="yes" if v.bias else "no",
        threshold_doc="threshold test |h| > threshold" if v.threshold else "exact (h != 0)",
        gated=_cbool(v.gated), drelu=_cbool(v.drelu), bias=_cbool(v.bias),
        relu=_cbool(v.act == "relu"), threshold=_cbool(v.threshold), act_code=_ACT_CODE[v.act],
    )


def source(v: CudaVariant) -> str:
    """The CUDA C source of one variant: prelude, its dtype's kernels, its gate/up kernels."""
    head = f"// picompile generated CUDA source, variant {v.tag}; kernels: "
    head += ", ".join(v.kernel_names().values()) + "\n"
    return head + _PRELUDE + _dtype_block(v.dtype) + _variant_block(v)


def combined_source(variants) -> str:
    """Several variants in one translation unit (shared parts appear once, by their guards)."""
    return "".join(source(v) for v in variants)


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
    """Compile CUDA source to a cubin for `arch` (cached by cache.cached_build). -> its path."""
    from picompile.codegen import cache

    _check_arch(arch)
    nvcc = nvcc_path()
    if nvcc is None:
        raise NvccError(
            "nvcc not found (set PICOMPILE_NVCC, put nvcc on PATH or set CUDA_HOME); it is only "
            "needed for backend='nvcc' and the compile checks: the default backend compiles with "
            "NVRTC through cupy"
        )
    flags = ["-cubin", f"-arch={arch}", *NVCC_FLAGS]

    def build(src_path: Path, out_path: Path) -> None:
        cmd = [nvcc, *flags, "-o", str(out_path), str(src_path)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise NvccError(f"could not run {nvcc}: {e}") from e
        if proc.returncode != 0:
            raise NvccError(
                f"nvcc failed (exit {proc.returncode}) for {arch}: {' '.join(cmd)}\n"
                f"--- nvcc stderr ---\n{proc.stderr.strip()}\n{proc.stdout.strip()}"
            )

    return cache.cached_build(src, suffix=".cubin", flags=flags, build=build,
                              tag=f"cuda:{arch}:{tag}")


def compile_with_nvcc(v: CudaVariant, arch: str) -> Path:
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


@functools.lru_cache(maxsize=None)
def load(v: CudaVariant, backend: str | None = None) -> CudaKernels:
    """Compile (NVRTC via cupy by default, or nvcc's cubin) and load one variant."""
    cp = _cupy()
    backend = backend or os.environ.get(BACKEND_ENV, "nvrtc")
    if backend == "nvrtc":
        module = cp.RawModule(code=source(v))
    elif backend == "nvcc":
        cc = cp.cuda.Device().compute_capability  # e.g. "90"
        module = cp.RawModule(path=str(compile_with_nvcc(v, f"sm_{cc}")))
    else:
        raise ValueError(f"backend must be 'nvrtc' or 'nvcc', not {backend!r}")
    return CudaKernels(v, module)


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
    with cp.cuda.Device(index):
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

    def __init__(self, variant: CudaVariant, module):
        self.variant = variant
        self.module = module
        self.names = variant.kernel_names()
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
        vec = int(d % self.variant.vec == 0 and _aligned16(x, p1))
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
        vec = int(r % self.variant.vec == 0 and _aligned16(p2))
        blocks = max(1, min(math.ceil(n_words / _WARPS_PER_BLOCK), 8 * self._sms(z)))
        self._launch("pred_mask_1" if T == 1 else "pred_mask_b", (blocks,),
                     (_WARPS_PER_BLOCK * 32,),
                     (_ptr(z), _ptr(p2), _ptr(pb2), _f32(tau), _ptr(mask), _i32(T), _i32(r),
                      _i32(n_hot), _i32(vec)),
                     shared_mem=smem)

    def mask_bits(self, mask, bits) -> None:
        """mask [T, n] bool (rows may be strided, columns contiguous) -> bits [ceil(n / 32)]."""
        T, n = mask.shape
        n_words = math.ceil(n / 32)
        blocks = max(1, min(math.ceil(n_words / 256), 8 * self._sms(mask)))
        self._launch("mask_bits", (blocks,), (256,),
                     (_ptr(mask), _i32(T), _i32(n), _i32(mask.stride(0)), _ptr(bits)))

    def compact(self, mask, n_words: int, idx, count) -> None:
        """mask [n_words] -> idx [32 n_words] (ascending; `count` of them), count [1]."""
        self._launch("compact", (1,), (_COMPACT_THREADS,),
                     (_ptr(mask), _i32(n_words), _ptr(idx), _ptr(count)))

    def gate_up(self, x, w_gate, w_up, b_gate, b_up, idx, count, cap: int, threshold: float,
                h, n_active) -> None:
        """x [T, d]; rows idx[:count] (count <= cap) of w_gate / w_up -> h [T, cap] fp32."""
        T, d = x.shape
        vec = int(d % self.variant.vec == 0 and _aligned16(x, w_gate, w_up))
        blocks = max(1, min(math.ceil(cap / _WARPS_PER_BLOCK), 8 * self._sms(x)))
        self._launch("gate_up_1" if T == 1 else "gate_up_b", (blocks,), (_WARPS_PER_BLOCK * 32,),
                     (_ptr(x), _ptr(w_gate), _ptr(w_up), _ptr(b_gate), _ptr(b_up), _ptr(idx),
                      _ptr(count), _f32(threshold), _ptr(h), _ptr(n_active), _i32(T), _i32(d),
                      _i32(cap), _i32(vec)))

    def n_split(self, cap: int, d: int, device_index: int) -> int:
        """Row ranges per column slice of the down projection (1: no partials / reduction)."""
        col_blocks = math.ceil(d / (_DOWN_THREADS * self.variant.vec))
        want = math.ceil(2 * _sm_count(device_index) / col_blocks)
        return max(1, min(_MAX_SPLIT, cap // 32, want))

    def down(self, h, cap: int, idx, count, w_down_t, b_down, out, accumulate: bool) -> None:
        """out [T, d] (+)= h [T, cap] over rows idx[:count] of w_down_t (+ b_down)."""
        import torch

        T, d = out.shape
        vec = int(d % self.variant.vec == 0 and _aligned16(w_down_t))
        col_blocks = math.ceil(d / (_DOWN_THREADS * self.variant.vec))
        n_split = self.n_split(cap, d, out.device.index)
        partial = None
        if n_split > 1:
            partial = torch.empty(n_split * T * d, dtype=torch.float32, device=out.device)
        self._launch("down_1" if T == 1 else "down_b", (col_blocks, n_split), (_DOWN_THREADS,),
                     (_ptr(h), _i32(cap), _ptr(idx), _ptr(count), _ptr(w_down_t), _ptr(b_down),
                      _ptr(out), _ptr(partial), _i32(T), _i32(d), _i32(vec), _i32(int(accumulate))))
        if n_split > 1:
            blocks = max(1, min(math.ceil(T * d / _REDUCE_THREADS), 8 * self._sms(out)))
            self._launch("down_reduce", (blocks,), (_REDUCE_THREADS,),
                         (_ptr(partial), _ptr(b_down), _ptr(out), _i32(T), _i32(d), _i32(n_split),
                          _i32(int(accumulate))))
        # `partial` is freed to torch's caching allocator on this (the current) stream: reuse by a
        # later allocation on the same stream is ordered after these kernels.


# ------------------------------------------------------------------------------------------------
# The block on the GPU
# ------------------------------------------------------------------------------------------------


def _require_cuda(t) -> None:
    if not t.is_cuda:
        raise CudaUnavailable(f"CudaFFN needs CUDA tensors (got one on {t.device}); use the C / "
                              "reference path on the CPU")


class CudaFFN:
    """The hot rows of one FFN block on the GPU: predictor -> compaction -> gate/up -> down.

    All tensors are torch CUDA tensors on one device, contiguous, in one dtype (weights, biases,
    x and the predictor; x is cast if it differs): w_up / w_gate / w_down_t [n_hot, d],
    b_up / b_gate [n_hot], b_down [d] (optional: leave it to whoever adds the cold part),
    predictor p1 [r, d], pb1 [r], p2 [n_hot, r], pb2 [n_hot], neuron j fires iff
    p2[j] . relu(p1 x + pb1) + pb2[j] > tau.

    Calls return (out [T, d] float32, n_active), n_active a 0-d int32 CUDA tensor counting the
    active (token, neuron) pairs (int() of it synchronizes). Nothing here synchronizes."""

    def __init__(self, w_up, w_down_t, *, w_gate=None, b_gate=None, b_up=None, b_down=None,
                 act: str = "relu", drelu: bool = False, threshold: float = 0.0,
                 p1=None, pb1=None, p2=None, pb2=None, tau: float = 0.0,
                 backend: str | None = None):
        _require_cuda(w_up)
        dtype = str(w_up.dtype).removeprefix("torch.")
        bias = b_up is not None or b_gate is not None
        self.variant = CudaVariant(
            dtype=dtype, gated=w_gate is not None, drelu=drelu, bias=bias, act=act,
            threshold=float(threshold) != 0.0,
        )
        self.threshold = float(threshold)
        self.tau = float(tau)
        self.device = w_up.device
        n_rows, d = w_up.shape
        self.n_rows, self.d = n_rows, d
        want = _torch_dtype(dtype)

        def check(t, name, shape, required=False):
            if t is None:
                if required:
                    raise ValueError(f"{name} is required for variant {self.variant.tag}")
                return None
            if t.device != self.device or t.dtype != want:
                raise ValueError(f"{name}: expected {want} on {self.device}, got {t.dtype} "
                                 f"on {t.device}")
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
            return t.contiguous()

        self.w_up = check(w_up, "w_up", (n_rows, d))
        self.w_down_t = check(w_down_t, "w_down_t", (n_rows, d), True)
        self.w_gate = check(w_gate, "w_gate", (n_rows, d))
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
        return x.to(_torch_dtype(self.variant.dtype)).contiguous()

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
        import torch

        if self.p1 is None:
            raise ValueError("this CudaFFN has no predictor (p1, pb1, p2, pb2)")
        x = self._x(x)
        with torch_stream(self.device):
            return self._predict(x)

    def _predict(self, x):
        import torch

        T = x.shape[0]
        r = self.p1.shape[0]
        n_words = max(1, math.ceil(self.n_rows / 32))
        z = torch.empty(T, r, dtype=torch.float32, device=self.device)
        mask = torch.zeros(n_words, dtype=torch.int32, device=self.device)
        idx = torch.empty(max(1, self.n_rows), dtype=torch.int32, device=self.device)
        count = torch.empty(1, dtype=torch.int32, device=self.device)
        if self.n_rows > 0 and r > 0:
            self.kernels.pred_hidden(x, self.p1, self.pb1, z)
            self.kernels.pred_mask(z, T, self.p2, self.pb2, self.tau, mask)
        self.kernels.compact(mask, n_words, idx, count)
        return idx, count

    def _run(self, x, idx, count, cap, out, accumulate):
        import torch

        T = x.shape[0]
        h = torch.empty(T, max(1, cap), dtype=torch.float32, device=self.device)
        n_active = torch.zeros((), dtype=torch.int32, device=self.device)
        self.kernels.gate_up(x, self.w_gate, self.w_up, self.b_gate, self.b_up, idx, count,
                             max(1, cap), self.threshold, h, n_active)
        self.kernels.down(h, max(1, cap), idx, count, self.w_down_t, self.b_down, out, accumulate)
        return out, n_active

    # -- entry points ----------------------------------------------------------------------------
    def __call__(self, x, *, out=None, accumulate: bool = False):
        """x [T, d] -> (out [T, d] fp32, n_active): the predicted hot rows (union over tokens)."""
        import torch

        if self.p1 is None:
            raise ValueError("this CudaFFN has no predictor; use ffn_given_idx")
        x = self._x(x)
        out = self._out(out, x.shape[0])
        with torch_stream(self.device):
            idx, count = self._predict(x)
            self.last_idx, self.last_count = idx, count
            return self._run(x, idx, count, self.n_rows, out, accumulate)

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
            words = torch.empty(max(1, math.ceil(self.n_rows / 32)), dtype=torch.int32,
                                device=self.device)
            if self.n_rows:
                self.kernels.mask_bits(mask, words)
            else:
                words.zero_()
            idx = torch.empty(max(1, self.n_rows), dtype=torch.int32, device=self.device)
            count = torch.empty(1, dtype=torch.int32, device=self.device)
            self.kernels.compact(words, words.numel(), idx, count)
            return self._run(x, idx, count, self.n_rows, out, accumulate)

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
            return self._run(x, idx, count, m, out, accumulate)


def hot_ffn(x, w_up, w_down_t, *, w_gate=None, b_gate=None, b_up=None, b_down=None,
            p1, pb1, p2, pb2, tau: float, act: str = "relu", drelu: bool = False,
            threshold: float = 0.0, out=None, accumulate: bool = False, backend=None):
    """One call of the hot rows: predictor -> compaction -> gate/up -> down.
    -> (out [T, d] fp32, n_active 0-d int32 CUDA tensor). See CudaFFN."""
    ffn = CudaFFN(w_up, w_down_t, w_gate=w_gate, b_gate=b_gate, b_up=b_up, b_down=b_down,
                  act=act, drelu=drelu, threshold=threshold, p1=p1, pb1=pb1, p2=p2, pb2=pb2,
                  tau=tau, backend=backend)
    return ffn(x, out=out, accumulate=accumulate)


def ffn_given_idx(x, w_up, w_down_t, idx, *, w_gate=None, b_gate=None, b_up=None, b_down=None,
                  act: str = "relu", drelu: bool = False, threshold: float = 0.0, out=None,
                  accumulate: bool = False, backend=None):
    """The block over the rows idx (no predictor); same keywords as ffn_reference.
    -> (out [T, d] fp32, n_active 0-d int32 CUDA tensor)."""
    ffn = CudaFFN(w_up, w_down_t, w_gate=w_gate, b_gate=b_gate, b_up=b_up, b_down=b_down,
                  act=act, drelu=drelu, threshold=threshold, backend=backend)
    return ffn.ffn_given_idx(x, idx, out=out, accumulate=accumulate)
