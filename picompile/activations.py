"""The activations picompile compiles: one table for the plan (which names a block's activation)
and for the C and CUDA kernel generators (which select it per variant by macro).

It lives outside `codegen` so that plan.py can import it: data flows plan -> codegen, never back.
"""

# name -> the macro that selects it in the kernel sources: picompile/kernels/act.h numbers the
# macros; ffn.c (act_fn) and ffn_cuda.cuh (pi_act) implement them in fp32, as torch computes
# F.relu, F.silu, F.gelu and F.gelu(approximate="tanh").
ACT_MACROS = {
    "relu": "PIC_RELU",
    "silu": "PIC_SILU",
    "gelu": "PIC_GELU",
    "gelu_tanh": "PIC_GELU_TANH",
}
ACTIVATIONS = tuple(ACT_MACROS)
