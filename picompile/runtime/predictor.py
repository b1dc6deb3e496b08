"""Predictor: the small per-block MLP that guesses, from the block input, which neurons fire.

Trained by passes/predictors.py; run by SparseFFN (its `predictor` attribute) and by the
whole-step decoder through its C kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from picompile.codegen import c as c_codegen
from picompile.config import KERNEL_MAX_TOKENS
from picompile.runtime import ops
from picompile.runtime.kernel_module import KernelModule


ALWAYS_LOGIT = 1e4  # a predicted neuron's logit where it must always be computed (always())


class Predictor(KernelModule):
    """mask [T, n_ff] = relu(x p1^T + pb1) p2^T + pb2 > tau, for x [T, d].

    `enabled` False makes it return None (the block then runs exact; CompiledModel.use_predictors
    decides). Small batches run a C kernel (picked once by select_kernel); `forward_native` is its
    reference. The weight matrices hold float16 values (in float32 tensors): the C kernel reads
    them as float16, half the bytes, and computes exactly the products the reference does."""

    def __init__(self, p1: torch.Tensor, pb1: torch.Tensor, p2: torch.Tensor, pb2: torch.Tensor,
                 tau: float = 0.0):
        super().__init__()
        self.p1 = nn.Parameter(_float16_values(p1), requires_grad=False)  # [r, d]
        self.pb1 = nn.Parameter(pb1.float(), requires_grad=False)  # [r]
        self.p2 = nn.Parameter(_float16_values(p2), requires_grad=False)  # [n_ff, r], a row per neuron
        self.pb2 = nn.Parameter(pb2.float(), requires_grad=False)  # [n_ff]
        self.tau = float(tau)
        self.enabled = True
        self.kernel = None

    @property
    def rank(self) -> int:
        return self.p1.shape[0]

    @torch.no_grad()
    def always(self, neurons: torch.Tensor) -> None:
        """Predict `neurons` (indices) for every input: their output bias set to ALWAYS_LOGIT,
        far above any tau (and within float16's range, for the GPU's 16-bit predictors)."""
        self.pb2[neurons.to(self.pb2.device)] = ALWAYS_LOGIT

    def select_kernel(self) -> str:
        self._selected = True  # select again after a dtype / device change (_apply)
        self.kernel = c_codegen.predictor_kernel_for(self)
        return "C" if self.kernel is not None else "reference"

    def logits(self, x: torch.Tensor) -> torch.Tensor:  # [T, d] -> [T, n_ff]
        z = F.relu(F.linear(x.to(self.p1.dtype), self.p1, self.pb1))
        return F.linear(z, self.p2, self.pb2)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:  # [T, d] -> [T, n_ff] bool
        return self.logits(x) > self.tau

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:  # [..., d] -> [T, n_ff] bool
        if not self.enabled:
            return None
        if torch.compiler.is_compiling():  # traced (torch.export): one op node, runtime/ops.py
            return ops.call_predictor(self, x)
        x = x.reshape(-1, self.p1.shape[1])
        if self.kernel is not None and x.shape[0] <= KERNEL_MAX_TOKENS and x.device.type == "cpu":
            return self.kernel(x, self.tau)
        return self.forward_native(x)

    def extra_repr(self) -> str:
        return f"d={self.p1.shape[1]}, rank={self.rank}, n_ff={self.p2.shape[0]}, tau={self.tau:.3g}"


def _float16_values(t: torch.Tensor) -> torch.Tensor:
    """t rounded to float16 precision, kept as float32."""
    return t.detach().float().clamp(-65504, 65504).half().float()
