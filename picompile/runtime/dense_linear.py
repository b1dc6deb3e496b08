"""DenseLinear: an nn.Linear run by picompile's dense C kernel at decode, F.linear otherwise.

    y = x @ weight.T + bias          x [..., K] -> y [..., O], in x's dtype

`forward_native` is F.linear, the reference the kernel is tested against. `forward` runs the
kernel (picompile/kernels/dense.c through picompile.codegen.dense) when 1 <= T <= 8 tokens
(leading dimensions flattened) on the CPU, and F.linear for prefill, on other devices, and where
there is no kernel. The kernel accumulates in float32 and its result is cast to x's dtype.

The module holds the very Parameter objects of the nn.Linear it replaces (`from_linear`), so tied
weights stay tied (an LM head tied to the embedding) and state_dict keys are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from picompile.runtime.kernel_module import KernelModule
from picompile.config import KERNEL_MAX_TOKENS, reference_forced


class _KernelLinear(torch.autograd.Function):
    """The kernel's forward with F.linear's gradients (only used while autograd records)."""

    @staticmethod
    def forward(ctx, x2, weight, bias, kernel):  # x2 [T, K] -> [T, O] in x2's dtype
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return kernel(x2).to(x2.dtype)

    @staticmethod
    def backward(ctx, grad):  # grad [T, O]
        x2, weight = ctx.saved_tensors
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (grad.to(weight.dtype) @ weight).to(x2.dtype)  # [T, K]
        if ctx.needs_input_grad[1]:
            gw = (grad.t().to(x2.dtype) @ x2).to(weight.dtype)  # [O, K]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = grad.sum(0).to(ctx.bias_dtype)  # [O]
        return gx, gw, gb, None


class DenseLinear(KernelModule):
    """A weight-bearing linear layer (q/k/v/o projections, the LM head) with a generated kernel.

    The path is picked once (`select_kernel`), again after .to() / .half() / .cuda() (`_apply`:
    the kernel holds raw pointers), and when the weight's or bias's storage was swapped
    (`.data = ...`, load_state_dict(assign=True)). In-place updates of contiguous weights are
    seen by the kernel directly."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None):
        super().__init__()
        if not isinstance(weight, nn.Parameter):
            weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias, requires_grad=False)
        self.weight = weight  # [O, K]: the replaced nn.Linear's own Parameter
        self.register_parameter("bias", bias)  # [O] or None (registered either way, as nn.Linear)
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.kernel = None  # set by select_kernel(); None runs F.linear
        self.path = "reference (C kernel not selected)"
        self._bound = None  # (weight ptr, bias ptr) the kernel was bound to

    @classmethod
    def from_linear(cls, linear: nn.Linear, select: bool = True) -> DenseLinear:
        mod = cls(linear.weight, linear.bias)
        mod.train(linear.training)
        if select:
            mod.select_kernel()
        return mod

    def _ptrs(self) -> tuple:
        return (self.weight.data_ptr(), None if self.bias is None else self.bias.data_ptr())

    def select_kernel(self) -> str:
        """Pick the execution path once; returns its name ("C float32 avx2", "reference (...)")."""
        from picompile.codegen import dense

        self.kernel = None
        self._selected = True  # select again after a dtype / device change (_apply)
        self._bound = self._ptrs()
        if reference_forced():
            self.path = "reference (PICOMPILE_REFERENCE set)"
            return self.path
        self.kernel = dense.dense_kernel_for(self.weight, self.bias)
        self.path = (f"C {self.kernel.variant}" if self.kernel is not None
                     else dense.why_no_kernel(self.weight, self.bias))
        return self.path

    def __getstate__(self):
        state = super().__getstate__()
        state["_bound"] = None
        return state

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., O]: the reference path."""
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., O] in x's dtype."""
        params = self._parameters  # (faster than attribute lookups: this runs per token)
        weight, bias = params["weight"], params["bias"]
        kernel = self.kernel
        if kernel is None or not x.is_cpu or x.dim() == 0:
            return F.linear(x, weight, bias)
        K = x.shape[-1]
        T = x.numel() // K if K else 0
        if not 1 <= T <= KERNEL_MAX_TOKENS or not x.is_floating_point():
            return F.linear(x, weight, bias)
        if (weight.data_ptr(), None if bias is None else bias.data_ptr()) != self._bound:
            self.select_kernel()  # storage swapped since binding (.data = ...): bind again
            kernel = self.kernel
            if kernel is None:
                return F.linear(x, weight, bias)
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (
                bias is not None and bias.requires_grad)):
            out = _KernelLinear.apply(x.reshape(T, K), weight, bias, kernel)
            return out.view(*x.shape[:-1], out.shape[-1])
        out = kernel(x)  # [..., O] float32
        return out if x.dtype is torch.float32 else out.to(x.dtype)

    def extra_repr(self) -> str:
        dtype = str(self.weight.dtype).removeprefix("torch.")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, dtype={dtype}, "
                f"path={self.path}")
