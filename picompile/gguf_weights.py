"""A GGUF file's quantized tensors, as picompile's kernels read them: compile(..., gguf=FILE).

transformers loads a GGUF model by dequantizing every tensor to float; this module reads the same
file again with the `gguf` package (memory-mapped, one tensor at a time) so that the quantize pass
can put each tensor's own blocks back instead of quantizing the float copy a second time:

    tensors, notes = read(path, config)
    tensors.get("model.layers.0.mlp.up_proj")   # Blocks("q4_1", uint8 [rows, row_bytes]) or None

Which module a tensor belongs to comes from the `gguf` package's own name map
(gguf.TensorNameMap, the table llama.cpp's converter writes by and transformers' loader reads
by), so every architecture both know maps the same way; the LM head of a file without an
`output` tensor is the token embedding (tied).

Q8_0, Q4_0 and Q4_1 tensors are kept as they are (picompile/quant.py uses GGUF's block layout)
for the architectures whose weights transformers loads unchanged (KEEPS_BLOCKS; q and k of
"llama" files get the same whole-row permutation transformers applies); Q4_K and Q5_0 tensors
are written as q4_1 / q8_0 blocks of the same values (gguf_transcode). Other quantized types
(other K-quants, Q5_1, ...) map to the nearest supported format (NEAREST), and the tensors of other
architectures keep their file's format: both are re-quantized from the float weights by the
caller, with a note. A file whose architecture the name map does not know is re-quantized to
its most common format. Float tensors (F32, F16, BF16) stay float.

Kept blocks are checked against the model's float weights before they replace them (`check_fits`:
a few rows dequantized must be close), so a file of another model, or a mapping this module gets
wrong, is a clear error rather than a silently different model.
"""

from __future__ import annotations

import collections
import pathlib
import re
from dataclasses import dataclass

import numpy as np
import torch

from picompile import gguf_transcode, quant

KEPT = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}  # GGUF type -> picompile format
# Everything else that is quantized: the nearest format of at least its precision; the types
# gguf_transcode writes exactly go to its format where it cannot (or the architecture's blocks
# are not kept): IQ4's non-uniform levels need 8 bits.
NEAREST = {**gguf_transcode.EXACT, "Q2_K": "q4_0", "Q3_K": "q4_0",
           "IQ2_XXS": "q4_0", "IQ2_XS": "q4_0", "IQ2_S": "q4_0", "IQ3_XXS": "q4_0", "IQ3_S": "q4_0",
           "IQ1_S": "q4_0", "IQ1_M": "q4_0", "Q5_1": "q8_0", "Q5_K": "q8_0",
           "Q6_K": "q8_0", "Q8_1": "q8_0", "Q8_K": "q8_0", "TQ1_0": "q4_0", "TQ2_0": "q4_0",
           "Q1_0": "q4_0", "MXFP4": "q8_0", "NVFP4": "q8_0"}  # FP4 grids are not uniform: 8 bits
FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}
# Architectures (general.architecture) whose linear weights transformers loads as the file holds
# them ("llama": q and k rows permuted back, _unpermute_rows): their blocks can be kept. Others
# transform some weights on loading (or are not loaded by transformers at all): re-quantized.
KEEPS_BLOCKS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
_PERMUTED = {"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"}  # "llama" only
MATCH_TOLERANCE = 0.3  # check_fits: largest relative L2 distance of a kept row from the weight's


@dataclass
class Blocks:
    """One tensor of the file: `fmt` its picompile format (None: its type has none, it runs
    float); `data` uint8 [rows, row_bytes] in the HF module's row order when the file's blocks
    are kept, else None (re-quantize to `fmt`)."""

    fmt: str | None
    data: torch.Tensor | None
    gguf_type: str


class FileTensors:
    """The quantized tensors of one GGUF file, looked up by the Hugging Face module they belong
    to (`get`, as a dict of Blocks would be)."""

    def __init__(self, by_tensor: dict[str, Blocks], to_tensor, fallback: str | None = None):
        self._by_tensor = by_tensor  # GGUF tensor name ("blk.3.ffn_up.weight") -> Blocks
        self._to_tensor = to_tensor  # HF module name -> GGUF tensor name, or None
        self._fallback = fallback  # an unmapped architecture: modules not found re-quantized to it

    def get(self, module: str, default=None) -> Blocks | None:
        name = self._to_tensor(module)
        if name in self._by_tensor:
            return self._by_tensor[name]
        return Blocks(self._fallback, None, "unmapped") if self._fallback else default


# The LM head's tensor, whatever the architecture (gguf's name maps leave it out).
HEAD_TENSOR = {"lm_head": "output.weight"}
# Tensors a file blocks along an FFN's n_ff: the FFN kernels quantize them again along d (their
# blocks are kept only where no FFN block runs them: a plain linear layer)
ALONG_N_FF = ("ffn_down",)


def tensor_name(arch: str, n_blocks: int):
    """HF module name -> the GGUF tensor holding its weight, for files of architecture `arch`
    with n_blocks layers ("model.layers.3.mlp.up_proj" -> "blk.3.ffn_up.weight"; "lm_head" ->
    "output.weight"), from gguf's name map; None when `arch` is unknown to it."""
    import gguf

    key = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), None)
    if key is None:
        return None
    names = gguf.get_tensor_name_map(key, n_blocks)

    def to_tensor(module: str) -> str | None:
        if module in HEAD_TENSOR:
            return HEAD_TENSOR[module]
        base = names.get_name(module)
        return None if base is None else f"{base}.weight"
    return to_tensor


def _unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """The row order transformers gives Llama's q / k after loading (undoing llama.cpp's
    converter, which interleaves each head's two rotary halves). Rows move whole."""
    half = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, half, 2, -1).swapaxes(1, 2).reshape(rows.shape[0], -1)


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types and field.types[0].name == "STRING" else value[0]


def read(path, config=None, with_data: bool = True) -> tuple[FileTensors, list[str]]:
    """The quantized weights in the GGUF file at `path` (FileTensors: Blocks by HF module name),
    and notes. `config`: the model's (head counts, for q / k of "llama" files). with_data=False:
    formats only (no block is read)."""
    import gguf

    reader = gguf.GGUFReader(pathlib.Path(path))
    arch = _field(reader, "general.architecture") or "?"
    tensors = {t.name: t for t in reader.tensors}
    if "output.weight" not in tensors and "token_embd.weight" in tensors:
        tensors["output.weight"] = tensors["token_embd.weight"]  # tied LM head
    types = _quantized_types(tensors)
    n_blocks = _field(reader, f"{arch}.block_count") or len(
        {m.group(1) for n in tensors if (m := re.match(r"blk\.(\d+)\.", n))})
    to_tensor = tensor_name(arch, int(n_blocks))
    keep = to_tensor is not None and arch in KEEPS_BLOCKS
    notes: list[str] = []
    fallback = None
    if to_tensor is None:  # only the LM head's name is known: the rest takes the common format
        counts = collections.Counter(KEPT.get(k) or NEAREST.get(k) for k in types.values())
        counts.pop(None, None)
        fallback = counts.most_common(1)[0][0] if counts else None
        to_tensor = HEAD_TENSOR.get
        how = f"quantized from the float weights to {fallback}, the file's most common format" \
            if fallback else "float, as the file's tensors are"
        notes.append(f"{path}: architecture {arch!r} has no tensor name map in the gguf "
                     f"package: its linears {how}")
    elif not keep and any(k in KEPT for k in types.values()):
        notes.append(f"{path}: architecture {arch!r}: transformers transforms some weights on "
                     "loading, so its blocks are not kept: each tensor re-quantized from the float "
                     "weights to its own format")
    out: dict[str, Blocks] = {}
    written = set()  # GGUF types transcoded exactly
    for name, kind in types.items():
        fmt = KEPT.get(kind) or (gguf_transcode.EXACT.get(kind) if keep else None)
        if fmt is not None:
            data = None
            if keep and with_data:
                rows = np.asarray(tensors[name].data)  # uint8 [rows, row_bytes], GGUF's own blocks
                part = name.split(".")[-2]
                if arch == "llama" and part in _PERMUTED and config is not None:
                    heads = getattr(config, _PERMUTED[part], None) or config.num_attention_heads
                    rows = _unpermute_rows(rows, heads)
                if kind in KEPT:
                    rows = np.array(rows, copy=True)  # off the memory map
                else:
                    rows = gguf_transcode.transcode(rows, kind)  # a new array
                    if rows is None:
                        out[name] = Blocks(NEAREST[kind], None, kind)
                        notes.append(f"{name}: {kind} scales beyond float16's range: "
                                     f"re-quantized to {NEAREST[kind]}")
                        continue
                    if part not in ALONG_N_FF:
                        written.add(kind)
                data = torch.from_numpy(rows)
            out[name] = Blocks(fmt, data, kind)
        elif kind in NEAREST:
            out[name] = Blocks(NEAREST[kind], None, kind)
            notes.append(f"{name}: {kind} has no kernel here: re-quantized to {NEAREST[kind]}")
        else:
            out[name] = Blocks(None, None, kind)
            notes.append(f"{name}: {kind} has no kernel and no nearest format here: runs as "
                         "float weights; compile with quantize='q4_0' (--quantize q4_0) to run "
                         "it quantized")
    for kind in sorted(written):
        how = " (their scales rounded to float16)" if kind == "Q4_K" else ""
        notes.append(f"{kind} tensors: written as {gguf_transcode.EXACT[kind]} blocks of the same "
                     f"values{how}, not rounded a second time")
    return FileTensors(out, to_tensor, fallback), notes


def _quantized_types(tensors: dict) -> dict[str, str]:
    """GGUF tensor name -> its type, for the weights picompile quantizes that the file holds
    quantized (the token embedding is looked up, not multiplied: left out)."""
    return {name: t.tensor_type.name for name, t in tensors.items()
            if name.endswith(".weight") and name != "token_embd.weight"
            and t.tensor_type.name not in FLOAT_TYPES}


def tensor_types(path) -> dict[str, str]:
    """What a plan compiled with quantize="gguf" records of its file: the type of each weight
    tensor the file holds quantized (no tensor data is read)."""
    import gguf

    return _quantized_types({t.name: t for t in gguf.GGUFReader(pathlib.Path(path)).tensors})


def check_types(path, planned: dict[str, str], plan_dir) -> None:
    """ValueError unless the GGUF file at `path` holds its weights in the types the plan in
    `plan_dir` was compiled on (`planned`, tensor_types of that file): its kernels, thresholds
    and predictors were made for those blocks. Plans saved before the types were recorded
    ({}) are not checked."""
    if not planned:
        return
    found = tensor_types(path)
    for name in sorted(set(planned) | set(found)):
        want, got = planned.get(name, "float"), found.get(name, "float")
        if want != got:
            raise ValueError(f"{path} is not the GGUF file the plan in {plan_dir} was compiled "
                             f"with: its {name} is {got}, the plan's file had {want}; load the "
                             "plan with that file, or compile again with this one")


def check_model(path, config) -> None:
    """Raise ValueError where the GGUF file at `path` cannot be the one the model of `config`
    was loaded from: another layer count or width in its metadata (no tensor data is read)."""
    import gguf

    if config is None:
        return
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    reader = gguf.GGUFReader(pathlib.Path(path))
    arch = _field(reader, "general.architecture") or "?"
    for key, attr in (("block_count", "num_hidden_layers"), ("embedding_length", "hidden_size")):
        got, want = _field(reader, f"{arch}.{key}"), getattr(config, attr, None)
        if got is not None and isinstance(want, int) and int(got) != want:
            raise ValueError(f"{path} is not the GGUF file this model was loaded from: its "
                             f"{arch}.{key} is {int(got)}, the model's {attr} {want}; pass "
                             "gguf= the model's own file")


def formats(path) -> FileTensors:
    """The file's quantized weights' formats, as `read` would give them (Blocks without data)."""
    return read(path, with_data=False)[0]


def check_fits(blocks: Blocks, weight: torch.Tensor, where: str) -> None:
    """The file's blocks must be the module's weight [rows, cols] (float, the rows in the same
    order): the same shape, and a few rows dequantized within MATCH_TOLERANCE (relative L2) of
    the weight's (exactly equal when the model was loaded from the file; a GGUF file of another
    model, or rows in another order, are far off). A clear error otherwise."""
    if blocks.data is None:
        return
    rows, cols = weight.shape
    hint = "is this the file the model was loaded from?"
    if tuple(blocks.data.shape) != (rows, quant.row_bytes(cols, blocks.fmt)):
        raise ValueError(f"{where}: the GGUF tensor holds {tuple(blocks.data.shape)} bytes of "
                         f"{blocks.gguf_type} blocks, the model's weight is [{rows}, {cols}]: {hint}")
    sample = torch.linspace(0, rows - 1, min(rows, 8)).long()
    w = weight.detach()[sample].to("cpu", torch.float32)
    deq = quant.dequantize(blocks.data[sample], blocks.fmt, cols)
    far = float(((deq - w).norm(dim=1) / w.norm(dim=1).clamp_min(1e-12)).max())
    if far > MATCH_TOLERANCE:
        raise ValueError(f"{where}: the GGUF file's {blocks.gguf_type} blocks are not this "
                         f"module's weight (rows differ by {far:.2f} of their norm, more than "
                         f"{blocks.fmt} rounding): {hint}")
