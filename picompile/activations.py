"""The activations picompile compiles: one table for the plan (which names a block's activation)
and for the C and CUDA kernel generators (which select it per variant by macro).

It lives outside `codegen` so that plan.py can import it: data flows plan -> codegen, never back.
"""

# name -> the macro that selects it in the kernel sources: picompile/kernels/act.h numbers the
# macros; ffn.c (act_fn) and ffn_cuda.cuh (pi_act) implement them in fp32, as torch computes
# F.relu, F.silu, F.gelu, F.gelu(approximate="tanh") and F.relu(v) ** 2 (squared ReLU: Primer,
# Nemotron, Arcee, nanochat).
ACT_MACROS = {
    "relu": "PIC_RELU",
    "silu": "PIC_SILU",
    "gelu": "PIC_GELU",
    "gelu_tanh": "PIC_GELU_TANH",
    "relu2": "PIC_RELU2",
}
ACTIVATIONS = tuple(ACT_MACROS)

# The activations that are exactly zero wherever their input is <= 0: a block of them skips its
# zero neurons losslessly (exact mode needs no threshold), and a gated block can leave the up
# row of a neuron unread when its gate is <= 0.
ZERO_BELOW = frozenset({"relu", "relu2"})


def zero_below(act: str) -> bool:
    """Whether `act` is zero exactly where its input is <= 0 (ReLU and squared ReLU)."""
    return str(act) in ZERO_BELOW

# Hugging Face activation modules, by class: capture keeps them whole (traced through, GELU's
# tanh approximation written out would be a chain of mul / tanh / pow that no pattern matches,
# and an unknown one would say nothing), detect reads the ones below by class and names the
# others as unsupported. NewGELU, FastGELU, AccurateGELU and Bloom's are GELU's tanh
# approximation (GPT-2, GPT-J, Phi-1/2, Bloom), equal to F.gelu(approximate="tanh") up to float
# rounding.
MODULE_ACTIVATIONS = {
    "GELUActivation": "gelu",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "NewGELUActivation": "gelu_tanh",
    "FastGELUActivation": "gelu_tanh",
    "AccurateGELUActivation": "gelu_tanh",
    "SiLUActivation": "silu",
    "BloomGelu": "gelu_tanh",
    "ReLUSquaredActivation": "relu2",
}


def library_activation(module) -> bool:
    """An activation module of Hugging Face's (transformers.activations, or one named above)."""
    cls = type(module)
    return cls.__module__ == "transformers.activations" or (
        cls.__module__.startswith("transformers.") and cls.__name__ in MODULE_ACTIVATIONS)


def module_activation(module) -> str | None:
    """The activation a Hugging Face activation module computes, by our names, or None."""
    return MODULE_ACTIVATIONS.get(type(module).__name__) if library_activation(module) else None
