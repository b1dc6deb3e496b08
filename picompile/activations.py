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

# Hugging Face activation modules (transformers.activations) that compute one of the above by
# another formula: traced through, they would be a chain of mul / tanh / pow that no pattern
# matches, so capture keeps them whole and detect reads them by class. NewGELU and FastGELU are
# GELU's tanh approximation written out (GPT-2, Phi-1/2, ...), equal to F.gelu(approximate="tanh")
# up to float rounding.
MODULE_ACTIVATIONS = {
    "NewGELUActivation": "gelu_tanh",
    "FastGELUActivation": "gelu_tanh",
}


def module_activation(module) -> str | None:
    """The activation a Hugging Face activation module computes, by our names, or None."""
    cls = type(module)
    if cls.__module__.startswith("transformers."):
        return MODULE_ACTIVATIONS.get(cls.__name__)
    return None
