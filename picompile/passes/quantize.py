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

Two kinds of weights get more bits than the format asks for (the notes say so):
- with a 4-bit format (q4_0, q4_1) the LM head (the model's output embeddings) is q8_0, as
  llama.cpp keeps its output layer at higher precision;
- the FFN down rows of a 4-bit block are q8_0: the kernels read a neuron's down row along d
  (down_proj's input dimension is n_ff, which is what llama.cpp blocks), and 4-bit blocks along
  d cost far more than along n_ff (SmolLM2's Q4_1 file with its down rows in q4_1 along d:
  +7.8% perplexity, where llama.cpp on the same file loses 0.5%; its float weights at q4_0
  everywhere: +29.5%, with q8_0 down rows +16.9%, llama.cpp's Q4_0 +23.8%; BENCHMARKS.md). In
  "gguf" mode that means the file's 4-bit down_proj is quantized again from its float values.
"""

from __future__ import annotations

from torch import nn

from picompile import gguf_weights, quant
from picompile.runtime.dense_linear import DenseLinear, QuantLinear

FOUR_BIT = ("q4_0", "q4_1")
HIGH_PRECISION = "q8_0"  # the LM head and the FFN down rows under a 4-bit format


def ffn_formats(fmt: str) -> tuple[str, str]:
    """(gate / up rows' format, down rows' format) of a block quantized to `fmt` (see the module
    doc: 4-bit blocks keep their down rows at q8_0)."""
    return fmt, HIGH_PRECISION if fmt in FOUR_BIT else fmt


def planned_ffn_formats(ffns: dict, fmt: str | None, gguf_path=None) -> dict[str, tuple[str, str]]:
    """{block name: ffn_formats} of the blocks quantize_ffns will quantize (for placement, which
    runs before it); blocks that will stay float are left out. fmt "gguf": each block's up
    projection's format in the file at `gguf_path`."""
    if fmt is None:
        return {}
    file_formats = gguf_weights.formats(gguf_path) if fmt == "gguf" else None
    out = {}
    for name, ffn in ffns.items():
        if quant.why_not_quantizable((ffn.n_ff, ffn.d_model)) is not None:
            continue
        block_fmt = fmt
        if file_formats is not None:
            block_fmt = file_formats.get(_module_names(ffn).get("up", ""))
            if block_fmt is None:
                continue
        out[name] = ffn_formats(block_fmt)
    return out


def _module_names(ffn) -> dict[str, str]:
    """{role: the model's module name} of a block's linears ("up": "model.layers.0.mlp.up_proj")."""
    return {role: f"{ffn.block.module}.{attr}" if ffn.block.module else attr
            for role, attr in ffn.block.linears.items()}


def quantize_ffns(ffns: dict, fmt: str, file_blocks: dict | None = None) -> list[str]:
    """Quantize the FFN blocks to `fmt` in place (before their kernels are picked). With
    `file_blocks` (gguf_weights.read: fmt "gguf"), each block takes its up projection's format
    from the file, and the gate and up rows are the file's own blocks (in the block's neuron
    order); the down rows, which the file stores along the other axis, are quantized again.
    Down rows of a 4-bit block are q8_0 (see the module doc).
    -> notes on the blocks that stay float, and why, and on the down rows' format."""
    notes = []
    requantized_down = 0  # blocks whose 4-bit down rows went to q8_0
    for name, ffn in ffns.items():
        why = quant.why_not_quantizable((ffn.n_ff, ffn.d_model))
        modules = _module_names(ffn)
        block_fmt = fmt
        if file_blocks is not None:
            up = file_blocks.get(modules.get("up", ""))
            block_fmt = up.fmt if up is not None else None
            why = why or (None if up is not None else "float in the GGUF file")
        if why is not None:
            notes.append(f"{name}: stays {str(ffn.w_up.dtype).removeprefix('torch.')}: {why}")
            continue
        block_fmt, down_fmt = ffn_formats(block_fmt)
        requantized_down += down_fmt != block_fmt
        ffn.quantize_(block_fmt, down_fmt)
        for role in ("gate", "up"):
            blocks = (file_blocks or {}).get(modules.get(role, ""))
            if blocks is None or blocks.data is None or blocks.fmt != block_fmt:
                continue  # quantized from the float weights above
            gguf_weights.check_fits(blocks, ffn.n_ff, ffn.d_model, modules[role])
            rows = blocks.data if ffn.order is None else blocks.data[ffn.order]
            getattr(ffn, f"w_{role}").data.copy_(quant.interleave_blocks(rows, block_fmt))
    if requantized_down:
        how = ("re-quantized to", " (the file blocks them along n_ff)") if file_blocks is not None \
            else ("in", " (4-bit blocks along d lose far more than along n_ff)")
        notes.append(f"FFN down rows of {requantized_down} 4-bit blocks {how[0]} "
                     f"{HIGH_PRECISION} along d{how[1]}")
    return notes


def quantize_linears(model: nn.Module, fmt: str, file_blocks: dict | None = None,
                     ) -> tuple[dict[str, str], list[str]]:
    """Replace every DenseLinear under `model` whose width allows it with a QuantLinear of
    `fmt` (after the lowering pass; the LM head q8_0 where `fmt` is 4-bit, see the module doc).
    With `file_blocks` (fmt "gguf"), each layer takes the file's format and its own blocks;
    layers float in the file stay float. -> ({qualified name: kernel path} of the replaced
    layers, notes on the layers that stay float, and why, and on the LM head's format)."""
    paths, notes = {}, []
    replaced: dict[int, QuantLinear] = {}  # a layer under several names is quantized once
    head = None  # the LM head, when a 4-bit format keeps it at q8_0
    if file_blocks is None and fmt in FOUR_BIT and hasattr(model, "get_output_embeddings"):
        head = model.get_output_embeddings()
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
                layer_fmt = fmt if blocks is None else blocks.fmt
                if child is head:
                    layer_fmt = HIGH_PRECISION
                    notes.append(f"{qual}: the LM head, {HIGH_PRECISION} (not {fmt}), as "
                                 "llama.cpp keeps its output layer")
                replaced[id(child)] = QuantLinear.from_linear(child, layer_fmt)
                if blocks is not None and blocks.data is not None:
                    gguf_weights.check_fits(blocks, child.out_features, child.in_features, qual)
                    replaced[id(child)].load_row_blocks(blocks.data)
            setattr(parent, name, replaced[id(child)])
            paths[qual] = replaced[id(child)].path
    return paths, notes
