"""Quantization: the weights the kernels read, in GGUF's block formats (picompile/quant.py).

    notes = quantize_ffns(ffns, "q4_0")                    # before the blocks pick kernels
    paths, notes = quantize_linears(model, "q4_0")         # after the lowering pass
    blocks, notes = gguf_weights.read(path, model.config)  # fmt "gguf": the file's own blocks

Runs last, after calibration, profiling, predictor training and placement (they measure the
float model), just before kernels are picked: every FFN block (SparseFFN.quantize_: its gate,
up and down rows, one neuron's row contiguous) and every linear layer the lowering pass made a
DenseLinear (attention projections, the LM head: QuantLinear) whose input width is a multiple
of the block size. Embeddings, norms and biases stay float (an embedding reads one row per
token; biases are added in float32). What cannot be quantized stays float, named in the notes.
"""

from __future__ import annotations

from torch import nn

from picompile import gguf_weights, quant
from picompile.runtime.dense_linear import DenseLinear, QuantLinear


def quantize_ffns(ffns: dict, fmt: str, file_blocks: dict | None = None) -> list[str]:
    """Quantize the FFN blocks to `fmt` in place (before their kernels are picked). With
    `file_blocks` (gguf_weights.read: fmt "gguf"), each block takes its up projection's format
    from the file, and the gate and up rows are the file's own blocks (in the block's neuron
    order); the down rows, which the file stores along the other axis, are quantized again.
    -> notes on the blocks that stay float, and why."""
    notes = []
    for name, ffn in ffns.items():
        why = quant.why_not_quantizable((ffn.n_ff, ffn.d_model))
        modules = {role: f"{ffn.block.module}.{attr}" if ffn.block.module else attr
                   for role, attr in ffn.block.linears.items()}
        block_fmt = fmt
        if file_blocks is not None:
            up = file_blocks.get(modules.get("up", ""))
            block_fmt = up.fmt if up is not None else None
            why = why or (None if up is not None else "float in the GGUF file")
        if why is not None:
            notes.append(f"{name}: stays {str(ffn.w_up.dtype).removeprefix('torch.')}: {why}")
            continue
        ffn.quantize_(block_fmt)
        for role in ("gate", "up"):
            blocks = (file_blocks or {}).get(modules.get(role, ""))
            if blocks is None or blocks.data is None or blocks.fmt != block_fmt:
                continue  # quantized from the float weights above
            gguf_weights.check_fits(blocks, ffn.n_ff, ffn.d_model, modules[role])
            rows = blocks.data if ffn.order is None else blocks.data[ffn.order]
            getattr(ffn, f"w_{role}").data.copy_(rows)
    return notes


def quantize_linears(model: nn.Module, fmt: str, file_blocks: dict | None = None,
                     ) -> tuple[dict[str, str], list[str]]:
    """Replace every DenseLinear under `model` whose width allows it with a QuantLinear of
    `fmt` (after the lowering pass). With `file_blocks` (fmt "gguf"), each layer takes the file's
    format and its own blocks; layers float in the file stay float. -> ({qualified name: kernel
    path} of the replaced layers, notes on the layers that stay float, and why)."""
    paths, notes = {}, []
    replaced: dict[int, QuantLinear] = {}  # a layer under several names is quantized once
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent._modules.items()):
            if not isinstance(child, DenseLinear):
                continue
            qual = f"{prefix}.{name}" if prefix else name
            why = quant.why_not_quantizable((child.out_features, child.in_features))
            blocks = None if file_blocks is None else file_blocks.get(qual)
            if why is None and file_blocks is not None and blocks is None:
                why = "float in the GGUF file"
            if why is not None:
                notes.append(f"{qual}: stays float: {why}")
                continue
            if id(child) not in replaced:
                replaced[id(child)] = QuantLinear.from_linear(
                    child, fmt if blocks is None else blocks.fmt)
                if blocks is not None and blocks.data is not None:
                    gguf_weights.check_fits(blocks, child.out_features, child.in_features, qual)
                    replaced[id(child)].qweight.copy_(blocks.data)
            setattr(parent, name, replaced[id(child)])
            paths[qual] = replaced[id(child)].path
    return paths, notes
