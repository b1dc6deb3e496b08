// picompile CUDA gate / up kernels of one variant. Package data: picompile/codegen/cuda.py
// includes it once per variant, after ffn_cuda.cuh, with
//   PI_TAG        the variant's tag (Variant.tag), the suffix of the kernel names
//   PI_FMT        the format of x and the biases (PiF16, PiBF16, PiF32)
//   PI_ROWS       the gate / up rows' format: PiRows<PI_FMT>, or PiQRows<PQD_*, dot> (quantized)
//   PI_GATED      1: h = act(gate x + b_gate) * u   0: h = act(up x + b_up)
//   PI_DRELU      1: u = relu(up x + b_up)          0: u = up x + b_up
//   PI_BIAS       1: b_gate / b_up are read
//   PI_ACT        PIC_RELU, PIC_SILU, PIC_GELU, PIC_GELU_TANH or PIC_RELU2 (act.h)
//   PI_THRESHOLD  1: active iff |h| > threshold     0: iff h != 0
// defined; it undefines them at the end.

#define PI_V PiVariant<PI_FMT, PI_ROWS, PI_GATED, PI_DRELU, PI_BIAS, PI_ACT, PI_THRESHOLD>

// 3. gate / up over the listed rows -> h, batch-1 decode (T = 1) and small batch (T <= 8).
//    Grid-stride: any grid works; one warp per listed row.
extern "C" __global__ void __launch_bounds__(PI_WARPS_PER_BLOCK * PI_WARP)
PI_CAT(pi_gate_up_1_, PI_TAG)(
    const PI_FMT::elem* __restrict__ x,       // [1, d]        the token
    const PI_ROWS::elem* __restrict__ w_gate, // [n_rows, d]   gate rows (unused when plain)
    const PI_ROWS::elem* __restrict__ w_up,   // [n_rows, d]   up rows
    const PI_FMT::elem* __restrict__ b_gate,  // [n_rows]      (read only with bias, gated)
    const PI_FMT::elem* __restrict__ b_up,    // [n_rows]      (read only with bias)
    const int* __restrict__ idx,              // [count]       listed rows
    const int* __restrict__ count,            // [1]           list length (device)
    float threshold,                          //               |h| > threshold (threshold variants)
    float* __restrict__ h,                    // [1, h_stride] out: listed row i at [0, i], fp32
    int* __restrict__ n_active,               // [1]           += active (token, neuron) pairs
    int T,                                    //               1
    int d,                                    //               model width
    int h_stride,                             //               row stride of h (>= count)
    int vec)                                  //               1: 16-byte loads (d % VEC == 0)
{
  pi_gate_up_body<PI_V, 1>(x, w_gate, w_up, b_gate, b_up, idx, count, threshold, h,
                           n_active, 1, d, h_stride, vec);
}

extern "C" __global__ void __launch_bounds__(PI_WARPS_PER_BLOCK * PI_WARP)
PI_CAT(pi_gate_up_b_, PI_TAG)(
    const PI_FMT::elem* __restrict__ x,       // [T, d]        the tokens
    const PI_ROWS::elem* __restrict__ w_gate, // [n_rows, d]   gate rows (unused when plain)
    const PI_ROWS::elem* __restrict__ w_up,   // [n_rows, d]   up rows
    const PI_FMT::elem* __restrict__ b_gate,  // [n_rows]      (read only with bias, gated)
    const PI_FMT::elem* __restrict__ b_up,    // [n_rows]      (read only with bias)
    const int* __restrict__ idx,              // [count]       listed rows (union over the tokens)
    const int* __restrict__ count,            // [1]           list length (device)
    float threshold,                          //               |h| > threshold (threshold variants)
    float* __restrict__ h,                    // [T, h_stride] out: token t, row i at [t, i], fp32
    int* __restrict__ n_active,               // [1]           += active (token, neuron) pairs
    int T,                                    //               tokens, 1..8
    int d,                                    //               model width
    int h_stride,                             //               row stride of h (>= count)
    int vec)                                  //               1: 16-byte loads (d % VEC == 0)
{
  pi_gate_up_body<PI_V, PI_MAXT>(x, w_gate, w_up, b_gate, b_up, idx, count, threshold,
                                 h, n_active, T, d, h_stride, vec);
}

#undef PI_V
#undef PI_TAG
#undef PI_FMT
#undef PI_ROWS
#undef PI_GATED
#undef PI_DRELU
#undef PI_BIAS
#undef PI_ACT
#undef PI_THRESHOLD
