// picompile CUDA dense linear layers on quantized rows: y = x' W^T (+ bias), W's rows GGUF blocks
// (q8_0 / q4_0 / q4_1) in the dot layout, as runtime.dense_linear.QuantLinear holds them.
// Package data: picompile/codegen/cuda.py includes it once per quantized format of a
// translation unit, after ffn_cuda.cuh and ffn_cuda_q.cuh, with
//   PI_QTAG  the format's name (q8_0, q4_0, q4_1): the suffix of the kernel names
//   PI_QF    its qdecode.h code (PQD_Q8_0, PQD_Q4_0, PQD_Q4_1)
// defined; it undefines them at the end.
//
// x' is x rounded per block of 32 as the format reads it (pi_round_x, quant.round_activations),
// so the result is QuantLinear.forward_native's up to float summation order. The body,
// pi_qlinear_body, is ffn_cuda_q.cuh's (once per translation unit).

// One token (the token loops compile away).
extern "C" __global__ void __launch_bounds__(PI_WARPS_PER_BLOCK * PI_WARP)
PI_CAT(pi_qlinear_1_, PI_QTAG)(
    const unsigned char* __restrict__ w,  // [o, k / 32 * block bytes]  rows, dot layout
    const float* __restrict__ xr,         // [1, k]  the token, rounded (pi_round_x), fp32
    const float* __restrict__ bias,       // [o] fp32, or null
    float* __restrict__ y,                // [1, o]  out, fp32
    int T,                                //         1
    int k,                                //         input features, k % 32 == 0
    int o,                                //         output features (rows)
    int vec)                              //         1: xr 16-byte aligned (uint4 loads)
{
  pi_qlinear_body<PI_QF, 1>(w, xr, bias, y, 1, k, o, vec);
}

// 2..8 tokens: each row decoded once for all of them.
extern "C" __global__ void __launch_bounds__(PI_WARPS_PER_BLOCK * PI_WARP)
PI_CAT(pi_qlinear_b_, PI_QTAG)(
    const unsigned char* __restrict__ w,  // [o, k / 32 * block bytes]  rows, dot layout
    const float* __restrict__ xr,         // [T, k]  the tokens, rounded, fp32
    const float* __restrict__ bias,       // [o] fp32, or null
    float* __restrict__ y,                // [T, o]  out, fp32
    int T,                                //         tokens, 1..8
    int k,                                //         input features, k % 32 == 0
    int o,                                //         output features (rows)
    int vec)                              //         1: xr 16-byte aligned (uint4 loads)
{
  pi_qlinear_body<PI_QF, PI_MAXT>(w, xr, bias, y, T, k, o, vec);
}

#undef PI_QTAG
#undef PI_QF
