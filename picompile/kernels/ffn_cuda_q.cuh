// picompile CUDA kernels' quantized rows: GGUF blocks (q8_0 / q4_0 / q4_1) dequantized in
// registers, fp32 accumulation. Package data: picompile/codegen/cuda.py includes it once, after
// ffn_cuda.cuh, in front of the quantized variants' parts; include-guarded.
//
// The block decoding is qdecode.h's (__host__ __device__; tests/test_quant_decode_host.py checks
// the same text on the CPU against picompile.quant). The rows are the CPU's as SparseFFN holds
// them: gate / up rows in the dot layout (quant.interleave_blocks), q8_0 down rows in GGUF's, so
// the hybrid runtime copies hot rows to the GPU unchanged.
//
// x: gate / up rows are dotted with x rounded per block of 32 (to 8 bits for the 4-bit formats,
// 16 for q8_0: quant.round_activations; pi_round_x makes it, as float32), as on the CPU, so the
// kernels match ffn_reference up to float summation order.
#ifndef PICOMPILE_CUDA_Q
#define PICOMPILE_CUDA_Q

#include "qdecode.h"

// Rows of GGUF blocks of format QF (PQD_Q8_0 / PQD_Q4_0 / PQD_Q4_1), DOT: rows in the dot
// layout. The same members as PiRows (ffn_cuda.cuh); x is float32.
template <int QF, int DOT>
struct PiQRows {
  typedef unsigned char elem;
  enum { VEC = 8,                         // down: columns per thread, all in one block of 32
         BB = PQD_BLOCK_BYTES(QF) };      // bytes per block
  // acc[t] += this lane's part of row j of w [n_rows, d / 32 * BB] . x[t] (x [T, d] fp32,
  // d % 32 == 0): lane l takes blocks l, l + 32, ..., decodes each once and dots it with every
  // token. vec: x's rows are 16-byte aligned (uint4 loads).
  template <int MAXT>
  static __device__ __forceinline__ void dot(const elem* __restrict__ w, int j, const float* x,
                                             int T, int d, int vec, int lane,
                                             float (&acc)[MAXT]) {
    const int nb = d / PQD_QK;
    const elem* row = w + (size_t)j * nb * BB;
    for (int b = lane; b < nb; b += PI_WARP) {
      float wv[PQD_QK];
      pqd_row_block(QF, row, nb, b, DOT, wv);
#pragma unroll
      for (int t = 0; t < MAXT; ++t) {
        if (t < T) {
          const float* xb = x + (size_t)t * d + b * PQD_QK;
          if (vec) {
#pragma unroll
            for (int q = 0; q < PQD_QK / 4; ++q) {
              float xv[4];
              PiF32::unpack(pi_ld16(xb + 4 * q), xv);
#pragma unroll
              for (int k = 0; k < 4; ++k) acc[t] = fmaf(wv[4 * q + k], xv[k], acc[t]);
            }
          } else {
#pragma unroll
            for (int k = 0; k < PQD_QK; ++k) acc[t] = fmaf(wv[k], xb[k], acc[t]);
          }
        }
      }
    }
  }
  // out [VEC] = columns col0 .. col0 + VEC - 1 of row j of q8_0 rows w [n_rows, d / 32 * 34]
  // (col0 % VEC == 0 and d % 32 == 0: inside one block, all below d). Byte loads: no alignment.
  static __device__ __forceinline__ void cols_vec(const elem* __restrict__ w, int j, int d,
                                                  int col0, float* out) {
    pqd_q8_0_run(w + (size_t)j * (d / PQD_QK) * BB, col0, VEC, out);
  }
  static __device__ __forceinline__ void cols_any(const elem* __restrict__ w, int j, int d,
                                                  int col0, float* out) {
    cols_vec(w, j, d, col0, out);
  }
};

// Dense linear layers on quantized rows (ffn_cuda_qlinear.cuh's kernels): y [T, o] = xr [T, k]
// . w [o, k]^T (+ bias [o]), w's rows of QF in the dot layout, fp32. One warp per output row
// (grid-stride), each lane decoding blocks lane, lane + 32, ... once for every token: the
// gate / up kernels' row dot, here over all rows in order.
template <int QF, int MAXT>
__device__ __forceinline__ void pi_qlinear_body(
    const unsigned char* __restrict__ w, const float* __restrict__ xr,
    const float* __restrict__ bias, float* __restrict__ y, int T, int k, int o, int vec) {
  const int lane = threadIdx.x & (PI_WARP - 1);
  const int first = (blockIdx.x * blockDim.x + threadIdx.x) / PI_WARP;
  const int step = (gridDim.x * blockDim.x) / PI_WARP;
  for (int j = first; j < o; j += step) {  // warp-uniform
    float acc[MAXT];
#pragma unroll
    for (int t = 0; t < MAXT; ++t) acc[t] = 0.0f;
    PiQRows<QF, 1>::template dot<MAXT>(w, j, xr, T, k, vec, lane, acc);
    const float b = bias != nullptr ? __ldg(bias + j) : 0.0f;
#pragma unroll
    for (int t = 0; t < MAXT; ++t) {
      if (t < T) {
        const float s = pi_warp_sum(acc[t]) + b;
        if (lane == 0) y[(size_t)t * o + j] = s;
      }
    }
  }
}

// x [T, d] fp32 -> xr [T, d]: x rounded per block of 32 to `levels` (127: 8 bits, 32767: 16)
// and back to float32, bit for bit quant.round_activations; one thread per block (grid-stride).
extern "C" __global__ void __launch_bounds__(256) pi_round_x(
    const float* __restrict__ x,  // [T, d]  the tokens, fp32, d % 32 == 0
    float* __restrict__ xr,       // [T, d]  out: rounded
    int n_blocks,                 //         T * d / 32
    float levels)                 //         127 or 32767
{
  for (int b = blockIdx.x * blockDim.x + threadIdx.x; b < n_blocks; b += gridDim.x * blockDim.x)
    pqd_round_block(x + (size_t)b * PQD_QK, levels, xr + (size_t)b * PQD_QK);
}

#endif  // PICOMPILE_CUDA_Q
