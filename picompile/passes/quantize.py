"""Quantization: the weights the kernels read, in GGUF's block formats (picompile/quant.py).

    notes = quantize_ffns(ffns, "q4_0")                    # before the blocks pick kernels
    paths, notes = quantize_linears(model, "q4_0")         # after the lowering pass

Runs last, after calibration, profiling, predictor training and placement (they measure the
float model), just before kernels are picked: every FFN block (SparseFFN.quantize_: its gate,
up and down rows, one neuron's row contiguous) and every linear layer the lowering pass made a
DenseLinear (attention projections, the LM head: QuantLinear) whose input width is a multiple
of the block size. Embeddings, norms and biases stay float (an embedding reads one row per
token; biases are added in float32). What cannot be quantized stays float, named in the notes.
"""

from __future__ import annotations

from torch import nn

from picompile import quant
from picompile.runtime import dense_linear


def quantize_ffns(ffns: dict, fmt: str) -> list[str]:
    """Quantize the FFN blocks to `fmt` in place (before their kernels are picked). -> notes on
    the blocks that stay float, and why."""
    quant.format_of(fmt)  # an unknown format fails before anything changes
    notes = []
    for name, ffn in ffns.items():
        why = quant.why_not_quantizable((ffn.n_ff, ffn.d_model))
        if why is None:
            ffn.quantize_(fmt)
        else:
            notes.append(f"{name}: stays {str(ffn.w_up.dtype).removeprefix('torch.')}: {why}")
    return notes


def quantize_linears(model: nn.Module, fmt: str) -> tuple[dict[str, str], list[str]]:
    """Replace every DenseLinear under `model` whose width allows it with a QuantLinear of
    `fmt` (after the lowering pass). -> ({qualified name: kernel path} of the replaced layers,
    notes on the layers that stay float, and why)."""
    quant.format_of(fmt)
    paths, notes = {}, []
    replaced: dict = {}  # a layer under several names is quantized once
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent._modules.items()):
            if not isinstance(child, dense_linear.DenseLinear):
                continue
            qual = f"{prefix}.{name}" if prefix else name
            why = quant.why_not_quantizable((child.out_features, child.in_features))
            if why is not None:
                notes.append(f"{qual}: stays float: {why}")
                continue
            if id(child) not in replaced:
                replaced[id(child)] = dense_linear.QuantLinear.from_linear(child, fmt)
            setattr(parent, name, replaced[id(child)])
            paths[qual] = replaced[id(child)].path
    return paths, notes
