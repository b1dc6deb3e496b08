"""SparseFFN: one activation-sparse FFN block, with a plain-PyTorch reference next to every kernel.

Math, shared by the reference and every kernel (C, CUDA). For each token t and each candidate
neuron j (all neurons, or the candidate list `idx`):

    gated / dReLU:  a = act(x[t] . w_gate[j] + b_gate[j])
                    u = x[t] . w_up[j] + b_up[j]          (dReLU: u = relu(u))
                    h = a * u
    plain:          h = act(x[t] . w_up[j] + b_up[j])
    neuron j is active for token t iff |h| > threshold       (threshold 0: exactly the nonzeros)
    out[t] = sum over active j of h * w_down_t[j]  + b_down

Weights are stored one row per neuron: w_gate, w_up and w_down_t are all [n_ff, d] (w_down_t is the
down projection's weight transposed), so a neuron's bytes are contiguous. For ReLU blocks the rows
of up and down are only read for neurons whose gate fired, which is what makes exact mode fast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from picompile.config import KERNEL_MAX_TOKENS, reference_forced
from picompile.plan import BlockPlan
from picompile.runtime.kernel_module import KernelModule


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "relu":
        return F.relu(x)
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    raise ValueError(f"unsupported activation {name!r}")


def down_input(
    x: torch.Tensor,  # [T, d]
    w_up: torch.Tensor,  # [n_ff, d]
    *,
    w_gate: torch.Tensor | None = None,  # [n_ff, d] or None (plain block)
    b_gate: torch.Tensor | None = None,  # [n_ff]
    b_up: torch.Tensor | None = None,  # [n_ff]
    act: str = "relu",
    drelu: bool = False,
    idx: torch.Tensor | None = None,  # [m] int candidate neurons, or None for all
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """h [T, m]: the down projection's input for the candidate neurons, before thresholding."""
    cd = compute_dtype
    x = x.to(cd)

    def rows(t):
        if t is None:
            return None
        return (t if idx is None else t.index_select(0, idx.long())).to(cd)

    if w_gate is not None:
        a = activation(act, F.linear(x, rows(w_gate), rows(b_gate)))  # [T, m]
        u = F.linear(x, rows(w_up), rows(b_up))  # [T, m]
        return a * (F.relu(u) if drelu else u)
    return activation(act, F.linear(x, rows(w_up), rows(b_up)))  # [T, m]


def ffn_reference(
    x: torch.Tensor,  # [T, d]
    w_up: torch.Tensor,  # [n_ff, d]
    w_down_t: torch.Tensor,  # [n_ff, d]
    *,
    b_down: torch.Tensor | None = None,  # [d]
    threshold: float = 0.0,
    idx: torch.Tensor | None = None,  # [m] int candidate neurons, or None for all
    compute_dtype: torch.dtype = torch.float32,
    **gate_and_act,  # w_gate, b_gate, b_up, act, drelu: as down_input takes them
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain-PyTorch reference of the block math above.

    Returns (out [T, d] in compute_dtype, active [T, m] bool over the candidates)."""
    h = down_input(x, w_up, idx=idx, compute_dtype=compute_dtype, **gate_and_act)  # [T, m]
    active = h.abs() > threshold  # [T, m]
    h = torch.where(active, h, torch.zeros((), dtype=compute_dtype))
    w_down_t = w_down_t if idx is None else w_down_t.index_select(0, idx.long())
    out = h @ w_down_t.to(compute_dtype)  # [T, d]
    if b_down is not None:
        out = out + b_down.to(compute_dtype)
    return out, active


class SparseFFN(KernelModule):
    """One rewritten FFN block: `y = down(act(gate x) * up x)` computing only the active neurons.

    The fast path (a generated C kernel, later a CUDA kernel) is picked once, when the module is
    built; `forward_native` is the reference every kernel is tested against."""

    def __init__(
        self,
        block: BlockPlan,
        w_up: torch.Tensor,
        w_down_t: torch.Tensor,
        w_gate: torch.Tensor | None = None,
        b_gate: torch.Tensor | None = None,
        b_up: torch.Tensor | None = None,
        b_down: torch.Tensor | None = None,
    ):
        super().__init__()
        self.block = block
        self.act = block.act
        self.drelu = block.kind == "drelu"
        self.threshold = float(block.threshold)

        def param(t):
            return None if t is None else nn.Parameter(t.detach().contiguous(), requires_grad=False)

        self.w_gate = param(w_gate)  # [n_ff, d]
        self.w_up = param(w_up)  # [n_ff, d]
        self.w_down_t = param(w_down_t)  # [n_ff, d]
        self.b_gate = param(b_gate)  # [n_ff]
        self.b_up = param(b_up)  # [n_ff]
        self.b_down = param(b_down)  # [d]
        self.predictor = None  # a passes.predictors.Predictor in mode="predicted"
        self.order = None  # LongTensor [n_ff]: the hot-first permutation applied, if any
        self.hybrid = None  # a runtime.hybrid.HybridFFN once the model is distributed
        self.kernel = None  # set by select_kernel(); None runs forward_native
        self.reset_stats()

    # -- statistics: how sparse the block really ran ------------------------------------------
    def reset_stats(self) -> None:
        self.active_pairs = 0  # (token, neuron) pairs that fired and were computed
        self.total_pairs = 0  # (token, neuron) pairs a dense block computes
        if getattr(self, "hybrid", None) is not None:
            self.hybrid.reset_stats()

    @property
    def sparsity(self) -> float | None:
        if self.total_pairs == 0:
            return None
        return 1.0 - self.active_count() / self.total_pairs

    def active_count(self) -> int:
        """(token, neuron) pairs that fired and were computed since reset_stats()."""
        active = int(self.active_pairs)  # may be a device tensor (no sync until read)
        if self.hybrid is not None:
            active += self.hybrid.active_pairs()
        return active

    @property
    def n_ff(self) -> int:
        return self.w_up.shape[0]

    @property
    def d_model(self) -> int:
        return self.w_up.shape[1]

    def select_kernel(self) -> str:
        """Pick the execution path once. Returns its name (for explain)."""
        self.kernel = None
        self._selected = True  # select again after a dtype / device change (_apply)
        if reference_forced():
            return "reference (PICOMPILE_REFERENCE set)"
        from picompile.codegen import c as c_codegen

        self.kernel = c_codegen.kernel_for(self)
        return "C" if self.kernel is not None else c_codegen.why_no_kernel(self)

    def _check_movable(self) -> None:
        if self.hybrid is not None:
            raise RuntimeError(
                "picompile: this block runs split across the GPU and the CPU (distribute()); its "
                "dtype or device cannot change afterwards. Compile the model again with the "
                "dtype / device you want")

    def __getstate__(self):
        if self.hybrid is not None and self.hybrid.cuda:
            raise TypeError("picompile: a model distributed across GPU and CPU cannot be pickled; "
                            "save its plan with cm.save(dir) and picompile.load(model, dir)")
        return super().__getstate__()

    def weights(self) -> dict:
        """The tensors in the keyword form ffn_reference and the kernels take."""
        return dict(
            w_up=self.w_up,
            w_down_t=self.w_down_t,
            w_gate=self.w_gate,
            b_gate=self.b_gate,
            b_up=self.b_up,
            b_down=self.b_down,
        )

    def forward_native(
        self, x: torch.Tensor, idx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> (out [T, d] float32, active [T, m] bool). The reference path."""
        return ffn_reference(
            x, **self.weights(), act=self.act, drelu=self.drelu, threshold=self.threshold, idx=idx
        )

    def forward(self, x: torch.Tensor, predicted: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., d] -> [..., d]. `predicted` [T, n_ff] bool (from the block's predictor):
        only those neurons are computed; without it every neuron is a candidate."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [T, d]
        tokens = x2.shape[0]
        self.total_pairs += tokens * self.n_ff
        if self.hybrid is not None:  # hot rows on the GPU, cold rows on the CPU
            return self.hybrid(x2, predicted).to(x.dtype).reshape(shape)
        if tokens <= KERNEL_MAX_TOKENS:
            # Decode / small batch: one candidate list for all tokens (their union).
            if self.kernel is not None:
                out, n_active = self.kernel(x2, threshold=self.threshold, mask=predicted)
            else:
                idx = None if predicted is None else predicted.any(0).nonzero().flatten()
                out, active = self.forward_native(x2, idx)
                n_active = int(active.sum())
        else:
            # Prefill: dense BLAS in the weights' own dtype (as the dense model does), masked
            # per token by what fired and, in predicted mode, by what was predicted.
            h = down_input(x2, self.w_up, w_gate=self.w_gate, b_gate=self.b_gate, b_up=self.b_up,
                           act=self.act, drelu=self.drelu, compute_dtype=self.w_up.dtype)
            active = h.abs() > self.threshold
            if predicted is not None:
                active &= predicted
            out = torch.where(active, h, torch.zeros((), dtype=h.dtype)) @ self.w_down_t
            if self.b_down is not None:
                out = out + self.b_down
            n_active = int(active.sum())
        self.active_pairs += n_active
        return out.to(x.dtype).reshape(shape)

    def extra_repr(self) -> str:
        b = self.block
        mode = "exact" if self.threshold == 0 else f"threshold={self.threshold:.4g}"
        return f"{b.kind}, act={b.act}, d={self.d_model}, n_ff={self.n_ff}, {mode}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


