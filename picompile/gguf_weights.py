"""A GGUF file's quantized tensors, as picompile's kernels read them: compile(..., gguf=FILE).

transformers loads a GGUF model by dequantizing every tensor to float; this module reads the same
file again with the `gguf` package (memory-mapped, one tensor at a time) so that the quantize pass
can put each tensor's own blocks back instead of quantizing the float copy a second time:

    blocks = read(path, config)   # {"model.layers.0.mlp.up_proj": Blocks("q4_1", uint8 [rows, row_bytes]), ...}

Q8_0, Q4_0 and Q4_1 tensors are kept as they are (picompile/quant.py uses GGUF's block layout;
q and k of Llama models get the same row permutation transformers applies, whole rows so whole
blocks). Other quantized types (K-quants, Q5_x, ...) map to the nearest supported format
(`nearest_format`), re-quantized from the float weights by the caller, with a note. Float
tensors (F32, F16, BF16) are not listed: they stay float.

Only the Llama architecture family's tensor names are mapped here (what picompile's decoder runs:
Llama, SmolLM, Mistral, Qwen2 files all say "llama" or use its names); for other files `read`
returns {} and a note, and compile quantizes from the float weights instead.
"""

from __future__ import annotations

import pathlib
import re
from dataclasses import dataclass

import numpy as np
import torch

from picompile import quant

KEPT = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}  # GGUF type -> picompile format
# Everything else that is quantized: the nearest format of at least its precision.
NEAREST = {"Q4_K": "q4_1", "IQ4_NL": "q4_1", "IQ4_XS": "q4_1", "Q2_K": "q4_0", "Q3_K": "q4_0",
           "IQ2_XXS": "q4_0", "IQ2_XS": "q4_0", "IQ2_S": "q4_0", "IQ3_XXS": "q4_0", "IQ3_S": "q4_0",
           "IQ1_S": "q4_0", "IQ1_M": "q4_0", "Q5_0": "q8_0", "Q5_1": "q8_0", "Q5_K": "q8_0",
           "Q6_K": "q8_0", "Q8_1": "q8_0", "Q8_K": "q8_0"}
FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}
ARCHITECTURES = ("llama", "mistral", "qwen2")

_LAYER_TENSORS = {  # GGUF blk.N.<name> -> the HF module under model.layers.N
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass
class Blocks:
    """One tensor of the file: `fmt` its picompile format; `data` uint8 [rows, row_bytes] in the
    HF module's row order when the file's blocks are kept, else None (re-quantize to `fmt`)."""

    fmt: str
    data: torch.Tensor | None
    gguf_type: str


def module_name(gguf_name: str) -> str | None:
    """The HF module a GGUF weight belongs to ("blk.3.ffn_up.weight" -> "model.layers.3.mlp.up_proj"),
    or None for a tensor picompile does not quantize (embeddings, norms)."""
    if gguf_name == "output.weight":
        return "lm_head"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m is None or m.group(2) not in _LAYER_TENSORS:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}"


def _unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """The row order transformers gives Llama's q / k after loading (undoing llama.cpp's
    converter, which interleaves each head's two rotary halves). Rows move whole."""
    half = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, half, 2, -1).swapaxes(1, 2).reshape(rows.shape[0], -1)


def _architecture(reader) -> str:
    field = reader.fields.get("general.architecture")
    return bytes(field.parts[field.data[0]]).decode() if field is not None else "?"


def read(path, config) -> tuple[dict[str, Blocks], list[str]]:
    """{HF module name: Blocks} for the quantized weights in the GGUF file at `path`, and notes.
    `config`: the model's (head counts, for q / k of Llama models)."""
    import gguf

    reader = gguf.GGUFReader(pathlib.Path(path))
    arch = _architecture(reader)
    if arch not in ARCHITECTURES:
        return {}, [f"{path}: architecture {arch!r}: its tensors are not mapped (only "
                    f"{', '.join(ARCHITECTURES)}); quantized from the float weights instead"]
    heads = {"attn_q": config.num_attention_heads,
             "attn_k": getattr(config, "num_key_value_heads", None) or config.num_attention_heads}
    out: dict[str, Blocks] = {}
    notes: list[str] = []
    for name, module, kind, t in _module_tensors(reader):
        if kind in FLOAT_TYPES:
            continue
        if kind in KEPT:
            rows = np.asarray(t.data)  # uint8 [rows, row_bytes], GGUF's own blocks
            part = name.split(".")[-2]
            if arch == "llama" and part in heads:
                rows = _unpermute_rows(rows, heads[part])
            out[module] = Blocks(KEPT[kind], torch.from_numpy(np.array(rows, copy=True)), kind)
        elif kind in NEAREST:
            out[module] = Blocks(NEAREST[kind], None, kind)
            notes.append(f"{name}: {kind} has no kernel here: re-quantized to {NEAREST[kind]}")
        else:
            notes.append(f"{name}: {kind} is not supported: stays float")
    return out, notes


def formats(path) -> dict[str, str]:
    """{HF module name: picompile format} of the file's quantized weights, as `read` would give
    them, without reading their data (the tensors' types only)."""
    import gguf

    reader = gguf.GGUFReader(pathlib.Path(path))
    if _architecture(reader) not in ARCHITECTURES:
        return {}
    return {module: KEPT.get(kind) or NEAREST[kind] for _, module, kind, _ in _module_tensors(reader)
            if kind in KEPT or kind in NEAREST}


def _module_tensors(reader):
    """(GGUF name, HF module name, tensor type name, tensor) of each of the file's tensors that
    maps to a module, the LM head included where it is tied to the embedding."""
    tensors = {t.name: t for t in reader.tensors}
    if "output.weight" not in tensors and "token_embd.weight" in tensors:
        tensors["output.weight"] = tensors["token_embd.weight"]  # tied LM head
    for name, t in tensors.items():
        module = module_name(name)
        if module is not None:
            yield name, module, t.tensor_type.name, t


def check_fits(blocks: Blocks, rows: int, cols: int, where: str) -> None:
    """The file's tensor must be the module's weight: a clear error otherwise (a GGUF file of
    another model)."""
    if blocks.data is not None and tuple(blocks.data.shape) != (rows, quant.row_bytes(cols, blocks.fmt)):
        raise ValueError(f"{where}: the GGUF tensor holds {tuple(blocks.data.shape)} bytes of "
                         f"{blocks.gguf_type} blocks, the model's weight is [{rows}, {cols}]: is "
                         "this the file the model was loaded from?")
