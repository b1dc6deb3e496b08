"""Hessians: what calibrated quantization (picompile/gptq.py) needs to know of each layer's
inputs, H = X^T X / n over calibration tokens, gathered from the float model.

    hessians = collect(model, ffns, ids)   # {weight key: H [K, K] float32}, shared where inputs are

Keys (quantize.gptq_targets names the weights by them): "<block>.w_gate" / "<block>.w_up" (the FFN
block's input x [d]; one matrix for both), "<block>.w_down_t" (the block's hidden activations
h = act(gate x) * up x [n_ff], after its threshold: what its down rows are multiplied by), and
each nn.Linear's qualified name (attention projections, the LM head; q, k and v, which read
the same tensor, share one matrix). Runs after calibration, profiling and placement, on the
float weights, before lowering releases them: one more pass over at most `max_tokens`
calibration tokens, the whole model or layer by layer as calibration runs (passes/calibrate.py;
layer by layer the LM head is not run, and keeps round-to-nearest).

Memory: one K x K float32 matrix per distinct input. Run whole, every layer's are held until
the weights are quantized; layer by layer, `done` takes each decoder layer's as soon as every
batch has passed it (compile runs GPTQ on them there and drops them), so at most one layer's
are held (compile goes layer by layer where all of them would exceed MAX_BYTES). Where even
one layer's would (estimate_bytes), compile rounds to nearest instead.
"""

from __future__ import annotations

import torch
from torch import nn

from picompile.passes.calibrate import run_calibration
from picompile.runtime.sparse_ffn import SparseFFN, down_input

MAX_TOKENS = 16384  # calibration tokens the Hessians see (more cost time; BENCHMARKS.md, session 11)
# Above this, compile rounds to nearest instead of holding every layer's Hessians (and running
# GPTQ's per-column loop over them, which grows with them).
MAX_BYTES = 2 << 30


def gathered(width: int, max_width: int | None) -> bool:
    """Whether a Hessian of `width` inputs is gathered: not where it has more inputs than
    max_width, the calibration tokens (singular: GPTQ leaves such weights to nearest; None:
    every one). The one rule for collect, estimate_bytes and quantize's Rounding."""
    return max_width is None or width <= max_width


def estimate_bytes(model: nn.Module, ffns: dict[str, SparseFFN], layers=None,
                   max_width: int | None = None) -> int:
    """An upper bound on what collect() holds: K x K float32 per FFN input and hidden layer and
    per linear layer outside the blocks (q, k and v counted apart though they share one), K up
    to `max_width` as collect's; with `layers` (the decoder layers, collect run layer by layer
    with `done`), the most any one of them holds."""
    linears: dict[int, list[str]] = {}
    _linears(model, "", linears, set())
    modules = {id(m): m for m in model.modules()}

    def held(within: nn.Module) -> int:
        inside = {id(m) for m in within.modules()}
        widths = [w for f in ffns.values() if id(f) in inside for w in (f.d_model, f.n_ff)]
        widths += [modules[i].in_features for i in linears if i in inside]
        return sum(4 * k * k for k in widths if gathered(k, max_width))

    return held(model) if layers is None else max((held(layer) for layer in layers), default=0)


def calibration_rows(ids: torch.Tensor, max_tokens: int = MAX_TOKENS) -> torch.Tensor:
    """The rows of ids [batch, seq] that collect runs: the first, holding at most max_tokens
    tokens, at least one."""
    return ids[: max(1, min(ids.shape[0], max_tokens // max(1, ids.shape[1])))]


@torch.no_grad()
def collect(model: nn.Module, ffns: dict[str, SparseFFN], ids: torch.Tensor, *,
            max_tokens: int = MAX_TOKENS, quiet: bool = False, device=None, dtype=None,
            done=None, max_width: int | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """Run ids [batch, seq] (the first rows holding at most max_tokens tokens, at least one
    row) through the model with hooks on its FFN blocks and linear layers. -> ({weight key:
    H [K, K] float32 on the CPU}, tokens seen). device, dtype: as run_calibration's.
    done({weight key: H}): with a device (layer by layer), called with each decoder layer's
    Hessians once they are complete, which are then not kept (nor returned).
    max_width: Hessians of more inputs than that are not gathered (GPTQ leaves such weights to
    nearest where they are wider than the tokens: quantize.Rounding.gather)."""
    ids = calibration_rows(ids, max_tokens)
    n = ids.numel()
    sums: dict[str, torch.Tensor] = {}  # key -> sum of x^T x, on the activations' device
    owner: dict[str, int] = {}  # key -> id of the module whose hook gathers it
    last = {"x": None, "key": None}  # the previous linear's input, to share q / k / v's sum

    def add(key: str, x: torch.Tensor, module: nn.Module) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float32)  # [T, K]
        if key in sums:
            sums[key].addmm_(x.T, x)
        else:
            sums[key] = x.T @ x
            owner[key] = id(module)

    def on_ffn(name: str):
        def hook(ffn: SparseFFN, args, _out):
            x = args[0].reshape(-1, ffn.d_model)  # [T, d]
            if gathered(ffn.d_model, max_width):
                add(f"{name}.w_up", x, ffn)
            if not gathered(ffn.n_ff, max_width):
                return
            h = down_input(x, ffn.w_up, w_gate=ffn.w_gate, b_gate=ffn.b_gate, b_up=ffn.b_up,
                           act=ffn.act, drelu=ffn.drelu)  # [T, n_ff]
            if ffn.threshold is not None:
                h = torch.where(h.abs() > ffn.threshold, h, torch.zeros_like(h))
            add(f"{name}.w_down_t", h, ffn)
        return hook

    def on_linear(names: list[str]):
        def hook(lin, args, _out):
            x = args[0]
            if x is last["x"] and last["key"] != names[0]:  # q, k, v: one input, one sum
                for name in names:
                    aliases[name] = last["key"]
                return
            last["x"], last["key"] = x, names[0]
            if gathered(x.shape[-1], max_width):
                add(names[0], x, lin)
        return hook

    def finish(keys) -> dict[str, torch.Tensor]:
        """{weight key: H} of the sums under `keys`, each under every key that reads it."""
        out = {key: (sums.pop(key) / n).cpu() for key in keys}  # [K, K]
        for name in ffns:
            if f"{name}.w_up" in out:
                out[f"{name}.w_gate"] = out[f"{name}.w_up"]
        for names in linears.values():
            key = aliases.get(names[0], names[0])
            for name in names:
                if key in out:
                    out[name] = out[key]
        return out

    def layer_done(layer: nn.Module) -> None:
        inside = {id(m) for m in layer.modules()}
        last["x"] = None  # (the last input seen belongs to this layer)
        done(finish([key for key in list(sums) if owner[key] in inside]))

    aliases: dict[str, str] = {}  # linear name -> the key whose sum it shares
    linears: dict[int, list[str]] = {}  # id -> every name of an nn.Linear outside the blocks
    _linears(model, "", linears, set())
    modules = {id(m): m for m in model.modules()}
    hooks = [(ffn, on_ffn(name)) for name, ffn in ffns.items()]
    hooks += [(modules[i], on_linear(names)) for i, names in linears.items()]
    by_layer = done is not None and device is not None
    run_calibration(model, ids, quiet=quiet, device=device, dtype=dtype, hooks=hooks,
                    desc="Hessians and GPTQ, layer by layer" if by_layer else "Hessians for GPTQ",
                    after_layer=layer_done if by_layer else None)
    last.clear()
    return finish(list(sums)), n


def _linears(parent: nn.Module, prefix: str, found: dict[int, list[str]], seen: set[int]) -> None:
    """id -> qualified names of every nn.Linear under `parent` outside SparseFFN blocks (what
    lower_linears will make DenseLinear layers of), each name it is reachable under."""
    if id(parent) in seen:
        return
    seen.add(id(parent))
    for name, child in parent._modules.items():
        if child is None or isinstance(child, SparseFFN):
            continue
        qual = f"{prefix}.{name}" if prefix else name
        if isinstance(child, nn.Linear):
            found.setdefault(id(child), []).append(qual)
        else:
            _linears(child, qual, found, seen)
