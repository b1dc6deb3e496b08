"""picompile's kernel modules as torch custom ops (namespace `picompile`), so that torch.export
and Dynamo see one node per FFN block, predictor or lowered linear instead of tracing into ctypes.

    picompile::sparse_ffn(x, handle, predicted=None)  x [..., d] -> [..., d]  (SparseFFN)
    picompile::predictor(x, handle, n_ff)             x [..., d] -> [T, n_ff] bool (Predictor)
    picompile::linear(x, handle, out_features)        x [..., K] -> [..., O]  (Dense/QuantLinear)

Design: an op carries the handle of its module (an int, `handle(module)`), and its real
implementation calls that module's own `forward`. That keeps one source of truth: what the module
runs now (the kernel selected again after a dtype change, a new threshold, the hybrid split, its
statistics) is what the op runs, and nothing is copied into the graph. Passing the weight tensors
instead would make the graph self-contained, but the op would have to find the bound kernel again
from the tensors on every call and repeat the module's dispatch. The price of handles: a graph
refers to live modules of this process (it cannot be saved and run elsewhere), and calling it
after its module was freed raises.

The modules call `call_*` below instead of their own body while torch is tracing them
(`torch.compiler.is_compiling()`: torch.export, strict or not, and Dynamo), and run eagerly
otherwise. The fake (meta) implementations give the output's shape and dtype from the inputs and
the sizes passed as ints, never touching the module.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn

_next_handle = itertools.count(1)
# handle -> module and module -> handle; weak, so that a handle never keeps a model alive. Not
# stored on the module itself: copy.deepcopy would give the copy the same handle.
_modules: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
_handles: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


@torch.compiler.assume_constant_result  # Dynamo calls it while tracing, a constant in the graph
def handle(module: nn.Module) -> int:
    """The module's handle (given on first use, the same for its lifetime)."""
    h = _handles.get(module)
    if h is None:
        h = _handles[module] = next(_next_handle)
        _modules[h] = module
    return h


def module_of(h: int) -> nn.Module:
    """The live module behind a handle; raises where it was freed."""
    module = _modules.get(h)
    if module is None:
        raise RuntimeError(f"picompile: the module of op handle {h} no longer exists (a graph "
                           "captured from a model that was freed); capture the model again")
    return module


# ---- the ops -------------------------------------------------------------------------------
# Defined with torch.library.Library rather than the torch.library.custom_op decorator: the
# decorator's Python autograd and aliasing wrappers run on every call, a cost per op node that
# a decode step of a 30-layer model pays some 150 times. Under CompositeExplicitAutograd the
# implementation is called directly; the ops have no gradient.

_lib = torch.library.Library("picompile", "DEF")  # the namespace: defined once per process
_lib.define("sparse_ffn(Tensor x, int handle, Tensor? predicted=None) -> Tensor")
_lib.define("predictor(Tensor x, int handle, int n_ff) -> Tensor")
_lib.define("linear(Tensor x, int handle, int out_features) -> Tensor")


def _sparse_ffn(x: torch.Tensor, handle: int,
                predicted: torch.Tensor | None = None) -> torch.Tensor:
    """SparseFFN.forward: x [..., d] -> [..., d] in x's dtype; predicted [T, n_ff] bool or None."""
    return module_of(handle).forward(x, predicted)


def _predictor(x: torch.Tensor, handle: int, n_ff: int) -> torch.Tensor:
    """Predictor.forward of an enabled predictor: x [..., d] -> mask [T, n_ff] bool."""
    return module_of(handle).forward(x)


def _linear(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """DenseLinear / QuantLinear .forward: x [..., K] -> [..., out_features] in x's dtype."""
    return module_of(handle).forward(x)


def _sparse_ffn_fake(x, handle, predicted=None):
    return torch.empty_like(x)


def _predictor_fake(x, handle, n_ff):
    tokens = x.numel() // x.shape[-1]
    return x.new_empty(tokens, n_ff, dtype=torch.bool)


def _linear_fake(x, handle, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


for _name, _impl, _fake in (("sparse_ffn", _sparse_ffn, _sparse_ffn_fake),
                            ("predictor", _predictor, _predictor_fake),
                            ("linear", _linear, _linear_fake)):
    _lib.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"picompile::{_name}", _fake, lib=_lib)


# ---- what the modules call while traced ---------------------------------------------------


def call_sparse_ffn(module: nn.Module, x: torch.Tensor,
                    predicted: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.picompile.sparse_ffn(x, handle(module), predicted)


def call_predictor(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.picompile.predictor(x, handle(module), module.p2.shape[0])


def call_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.picompile.linear(x, handle(module), module.out_features)
