// picompile CUDA kernels: number formats, loads, warp sums, activations, and every kernel body
// as a template. Package data: picompile/codegen/cuda.py puts it (with act.h spliced in) at the
// top of each generated source, then instantiates the kernels with ffn_cuda_dtype.cuh (per
// dtype) and ffn_cuda_variant.cuh (per variant). Include-guarded, so that any number of variants
// can share one translation unit.
//
// No system headers: float16 / bfloat16 are read as raw 16-bit words and widened with one PTX
// `cvt` (f16) or a shift (bf16), so the same source builds with nvcc and with NVRTC (cupy).
#ifndef PICOMPILE_CUDA_PRELUDE
#define PICOMPILE_CUDA_PRELUDE

#include "act.h"

#define PI_CAT_(a, b) a##b
#define PI_CAT(a, b) PI_CAT_(a, b)  // PI_CAT(pi_down_1_, PI_DT): a kernel's name, macros expanded

#define PI_WARP 32
#define PI_FULL 0xffffffffu
#define PI_WARPS_PER_BLOCK 8      // pred_hidden, pred_mask, gate_up: 256 threads
#define PI_DOWN_THREADS 128       // down: threads per block, one tile of the index list each
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

// Float weight rows in format F, as the gate / up and down kernels read them (a quantized row
// format, PiQRows in ffn_cuda_q.cuh, has the same members).
template <class F>
struct PiRows {
  typedef typename F::elem elem;
  enum { VEC = F::VEC };  // down: columns per thread, one 16-byte load per row
  // acc[t] += this lane's part of row j of w [n_rows, d] . x[t] (x [T, d]); the warp sums after.
  template <int MAXT>
  static __device__ __forceinline__ void dot(const elem* __restrict__ w, int j,
                                             const typename F::elem* x, int T, int d, int vec,
                                             int lane, float (&acc)[MAXT]) {
    pi_dot_part<F, F, MAXT>(w + (size_t)j * d, x, d, T, d, vec, lane, PI_WARP, acc);
  }
  // out [VEC] = columns col0 .. col0 + VEC - 1 of row j of w [n_rows, d]: one 16-byte load ...
  static __device__ __forceinline__ void cols_vec(const elem* __restrict__ w, int j, int d,
                                                  int col0, float* out) {
    F::unpack(pi_ldg16(w + col0 + (size_t)j * d), out);
  }
  // ... or element by element, zero past d (unaligned rows, d % VEC != 0).
  static __device__ __forceinline__ void cols_any(const elem* __restrict__ w, int j, int d,
                                                  int col0, float* out) {
    const elem* p = w + col0 + (size_t)j * d;
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = col0 + k < d ? F::widen(__ldg(p + k)) : 0.0f;
  }
};

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

// ---- 2. compaction: the firing neurons -> idx (ascending neuron ids) + count. ----
// Word w of the firing bitmask (bit b set when neuron 32 w + b fires), from one of two sources:
// a predictor's bits, or a bool mask [T, n] (any token on: the hybrid runtime's mask from
// PyTorch, compacted here without a separate bitmask kernel or a host sync).
struct PiMaskWords {
  const unsigned* bits;  // [n_words]
  __device__ __forceinline__ unsigned operator()(int w) const { return bits[w]; }
};

struct PiMaskBytes {
  const unsigned char* mask;  // [T, stride] bool, n used per row
  int T, n, stride;
  __device__ __forceinline__ unsigned operator()(int w) const {
    unsigned word = 0u;
    const int in_word = min(PI_WARP, n - w * PI_WARP);
    for (int t = 0; t < T; ++t) {
      const unsigned char* row = mask + (size_t)t * stride + (size_t)w * PI_WARP;
      for (int b = 0; b < in_word; ++b) word |= (row[b] != 0 ? 1u : 0u) << b;
    }
    return word;
  }
};

// One block of PI_COMPACT_THREADS threads, one mask word per thread per pass: popc, a warp
// scan (__shfl_up_sync), a scan of the warp totals, then each thread writes its word's bits.
// It also zeroes the counters the next kernels add to (n_active, the down kernel's arrivals),
// which saves their own launches: the kernels of one stream run in order.
template <class Words>
__device__ __forceinline__ void pi_compact_body(Words words, int n_words, int* __restrict__ idx,
                                                int* __restrict__ count,
                                                int* __restrict__ counters, int n_counters) {
  __shared__ int warp_off[PI_COMPACT_THREADS / PI_WARP];
  __shared__ int pass_total;
  const int tid = threadIdx.x, lane = tid & (PI_WARP - 1), wid = tid / PI_WARP;
  const int n_warps = blockDim.x / PI_WARP;
  for (int e = tid; e < n_counters; e += blockDim.x) counters[e] = 0;
  int base = 0;
  for (int start = 0; start < n_words; start += blockDim.x) {
    const int w = start + tid;
    const unsigned bits = w < n_words ? words(w) : 0u;
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

// 2a. from a predictor's bitmask
extern "C" __global__ void __launch_bounds__(PI_COMPACT_THREADS) pi_compact(
    const unsigned* __restrict__ mask,  // [n_words]    bit b of word w: neuron 32 w + b fires
    int n_words,                        //              = ceil(n_hot / 32)
    int* __restrict__ idx,              // [n_hot]      out: the firing neurons, ascending
    int* __restrict__ count,            // [1]          out: how many
    int* __restrict__ counters,         // [n_counters] out: zeros
    int n_counters)                     //              counters to zero
{
  pi_compact_body(PiMaskWords{mask}, n_words, idx, count, counters, n_counters);
}

// 2b. from a bool mask, a neuron firing when it is on for any token
extern "C" __global__ void __launch_bounds__(PI_COMPACT_THREADS) pi_compact_mask(
    const unsigned char* __restrict__ mask,  // [T, stride]   bool, n used per row
    int T,                                   //               tokens
    int n,                                   //               neurons
    int stride,                              //               bytes between rows (>= n)
    int* __restrict__ idx,                   // [n]           out: the firing neurons, ascending
    int* __restrict__ count,                 // [1]           out: how many
    int* __restrict__ counters,              // [n_counters]  out: zeros
    int n_counters)                          //               counters to zero
{
  pi_compact_body(PiMaskBytes{mask, T, n, stride}, (n + PI_WARP - 1) / PI_WARP, idx, count,
                  counters, n_counters);
}

// ---- 3. gate / up GEMV over the listed rows, activation fused; one warp per listed row. ----
// V: the variant (format, gated, drelu, bias, relu, threshold, act), a PiVariant.
template <class V, int MAXT>
__device__ __forceinline__ void pi_gate_up_body(
    const typename V::Fmt::elem* __restrict__ x, const typename V::Rows::elem* __restrict__ w_gate,
    const typename V::Rows::elem* __restrict__ w_up, const typename V::Fmt::elem* __restrict__ b_gate,
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
    float a[MAXT];  // gated: act(gate x + b_gate)
#pragma unroll
    for (int t = 0; t < MAXT; ++t) a[t] = 0.0f;
    bool need_up = true;
    if (V::gated) {
      float g[MAXT];
#pragma unroll
      for (int t = 0; t < MAXT; ++t) g[t] = 0.0f;
      V::Rows::template dot<MAXT>(w_gate, j, x, T, d, vec, lane, g);
      const float bg = V::bias ? F::widen(__ldg(b_gate + j)) : 0.0f;
      bool any = false;
#pragma unroll
      for (int t = 0; t < MAXT; ++t) {
        if (t < T) {
          a[t] = V::act(pi_warp_sum(g[t]) + bg);
          any = any || a[t] != 0.0f;
        }
      }
      // ReLU (ReLU^2) gate zero for every token: h = 0 exactly, the up row is never read.
      need_up = any || !V::relu;
    }
    float u[MAXT];
#pragma unroll
    for (int t = 0; t < MAXT; ++t) u[t] = 0.0f;
    if (need_up) V::Rows::template dot<MAXT>(w_up, j, x, T, d, vec, lane, u);
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
// R: the rows' format (PiRows<F>, or PiQRows for q8_0 rows), F: b_down's.
// Grid (column slices, row ranges). A block owns PI_DOWN_THREADS * R::VEC columns (R::VEC per
// thread, one 16-byte load per float row) and one contiguous range of the list, walked in tiles of
// PI_DOWN_THREADS entries: the tile's idx / h are staged in shared memory, keeping only rows with
// a nonzero h for some token (ballot, order kept), so the row loads of the inner loop depend on
// nothing but shared memory and pipeline. One range: the block writes out itself. Several: each
// writes its partial sums, and the last block of a column slice to finish (a count of arrivals,
// zeroed beforehand) adds them up in range order and writes out: no atomics on the sums, no
// race, the same sum whichever block comes last, and no launch of a reduction kernel.
template <class R, class F, int MAXT>
__device__ __forceinline__ void pi_down_body(
    const float* __restrict__ h, int h_stride, const int* __restrict__ idx,
    const int* __restrict__ count, const typename R::elem* __restrict__ w_down_t,
    const typename F::elem* __restrict__ b_down, float* __restrict__ out,
    float* __restrict__ partial, int* __restrict__ arrive, int T, int d, int vec,
    int accumulate) {
  __shared__ int s_row[PI_DOWN_THREADS];
  __shared__ float s_h[MAXT][PI_DOWN_THREADS];
  __shared__ int s_warp[PI_DOWN_THREADS / PI_WARP];
  const int tid = threadIdx.x, lane = tid & (PI_WARP - 1), wid = tid / PI_WARP;
  const int col0 = (blockIdx.x * PI_DOWN_THREADS + tid) * R::VEC;
  const bool has_cols = col0 < d;
  const int m = *count;
  const int per_range = (m + gridDim.y - 1) / gridDim.y;
  const int begin = min(m, (int)blockIdx.y * per_range);
  const int end = min(m, begin + per_range);

  float acc[MAXT][R::VEC];
#pragma unroll
  for (int t = 0; t < MAXT; ++t)
#pragma unroll
    for (int k = 0; k < R::VEC; ++k) acc[t][k] = 0.0f;

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
      // acc[t][:] += h[t] * row q's columns, for each token
      auto add_row = [&](int q, const float* w) {
#pragma unroll
        for (int t = 0; t < MAXT; ++t) {
          if (t < T) {
            const float ht = s_h[t][q];
#pragma unroll
            for (int k = 0; k < R::VEC; ++k) acc[t][k] = fmaf(ht, w[k], acc[t][k]);
          }
        }
      };
      if (vec) {
#pragma unroll 4
        for (int q = 0; q < n_keep; ++q) {
          float w[R::VEC];
          R::cols_vec(w_down_t, s_row[q], d, col0, w);
          add_row(q, w);
        }
      } else {
        for (int q = 0; q < n_keep; ++q) {
          float w[R::VEC];
          R::cols_any(w_down_t, s_row[q], d, col0, w);
          add_row(q, w);
        }
      }
    }
    __syncthreads();  // s_row / s_h / s_warp are rewritten by the next tile
  }

  const int n_split = gridDim.y;
  if (n_split > 1) {
    __shared__ int s_last;
    if (has_cols) {
#pragma unroll
      for (int t = 0; t < MAXT; ++t)
#pragma unroll
        for (int k = 0; k < R::VEC; ++k)
          if (t < T && col0 + k < d)
            partial[((size_t)blockIdx.y * T + t) * d + col0 + k] = acc[t][k];
    }
    __threadfence();  // the partial sums reach the device's memory before the block counts in
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(arrive + blockIdx.x, 1) == n_split - 1;
    __syncthreads();
    if (!s_last) return;
    if (tid == 0) arrive[blockIdx.x] = 0;  // every block of the slice has counted in: ready again
    __threadfence();
    // the last block of the slice: acc = the ranges' partial sums, added in range order (L2
    // loads: the other blocks' writes are not in this SM's L1)
    if (has_cols) {
#pragma unroll
      for (int t = 0; t < MAXT; ++t)
#pragma unroll
        for (int k = 0; k < R::VEC; ++k) acc[t][k] = 0.0f;
      for (int s = 0; s < n_split; ++s) {
#pragma unroll
        for (int t = 0; t < MAXT; ++t)
#pragma unroll
          for (int k = 0; k < R::VEC; ++k)
            if (t < T && col0 + k < d)
              acc[t][k] += __ldcg(partial + ((size_t)s * T + t) * d + col0 + k);
      }
    }
  }
  if (!has_cols) return;
#pragma unroll
  for (int t = 0; t < MAXT; ++t) {
    if (t < T) {
#pragma unroll
      for (int k = 0; k < R::VEC; ++k) {
        const int c = col0 + k;
        if (c < d) {
          float v = acc[t][k];
          if (b_down != 0) v += F::widen(__ldg(b_down + c));
          if (accumulate) v += out[(size_t)t * d + c];
          out[(size_t)t * d + c] = v;
        }
      }
    }
  }
}

// The activations (act.h numbers them), fp32, as torch computes them: F.relu, F.silu, F.gelu,
// F.gelu(approximate="tanh"), F.relu(v) ** 2.
template <int ACT>
__device__ __forceinline__ float pi_act(float v);

template <>
__device__ __forceinline__ float pi_act<PIC_RELU>(float v) {
  return fmaxf(v, 0.0f);
}

template <>
__device__ __forceinline__ float pi_act<PIC_SILU>(float v) {
  return v / (1.0f + expf(-v));  // v * sigmoid(v); -inf -> -0, +inf -> v
}

template <>
__device__ __forceinline__ float pi_act<PIC_GELU>(float v) {
  return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));  // erf GELU
}

template <>
__device__ __forceinline__ float pi_act<PIC_GELU_TANH>(float v) {
  const float k = 0.79788456080286536f;  // sqrt(2 / pi)
  return 0.5f * v * (1.0f + tanhf(k * (v + 0.044715f * v * v * v)));
}

template <>
__device__ __forceinline__ float pi_act<PIC_RELU2>(float v) {
  const float r = fmaxf(v, 0.0f);
  return r * r;
}

// A variant of the gate / up kernels, everything about it a compile-time constant (the kernel
// bodies branch on these, and the branches compile away). ffn_cuda_variant.cuh instantiates it.
template <class F, class R, bool GATED, bool DRELU, bool BIAS, int ACT, bool THRESHOLD>
struct PiVariant {
  typedef F Fmt;                            // x and the biases
  typedef R Rows;                           // the gate / up rows: PiRows<F>, or PiQRows
  static const bool gated = GATED;          // h = act(gate x + b_gate) * u  (else act(up x + b_up))
  static const bool drelu = DRELU;          // u = relu(up x + b_up)         (else u = up x + b_up)
  static const bool bias = BIAS;            // b_gate / b_up are read
  static const bool relu = PIC_ZERO_BELOW(ACT); // ReLU or ReLU^2: a zero gate skips the up row
  static const bool threshold = THRESHOLD;  // active iff |h| > threshold (else iff h != 0)
  static __device__ __forceinline__ float act(float v) { return pi_act<ACT>(v); }
};

#endif  // PICOMPILE_CUDA_PRELUDE
