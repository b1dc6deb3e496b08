"""Capture: trace the deepest submodules that torch.fx can trace and that hold FFN blocks.

Like torch.compile at a graph break, what does not trace stays eager: a module whose trace fails
becomes an opaque leaf for its parents, and its own children are captured on their own. Walking
post-order makes the captured modules the deepest ones holding a block: an HF `LlamaMLP`, but the
whole `OPTDecoderLayer` for OPT, whose FFN is written inline in the layer.
"""

from __future__ import annotations

import dis
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch.fx as fx
from torch import nn

from picompile.activations import library_activation
from picompile.runtime.sparse_ffn import SparseFFN


def check_no_kwargs(kwargs: dict, module_name: str) -> None:
    """Inserted into graphs traced with an empty `**kwargs`: refuse what would be dropped."""
    extra = {k: v for k, v in kwargs.items() if v is not None}
    if extra:
        raise TypeError(
            f"picompile: the compiled module {module_name!r} was traced without extra keyword "
            f"arguments, but got {sorted(extra)}: compiled, it cannot take them (for this "
            "architecture: output_attentions / output_hidden_states and the like); call the model "
            "without them, or keep an uncompiled copy for them (compile(copy.deepcopy(model)))"
        )


class Tracer(fx.Tracer):
    """torch.fx tracer for picompile.

    Leaves: every nn.Linear (also subclasses such as Falcon's), SparseFFN, Hugging Face's
    activation modules (detect reads them by class: activations.MODULE_ACTIVATIONS), and the
    `opaque` modules (those that failed to trace). A `**kwargs` forward parameter is traced as
    empty; `guard_kwargs` then makes the graph raise if a caller passes anything through it."""

    def __init__(self, opaque: set[nn.Module] = frozenset()):
        super().__init__(autowrap_functions=(check_no_kwargs,))
        self.opaque = opaque

    def trace(self, root, concrete_args=None):
        if isinstance(root, fx.GraphModule):  # re-tracing: what was a leaf stays one
            called = {n.target for n in root.graph.nodes if n.op == "call_module"}
            self.opaque = set(self.opaque) | {root.get_submodule(t) for t in called}
        return super().trace(root, concrete_args)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if (isinstance(m, (nn.Linear, SparseFFN)) or m in self.opaque
                or library_activation(m)):
            return True
        return super().is_leaf_module(m, qualname)

    def iter(self, obj: fx.Proxy):
        # `a, b = leaf(**kw)` unpacks a proxy; fx only recognises the plain-call form of this.
        frame = sys._getframe(2)
        for inst in dis.get_instructions(frame.f_code):
            if inst.offset > frame.f_lasti and inst.opname == "UNPACK_SEQUENCE":
                return iter([obj[i] for i in range(inst.argval)])
            if inst.offset > frame.f_lasti + 8:
                break
        return super().iter(obj)

    def keys(self, obj: fx.Proxy):
        # `f(**kwargs)` with kwargs the forward's own `**kwargs`: trace it as empty.
        if obj.node.op == "placeholder" and str(obj.node.target).startswith("**"):
            return []
        return super().keys(obj)


def trace(module: nn.Module, name: str, opaque: set[nn.Module]) -> fx.GraphModule:
    """Trace one module (its undecorated forward) into a GraphModule sharing its submodules."""
    cls = type(module)
    forward = inspect.unwrap(cls.forward)
    if forward is not cls.forward:
        # HF wraps layer forwards (gradient checkpointing) in a (*args, **kwargs) shim that fx
        # cannot see through. Trace a view of the same object with the original forward; the
        # attribute is set after class creation so __init_subclass__ does not wrap it again.
        view_cls = type(cls.__name__, (cls,), {})
        view_cls.forward = forward
        view = view_cls.__new__(view_cls)
        view.__dict__ = module.__dict__
        module_for_trace = view
    else:
        module_for_trace = module
    graph = Tracer(opaque).trace(module_for_trace)
    guard_kwargs(graph, name)
    gm = fx.GraphModule(module, graph, class_name=cls.__name__)
    return gm


def guard_kwargs(graph: fx.Graph, name: str) -> None:
    for node in graph.nodes:
        if node.op == "placeholder" and str(node.target).startswith("**"):
            with graph.inserting_after(node):
                graph.call_function(check_no_kwargs, (node, name))


@dataclass
class Captured:
    name: str  # qualified module name in the model ("" for the model itself)
    gm: fx.GraphModule


@dataclass
class Uncaptured:
    name: str
    reason: str


def capture(
    model: nn.Module, holds_block: Callable[[str, fx.GraphModule], bool],
    holds_part: Callable[[fx.GraphModule], bool] = lambda gm: True,
) -> tuple[list[Captured], list[Uncaptured]]:
    """Trace, post-order, every module with linear layers not yet inside a captured or opaque
    child; keep those whose graph `holds_block`. A module that traces but neither holds a
    block nor `holds_part` of one (an attention) is a leaf for its parents: traced inline, its
    branches on optional inputs (`if cache is not None`) would be fixed by the trace, and its
    parent's graph would fail without them. Returns (captured, modules kept eager)."""
    opaque: set[nn.Module] = set()
    done: set[nn.Module] = set()  # captured modules and modules with no part of a block: leaves
    captured: list[Captured] = []
    eager: list[Uncaptured] = []

    def free_linears(mod: nn.Module) -> bool:
        for child in mod.children():
            if child in opaque or child in done:
                continue
            if isinstance(child, nn.Linear) or free_linears(child):
                return True
        return False

    def visit(name: str, mod: nn.Module) -> None:
        for child_name, child in mod.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        if isinstance(mod, (nn.Linear, SparseFFN, nn.ModuleList, nn.ModuleDict)) or (
                not free_linears(mod)):  # (containers have no forward: their parent calls in)
            return
        try:
            gm = trace(mod, name, opaque | done)
        except Exception as e:  # noqa: BLE001 - any trace failure means: keep it eager
            opaque.add(mod)
            if any(isinstance(c, nn.Linear) for c in mod.children()):
                eager.append(Uncaptured(name or type(mod).__name__,
                                        f"torch.fx cannot trace it, kept eager: {first_sentence(e)}"))
            return
        if holds_block(name, gm):
            captured.append(Captured(name, gm))
            done.add(mod)
        elif not holds_part(gm):
            done.add(mod)

    visit("", model)
    return captured, eager


def first_sentence(e: Exception) -> str:
    """The first sentence of an exception's message, whole (explain() shows it as the reason)."""
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    head, dot, _ = line.partition(". ")
    return head + "." if dot else line


def replace_module(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put `new` where `name` is; returns the model (a new root if name is "")."""
    if name == "":
        return new
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
    return model

