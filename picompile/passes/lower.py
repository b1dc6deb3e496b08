"""Lowering: weight-bearing linear layers outside the FFN blocks to picompile's dense kernel.

    paths = lower_linears(model)
    # {"model.layers.0.self_attn.q_proj": "C float32 avx2 (avx512 for T >= 3)", ...,
    #  "model.layers.0.self_attn.q_lora": "not lowered (LoraLinear: an nn.Linear subclass ...)"}

Every module whose type is exactly nn.Linear (q/k/v/o projections, the LM head, OPT's
project_in/out, ...) is replaced in place by a `runtime.dense_linear.DenseLinear` holding the same
Parameter objects, so tied weights stay tied and state_dict keys are unchanged. Parents are any
modules, fx GraphModules included (their call_module nodes look submodules up by name, so
setattr on the parent reroutes them).

Left alone: anything inside a `SparseFFN` (its weights are in the sparse kernels' layout already,
and not named in the result), `model` itself, and, named in the result with the reason,
nn.Linear subclasses (their own forward may be quantized, LoRA, ...) and Linears with forward
hooks or an instance-level forward (accelerate's offloading hooks, for one: replacing the module
would drop them).

Run it after capture and detect (they recognise FFN blocks by their nn.Linear members).
"""

from __future__ import annotations

from torch import nn

from picompile.passes.detect import plain_affine
from picompile.runtime.dense_linear import DenseLinear
from picompile.runtime.sparse_ffn import SparseFFN


def why_not_lowered(mod: nn.Linear) -> str | None:
    """Why an nn.Linear (or subclass) is kept as it is; None when it can be lowered."""
    if not plain_affine(mod):  # (FalconLinear computes what nn.Linear does: lowered)
        return f"not lowered ({type(mod).__name__}: an nn.Linear subclass, may compute otherwise)"
    if "forward" in vars(mod) or mod._forward_hooks or mod._forward_pre_hooks:
        return "not lowered (has forward hooks or a patched forward)"
    return None


def lower_linears(model: nn.Module) -> dict[str, str]:
    """Replace every plain nn.Linear under `model` (not inside a SparseFFN) with a DenseLinear.

    Returns qualified name -> execution path picked ("C float16 avx2 (avx512 for T >= 3)",
    "reference (...)"), and for the nn.Linear modules kept as they are, "not lowered (<why>)".
    A Linear reachable under several names is replaced by one DenseLinear everywhere (and named
    once per parent)."""
    paths: dict[str, str] = {}
    replaced: dict[int, tuple[nn.Linear, DenseLinear]] = {}  # id(Linear) -> (it, replacement)
    visited: set[int] = set()

    def visit(parent: nn.Module, prefix: str) -> None:
        if id(parent) in visited:
            return
        visited.add(id(parent))
        for name, child in list(parent._modules.items()):
            if child is None or isinstance(child, SparseFFN):
                continue
            qual = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.Linear):
                why = why_not_lowered(child)
                if why is not None:
                    paths[qual] = why
                    visit(child, qual)
                    continue
                if id(child) not in replaced:  # the Linear is kept referenced: ids stay unique
                    replaced[id(child)] = (child, DenseLinear.from_linear(child))
                new = replaced[id(child)][1]
                setattr(parent, name, new)
                paths[qual] = new.path
            else:
                visit(child, qual)

    visit(model, "")
    return paths
