"""Quantization: the weights the kernels read, in GGUF's block formats (picompile/quant.py).

    notes = quantize_ffns(ffns, "q4_0")                    # before the blocks pick kernels
    paths, notes = quantize_linears(model, "q4_0")         # after the lowering pass
    tensors, notes = gguf_weights.read(path, model.config)  # fmt "gguf": the file's own blocks

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

Which blocks: round-to-nearest (quant.quantize, gguf's reference), or, where compile has
calibration tokens and quantize= is a format, GPTQ (picompile/gptq.py: each layer's rounding
errors compensated along its inputs' Hessian, passes/hessians.py), given as a Rounding: the
blocks are still GGUF's, only the choice of each block's levels and scale changes. A saved plan
keeps the GPTQ blocks themselves (Rounding(saved=...)), so load does not calibrate again.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from picompile import gguf_weights, gptq, quant
from picompile.passes.hessians import gathered
from picompile.plan import PlanError
from picompile.progress import progress_bar
from picompile.runtime.dense_linear import DenseLinear, QuantLinear

FOUR_BIT = ("q4_0", "q4_1")
HIGH_PRECISION = "q8_0"  # the LM head and the FFN down rows under a 4-bit format


def ffn_formats(fmt: str) -> tuple[str, str]:
    """(gate / up rows' format, down rows' format) of a block quantized to `fmt` (see the module
    doc: 4-bit blocks keep their down rows at q8_0)."""
    return fmt, HIGH_PRECISION if fmt in FOUR_BIT else fmt


def _role_formats(block_fmt: str, down_fmt: str) -> tuple[tuple[str, str], ...]:
    """(SparseFFN row tensor, its format) for a block stored as ffn_formats says."""
    return ("w_gate", block_fmt), ("w_up", block_fmt), ("w_down_t", down_fmt)


def planned_ffn_formats(ffns: dict, fmt: str | None, gguf_path=None) -> dict[str, tuple[str, str]]:
    """{block name: ffn_formats} of the blocks quantize_ffns will quantize (for placement, which
    runs before it); blocks that will stay float are left out. fmt "gguf": each block's up
    projection's format in the file at `gguf_path`."""
    if fmt is None:
        return {}
    file_tensors = gguf_weights.formats(gguf_path) if fmt == "gguf" else None
    out = {}
    for name, ffn in ffns.items():
        block_fmt, _ = _block_format(ffn, fmt, file_tensors)
        if block_fmt is not None:
            out[name] = ffn_formats(block_fmt)
    return out


def _block_format(ffn, fmt: str, file_tensors=None) -> tuple[str | None, str | None]:
    """(the format `fmt` stores the block's gate / up rows in, None) or (None, why it stays
    float): the one rule for planned_ffn_formats and quantize_ffns. file_tensors (fmt "gguf":
    gguf_weights.read's, by module name): the block takes its up projection's format there."""
    why = quant.why_not_quantizable((ffn.n_ff, ffn.d_model))
    if why is not None:
        return None, why
    if file_tensors is None:
        return fmt, None
    modules = _module_names(ffn)
    blocks = file_tensors.get(modules.get("up") or modules.get("gate_up", ""))
    return _file_format(blocks)


def _file_format(blocks) -> tuple[str | None, str | None]:
    """(format, None) of a tensor of the GGUF file (gguf_weights.Blocks or None), or (None, why
    it stays float)."""
    if blocks is None:
        return None, "float in the GGUF file"
    if blocks.fmt is None:
        return None, f"{blocks.gguf_type} in the GGUF file, a type with no kernel here"
    return blocks.fmt, None


def _module_names(ffn) -> dict[str, str]:
    """{role: the model's module name} of a block's linears ("up": "model.layers.0.mlp.up_proj")."""
    return {role: f"{ffn.block.module}.{attr}" if ffn.block.module else attr
            for role, attr in ffn.block.linears.items()}


def gptq_targets(model: nn.Module, ffns: dict, fmt: str) -> dict[str, tuple[torch.Tensor, str, bool]]:
    """{Hessian key: (float weight, format, transposed)} of every weight quantize_ffns and
    quantize_linears round to `fmt` from float weights, read before lowering (nn.Linear layers):
    what Rounding.gather quantizes as a layer's Hessians are complete."""
    out = {}
    for name, formats in planned_ffn_formats(ffns, fmt).items():
        for role, role_fmt in _role_formats(*formats):
            w = getattr(ffns[name], role)
            if w is not None:
                out[f"{name}.{role}"] = (w, role_fmt, role == "w_down_t")
    for qual, (layer, layer_fmt) in planned_linear_formats(model, ffns, fmt).items():
        out[qual] = (layer.weight, layer_fmt, False)
    return out


def planned_linear_formats(model: nn.Module, ffns: dict, fmt: str | None, gguf_path=None
                           ) -> dict[str, tuple[nn.Linear, str]]:
    """{qualified name: (nn.Linear, format)} of the linear layers outside the FFN blocks that
    quantize_linears will quantize, read before lowering (for GPTQ and placement). fmt "gguf":
    each layer's format in the file at `gguf_path`."""
    if fmt is None:
        return {}
    file_tensors = gguf_weights.formats(gguf_path) if fmt == "gguf" else None
    head = None if file_tensors is not None else _kept_head(model, fmt)
    inside = {id(m) for ffn in ffns.values() for m in ffn.modules()}
    out = {}
    for qual, layer in model.named_modules(remove_duplicate=False):
        if isinstance(layer, nn.Linear) and id(layer) not in inside:
            layer_fmt, _ = _linear_format(qual, layer, fmt, head, file_tensors)
            if layer_fmt is not None:
                out[qual] = (layer, layer_fmt)
    return out


def planned_linear_bytes(model: nn.Module, ffns: dict, fmt: str | None, gguf_path=None
                         ) -> dict[int, int]:
    """{id(weight): bytes it will hold} of the weights planned_linear_formats quantizes (for
    placement, which runs on the float model): their blocks' bytes, plus the float weight's
    where a module other than those layers holds it too (an LM head tied to the input
    embedding, which stays float)."""
    layers = {id(layer): (layer, layer_fmt)
              for layer, layer_fmt in planned_linear_formats(model, ffns, fmt, gguf_path).values()}
    holders: dict[int, set[int]] = {}  # id(parameter) -> ids of the modules holding it
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                holders.setdefault(id(p), set()).add(id(m))
    out = {}
    for layer, layer_fmt in layers.values():
        w = layer.weight
        blocks = w.shape[0] * quant.row_bytes(w.shape[1], layer_fmt)
        tied = any(h not in layers for h in holders.get(id(w), ()))
        out[id(w)] = blocks + (w.numel() * w.element_size() if tied else 0)
    return out


def _linear_format(qual: str, layer: nn.Module, fmt: str, head: nn.Module | None,
                   file_tensors: dict | None) -> tuple[str | None, str | None]:
    """(format, None) that a linear layer outside the FFN blocks is quantized to, or (None, why
    it stays float): the one rule for quantize_linears and planned_linear_formats. `head`: the
    LM head a 4-bit format keeps at HIGH_PRECISION; file_tensors (fmt "gguf"): the file's
    tensors by module name, each layer in its own format."""
    why = quant.why_not_quantizable((layer.out_features, layer.in_features))
    if why is not None:
        return None, why
    if file_tensors is not None:
        return _file_format(file_tensors.get(qual))
    return (HIGH_PRECISION if layer is head else fmt), None


def too_wide(targets: dict, tokens: int) -> dict[int, int]:
    """{input width: weights} of the gptq_targets with more inputs than `tokens`: their Hessian
    is singular and Rounding.gather leaves them to nearest."""
    out: dict[int, int] = {}
    weights = {id(w): (w, transposed) for w, _, transposed in targets.values()}  # each once
    for w, transposed in weights.values():
        width = w.shape[0] if transposed else w.shape[1]  # down_t [n_ff, d]: n_ff inputs
        if not gathered(width, tokens):
            out[width] = out.get(width, 0) + 1
    return out


def _kept_head(model: nn.Module, fmt: str) -> nn.Module | None:
    """The LM head where `fmt` (4-bit) keeps it at HIGH_PRECISION (see the module doc)."""
    if fmt in FOUR_BIT and hasattr(model, "get_output_embeddings"):
        return model.get_output_embeddings()
    return None


class Rounding:
    """Where the blocks of a weight come from, by its key (passes/hessians.py's keys: "<block>.
    w_gate" / ".w_up" / ".w_down_t", a linear layer's qualified name): GPTQ's blocks, made by
    gather from the Hessians, or `saved` blocks (a plan's "<key>.blocks" tensors); a weight with
    neither is rounded to nearest."""

    def __init__(self, saved: dict[str, torch.Tensor] | None = None, tokens: int = 0,
                 skipped: str | None = None):
        # saved: a plan's blocks (None when compiling), one for every weight it quantizes
        self.saved, self.tokens = saved, tokens  # tokens: the Hessians' calibration tokens
        self.skipped = skipped  # why there are no Hessians though calibration data was given
        self.count = 0  # weights given calibrated blocks
        self.too_wide: dict[int, int] = {}  # input width -> weights left to nearest (> tokens)
        # (the caller's count: too_wide(targets, tokens); their Hessians need not be gathered)
        # key -> (format, transposed, blocks): GPTQ's, made by gather, until blocks() takes them
        self.ready: dict[str, tuple[str, bool, torch.Tensor]] = {}

    def gather(self, hessians: dict[str, torch.Tensor], targets: dict, quiet: bool = True) -> None:
        """GPTQ now for the weights of `hessians` ({key: H}: one layer's, as hessians.collect's
        `done` hands them over, or all of them) that `targets` (gptq_targets) names; only the
        blocks are kept. Weights that read one Hessian (q, k and v; gate and up) in one format go
        through GPTQ's column loop together, stacked: its rows are independent, so the blocks
        are those of one weight at a time, for one loop instead of three. quiet=False: a
        progress bar over those groups.
        A Hessian of more inputs than calibration tokens is singular, and GPTQ moves rounding
        errors into the directions the tokens did not reach; on new text that measured worse
        than rounding to nearest (BENCHMARKS.md, session 13), so such weights are left to it."""
        groups: dict[tuple[int, str, bool], list[str]] = {}
        for key, h in hessians.items():
            if key in targets:
                _, fmt, transposed = targets[key]
                groups.setdefault((id(h), fmt, transposed), []).append(key)
        if not groups:  # (layer by layer, the whole-model call after the last layer)
            return
        for (_, fmt, transposed), keys in progress_bar(groups.items(), desc="GPTQ", quiet=quiet,
                                                       total=len(groups)):
            if not gathered(hessians[keys[0]].shape[0], self.tokens):  # too wide: to nearest
                continue
            weights: dict[int, torch.Tensor] = {}  # one weight under several keys: once
            for key in keys:
                weights.setdefault(id(targets[key][0]), targets[key][0])
            prep = gptq.prepare(hessians[keys[0]], act_order=not transposed)
            if transposed:  # FFN down rows: one block's, each blocked along its own rows
                made = {i: gptq.quantize_transposed(w, fmt, prep) for i, w in weights.items()}
            else:
                stacked = gptq.quantize(torch.cat([w.detach().float() for w in weights.values()]),
                                        fmt, prep)
                made = dict(zip(weights, stacked.split([w.shape[0] for w in weights.values()])))
            for key in keys:
                self.ready[key] = (fmt, transposed, made[id(targets[key][0])])

    def blocks(self, key: str, w: torch.Tensor, fmt: str, transposed: bool = False):
        """uint8 blocks of `w` in GGUF's row layout (w [O, K], blocks along K; transposed: w is
        down_t [n_ff, d], blocks along d), or None for round-to-nearest."""
        rows, cols = w.shape
        if self.saved is not None:  # a plan's: every quantized weight's blocks were saved
            saved = self.saved.get(f"{key}.blocks")
            if saved is None:
                raise PlanError(f"saved tensor {key}.blocks is missing (the plan was quantized "
                                "by GPTQ and keeps the blocks of every weight): compile the model "
                                "again and save it")
            want = (rows, quant.row_bytes(cols, fmt))
            if saved.dtype != torch.uint8 or tuple(saved.shape) != want:
                raise PlanError(f"saved tensor {key}.blocks is {saved.dtype} {tuple(saved.shape)}; "
                                f"{fmt} blocks of this weight are uint8 {want}: compile the model "
                                "again and save it")
            self.count += 1
            return saved
        if key not in self.ready:
            return None
        ready_fmt, ready_transposed, blocks = self.ready.pop(key)
        if (ready_fmt, ready_transposed) != (fmt, transposed):  # gptq_targets disagrees: a bug
            raise AssertionError(f"picompile: GPTQ made {key}'s blocks in {ready_fmt}, "
                                 f"its layer is quantized to {fmt}")
        self.count += 1
        return blocks


def quantized_matrices(model: nn.Module, ffns: dict) -> int:
    """How many weight matrices are quantized: the quantized linear layers (a layer under two
    names once) and each quantized FFN block's gate, up and down."""
    linears = {id(m) for m in model.modules() if isinstance(m, QuantLinear)}
    roles = sum(getattr(f, role) is not None for f in ffns.values() if f.qformat is not None
                for role in ("w_gate", "w_up", "w_down_t"))
    return len(linears) + roles


def rounding_note(rounding: Rounding | None, tokens: int, total: int) -> str:
    """explain()'s line on how the blocks of the `total` quantized weight matrices were chosen."""
    if total == 0:
        return "no weight quantized: each stays float, for the reason on its line above"
    if rounding is not None and rounding.skipped:
        return f"blocks rounded to nearest (gguf's reference): {rounding.skipped}"
    if rounding is None or not rounding.count:
        return ("blocks rounded to nearest (gguf's reference): pass calibration= or tokenizer= "
                "for GPTQ rounding, calibrated on those tokens")
    how = "saved with the plan" if rounding.saved else "each layer's rounding errors compensated"
    note = (f"{rounding.count} of {total} weight matrices rounded by GPTQ on the Hessians of "
            f"{tokens} calibration tokens ({how})")
    if rounding.count < total:
        note += f"; the other {total - rounding.count} to nearest"
    if rounding.too_wide:
        widest = max(rounding.too_wide)
        note += (f"; {sum(rounding.too_wide.values())} weights with more inputs than "
                 f"calibration tokens (up to {widest}) to nearest too: pass at least {widest} "
                 "calibration tokens for GPTQ on them")
    return note


def quantize_ffns(ffns: dict, fmt: str, file_blocks: dict | None = None,
                  rounding: Rounding | None = None) -> list[str]:
    """Quantize the FFN blocks to `fmt` in place (before their kernels are picked). With
    `file_blocks` (gguf_weights.read: fmt "gguf"), each block takes its up projection's format
    from the file, and the gate and up rows are the file's own blocks (in the block's neuron
    order); the down rows, which the file stores along the other axis, are quantized again.
    Down rows of a 4-bit block are q8_0 (see the module doc). `rounding`: GPTQ (or saved)
    blocks for the weights it has (not with file_blocks).
    -> notes on the blocks that stay float, and why, and on the down rows' format."""
    notes = []
    requantized_down = 0  # blocks whose down rows a file had along n_ff, or 4-bit ones in q8_0

    for name, ffn in ffns.items():
        block_fmt, why = _block_format(ffn, fmt, file_blocks)
        if why is not None:
            notes.append(f"{name}: stays {str(ffn.w_up.dtype).removeprefix('torch.')}: {why}")
            continue
        block_fmt, down_fmt = ffn_formats(block_fmt)
        requantized_down += file_blocks is not None or down_fmt != block_fmt
        given = {}  # role -> blocks in GGUF's layout: GPTQ's (or saved), or the file's own
        if rounding is not None and file_blocks is None:
            for role, role_fmt in _role_formats(block_fmt, down_fmt):
                w = getattr(ffn, role)
                blocks = None if w is None else rounding.blocks(
                    f"{name}.{role}", w, role_fmt, transposed=role == "w_down_t")
                if blocks is not None:
                    given[role] = blocks
        if file_blocks is not None:
            rows, mixed = _file_rows(ffn, file_blocks, block_fmt)
            given.update(rows)
            notes += mixed
        ffn.quantize_(block_fmt, down_fmt, blocks=given)
    if requantized_down and file_blocks is not None:
        notes.append(f"FFN down rows of {requantized_down} blocks re-quantized to {HIGH_PRECISION} "
                     "along d from the file's values (the file blocks them along n_ff)")
    elif requantized_down:
        notes.append(f"FFN down rows of {requantized_down} 4-bit blocks in {HIGH_PRECISION} along "
                     "d (4-bit blocks along d lose far more than along n_ff)")
    return notes


def _file_rows(ffn, file_blocks, block_fmt: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """({"w_gate" | "w_up": the GGUF file's blocks of those rows, in the block's neuron order}
    where the file keeps them in block_fmt (its down rows lie along the other axis: quantized
    again), a note for a gate in another type than up's, quantized again to up's). A fused
    gate_up tensor [2 n_ff, d] gives both halves."""
    modules = _module_names(ffn)
    if "gate_up" in modules:
        fused = file_blocks.get(modules["gate_up"])
        if fused is None or fused.data is None:
            return {}, []
        halves = fused.data.chunk(2)  # (halves of another size: check_fits says so)
        g = ffn.block.fused_gate_half
        found = {"w_gate": replace(fused, data=halves[g]), "w_up": replace(fused, data=halves[1 - g])}
    else:
        found = {f"w_{role}": file_blocks.get(modules.get(role, "")) for role in ("gate", "up")}
    out, notes = {}, []
    for role, blocks in found.items():
        if blocks is not None and blocks.fmt != block_fmt:
            notes.append(f"{ffn.block.module}: {role[2:]} rows {blocks.gguf_type} in the file, "
                         f"quantized again to {block_fmt} (a block's gate and up rows share "
                         "one format: the up projection's)")
        if blocks is None or blocks.data is None or blocks.fmt != block_fmt:
            continue  # quantized from the float weights
        rows = blocks.data if ffn.order is None else blocks.data[ffn.order]
        gguf_weights.check_fits(replace(blocks, data=rows), getattr(ffn, role),
                                f"{ffn.block.module}: {role}")
        out[role] = rows
    return out, notes


def quantize_linears(model: nn.Module, fmt: str, file_blocks: dict | None = None,
                     rounding: Rounding | None = None) -> tuple[dict[str, str], list[str]]:
    """Replace every DenseLinear under `model` whose width allows it with a QuantLinear of
    `fmt` (after the lowering pass; the LM head q8_0 where `fmt` is 4-bit, see the module doc).
    With `file_blocks` (fmt "gguf"), each layer takes the file's format and its own blocks;
    layers float in the file stay float. `rounding`: GPTQ (or saved) blocks for the layers it
    has (not with file_blocks). -> ({qualified name: kernel path} of the replaced
    layers, notes on the layers that stay float, and why, and on the LM head's format)."""
    paths, notes = {}, []
    replaced: dict[int, QuantLinear] = {}  # a layer under several names is quantized once
    head = None if file_blocks is not None else _kept_head(model, fmt)  # q8_0 under 4-bit
    modules = [(prefix, m) for prefix, m in model.named_modules()  # those holding linears
               if any(isinstance(c, DenseLinear) for c in m._modules.values())]
    for prefix, parent in modules:
        for name, child in list(parent._modules.items()):
            if not isinstance(child, DenseLinear):
                continue
            qual = f"{prefix}.{name}" if prefix else name
            layer_fmt, why = _linear_format(qual, child, fmt, head, file_blocks)
            if why is not None:
                notes.append(f"{qual}: stays float: {why}")
                continue
            blocks = None if file_blocks is None else file_blocks.get(qual)
            if id(child) not in replaced:
                if child is head:
                    notes.append(f"{qual}: the LM head, {HIGH_PRECISION} (not {fmt}), as "
                                 "llama.cpp keeps its output layer")
                given = None
                if rounding is not None and file_blocks is None:
                    given = rounding.blocks(qual, child.weight, layer_fmt)
                replaced[id(child)] = QuantLinear.from_linear(child, layer_fmt)
                if given is not None:
                    replaced[id(child)].load_row_blocks(given)
                if blocks is not None and blocks.data is not None:
                    gguf_weights.check_fits(blocks, child.weight, qual)
                    replaced[id(child)].load_row_blocks(blocks.data)
            setattr(parent, name, replaced[id(child)])
            paths[qual] = replaced[id(child)].path
    return paths, notes
