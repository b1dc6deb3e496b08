// picompile CUDA kernels of one weight dtype: predictor and down projection.
// Package data: picompile/codegen/cuda.py includes it once per dtype, after ffn_cuda.cuh, with
//   PI_DT   the dtype's short name, the suffix of the kernel names (f16, bf16, f32)
//   PI_FMT  its number format (PiF16, PiBF16, PiF32), VEC elements per 16-byte load: x, the
//           predictor, b_down
//   PI_ROWS the down rows' format: PiRows<PI_FMT>, or PiQRows<PQD_Q8_0, 0> (q8_0 rows)
// defined; it undefines them at the end.

// 1a. predictor layer 1, batch-1 decode (T = 1) and small batch (T <= 8). Grid-stride, 1 warp/row.
extern "C" __global__ void __launch_bounds__(PI_WARPS_PER_BLOCK * PI_WARP)
PI_CAT(pi_pred_hidden_1_, PI_DT)(
    const PI_FMT::elem* __restrict__ x,    // [1, d]   the token
    const PI_FMT::elem* __restrict__ p1,   // [r, d]   predictor layer 1
    const PI_FMT::elem* __restrict__ pb1,  // [r]
    float* __restrict__ z,                 // [1, r]   out: relu(p1 x + pb1), fp32
    int T,                                 //          1 (the argument list is the batch one's)
    int d,                                 //          model width
    int r,                                 //          predictor rank
    int vec)                               //          1: 16-byte loads (d % VEC == 0, aligned)
{
  pi_pred_hidden_body<PI_FMT, 1>(x, p1, pb1, z, 1, d, r, vec);
}

extern "C" __global__ void __launch_bounds__(PI_WARPS_PER_BLOCK * PI_WARP)
PI_CAT(pi_pred_hidden_b_, PI_DT)(
    const PI_FMT::elem* __restrict__ x,    // [T, d]   the tokens
    const PI_FMT::elem* __restrict__ p1,   // [r, d]   predictor layer 1
    const PI_FMT::elem* __restrict__ pb1,  // [r]
    float* __restrict__ z,                 // [T, r]   out: relu(x p1^T + pb1), fp32
    int T,                                 //          tokens, 1..8
    int d,                                 //          model width
    int r,                                 //          predictor rank
    int vec)                               //          1: 16-byte loads (d % VEC == 0, aligned)
{
  pi_pred_hidden_body<PI_FMT, PI_MAXT>(x, p1, pb1, z, T, d, r, vec);
}

// 1b. predictor layer 2 + test: mask bit j = (p2[j] . z[t] + pb2[j] > tau for some t).
//     Dynamic shared memory: T * r * 4 bytes.
extern "C" __global__ void __launch_bounds__(PI_WARPS_PER_BLOCK * PI_WARP)
PI_CAT(pi_pred_mask_1_, PI_DT)(
    const float* __restrict__ z,           // [1, r]       from pi_pred_hidden
    const PI_FMT::elem* __restrict__ p2,   // [n_hot, r]   predictor layer 2, hot rows
    const PI_FMT::elem* __restrict__ pb2,  // [n_hot]
    float tau,                             //              fire iff logit > tau
    unsigned* __restrict__ mask,           // [ceil(n_hot / 32)]  out: firing bits
    int T,                                 //              1
    int r,                                 //              predictor rank, <= 1024
    int n_hot,                             //              hot neurons
    int vec)                               //              1: 16-byte loads (r % VEC == 0, aligned)
{
  pi_pred_mask_body<PI_FMT, 1>(z, p2, pb2, tau, mask, 1, r, n_hot, vec);
}

extern "C" __global__ void __launch_bounds__(PI_WARPS_PER_BLOCK * PI_WARP)
PI_CAT(pi_pred_mask_b_, PI_DT)(
    const float* __restrict__ z,           // [T, r]       from pi_pred_hidden
    const PI_FMT::elem* __restrict__ p2,   // [n_hot, r]   predictor layer 2, hot rows
    const PI_FMT::elem* __restrict__ pb2,  // [n_hot]
    float tau,                             //              fire iff logit > tau (union over tokens)
    unsigned* __restrict__ mask,           // [ceil(n_hot / 32)]  out: firing bits
    int T,                                 //              tokens, 1..8
    int r,                                 //              predictor rank, <= 1024
    int n_hot,                             //              hot neurons
    int vec)                               //              1: 16-byte loads (r % VEC == 0, aligned)
{
  pi_pred_mask_body<PI_FMT, PI_MAXT>(z, p2, pb2, tau, mask, T, r, n_hot, vec);
}

// 4. down projection over the listed rows. Grid (ceil(d / (PI_DOWN_THREADS * PI_ROWS::VEC)),
//    n_split): with several row ranges, the last block of each column slice writes out.
extern "C" __global__ void __launch_bounds__(PI_DOWN_THREADS)
PI_CAT(pi_down_1_, PI_DT)(
    const float* __restrict__ h,                // [1, h_stride]  h of listed row i at [0, i], fp32
    int h_stride,                               //                row stride of h (>= count)
    const int* __restrict__ idx,                // [count]        listed rows of w_down_t
    const int* __restrict__ count,              // [1]            list length (device)
    const PI_ROWS::elem* __restrict__ w_down_t, // [n_rows, d]    down weights, one row per neuron
    const PI_FMT::elem* __restrict__ b_down,    // [d] or null
    float* __restrict__ out,                    // [1, d]         out, fp32
    float* __restrict__ partial,                // [n_split, 1, d] partial sums (n_split > 1)
    int* __restrict__ arrive,                   // [column slices] zeros (n_split > 1): arrivals
    int T,                                      //                1
    int d,                                      //                model width
    int vec,                                    //                1: 16-byte loads (d % VEC == 0)
    int accumulate)                             //                1: out += ..., 0: out = ...
{
  pi_down_body<PI_ROWS, PI_FMT, 1>(h, h_stride, idx, count, w_down_t, b_down, out, partial,
                                   arrive, 1, d, vec, accumulate);
}

extern "C" __global__ void __launch_bounds__(PI_DOWN_THREADS)
PI_CAT(pi_down_b_, PI_DT)(
    const float* __restrict__ h,                // [T, h_stride]  token t, listed row i at [t, i]
    int h_stride,                               //                row stride of h (>= count)
    const int* __restrict__ idx,                // [count]        listed rows of w_down_t
    const int* __restrict__ count,              // [1]            list length (device)
    const PI_ROWS::elem* __restrict__ w_down_t, // [n_rows, d]    down weights, one row per neuron
    const PI_FMT::elem* __restrict__ b_down,    // [d] or null
    float* __restrict__ out,                    // [T, d]         out, fp32
    float* __restrict__ partial,                // [n_split, T, d] partial sums (n_split > 1)
    int* __restrict__ arrive,                   // [column slices] zeros (n_split > 1): arrivals
    int T,                                      //                tokens, 1..8
    int d,                                      //                model width
    int vec,                                    //                1: 16-byte loads (d % VEC == 0)
    int accumulate)                             //                1: out += ..., 0: out = ...
{
  pi_down_body<PI_ROWS, PI_FMT, PI_MAXT>(h, h_stride, idx, count, w_down_t, b_down, out,
                                         partial, arrive, T, d, vec, accumulate);
}

#undef PI_DT
#undef PI_FMT
#undef PI_ROWS
