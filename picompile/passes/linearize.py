"""Linearize: GPT-2's Conv1D layers become nn.Linear, before capture.

transformers' Conv1D (GPT-2 and its fine-tunes, DialoGPT, distilgpt2) computes x @ W + b with
W stored [in, out], the transpose of nn.Linear's [out, in]. Every later pass (detect, the
rewrite into one row per neuron, the dense kernels, quantization, GGUF names) reads nn.Linear,
so each Conv1D is replaced by an nn.Linear holding W transposed (a copy): one place knows about
Conv1D, nothing after it does. The Conv1D modules are kept until compile no longer undoes
itself on an error (put_back), then dropped with their weights.
"""

from __future__ import annotations

from torch import nn


def is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (transformers.pytorch_utils), by class name and module."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")


def conv1d_to_linear(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Replace every Conv1D under `model` by an equal nn.Linear (same device, dtype and
    requires_grad). Returns (parent, attribute, Conv1D) per replacement, for put_back; a Conv1D
    under several names becomes one Linear under all of them."""
    swapped, linears = [], {}
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if child is None or not is_conv1d(child):
                continue
            if id(child) not in linears:
                linears[id(child)] = _linear(child)
            setattr(parent, name, linears[id(child)])
            swapped.append((parent, name, child))
    return swapped


def put_back(swapped: list[tuple[nn.Module, str, nn.Module]]) -> None:
    """Undo conv1d_to_linear: each Conv1D back where it was."""
    for parent, name, conv in swapped:
        setattr(parent, name, conv)


def _linear(conv: nn.Module) -> nn.Linear:
    w = conv.weight  # [in, out]
    lin = nn.Linear(w.shape[0], w.shape[1], bias=conv.bias is not None, device="meta")
    lin.weight = nn.Parameter(w.detach().t().contiguous(), requires_grad=w.requires_grad)
    if conv.bias is not None:
        lin.bias = nn.Parameter(conv.bias.detach().clone(), requires_grad=conv.bias.requires_grad)
    lin.train(conv.training)
    return lin
