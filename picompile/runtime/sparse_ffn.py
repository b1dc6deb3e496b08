"""SparseFFN: one activation-sparse FFN block, with a plain-PyTorch reference next to every kernel.

Math, shared by the reference and every kernel (C, CUDA). For each token t and each candidate
neuron j (all neurons, or the candidate list `idx`):

    gated / dReLU:  a = act(x[t] . w_gate[j] + b_gate[j])
                    u = x[t] . w_up[j] + b_up[j]          (dReLU: u = relu(u))
                    h = a * u
    plain:          h = act(x[t] . w_up[j] + b_up[j])
    neuron j is active for token t iff |h| > threshold       (threshold 0: exactly the nonzeros)
        and, with a predictor's mask [T, n_ff], it is set for token t  (`allowed`)
    out[t] = sum over active j of h * w_down_t[j]  + b_down

Weights are stored one row per neuron: w_gate, w_up and w_down_t are all [n_ff, d] (w_down_t is the
down projection's weight transposed), so a neuron's bytes are contiguous. For ReLU blocks the rows
of up and down are only read for neurons whose gate fired, which is what makes exact mode fast.

Quantized blocks (`SparseFFN.quantize_`, `qformat` "q8_0" | "q4_0" | "q4_1") hold the three
matrices as uint8 [n_ff, d / 32 * block bytes], each row its GGUF blocks of 32 weights along d
(picompile/quant.py), so a neuron's row stays contiguous; biases stay float. `qformat` is the
format of the gate and up rows; the down rows may have their own, `down_qformat` (e.g. q4_1 gate
and up with q8_0 down), or stay float (down_qformat None, w_down_t a float tensor). The math is
the same over the dequantized weights: the reference functions take `qformat` / `down_qformat`
and dequantize the rows they use (quant.dequantize), the C kernels dequantize in registers. Quantized
gate and up rows are dotted with x rounded to integer blocks (quant.round_activations), in the
reference as in the kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from picompile import quant
from picompile.config import KERNEL_MAX_TOKENS, PREFILL_KERNEL_FORMATS, reference_forced
from picompile.plan import BlockPlan
from picompile.runtime import ops
from picompile.runtime.dense_linear import float32_weight, float_weight
from picompile.runtime.kernel_module import KernelModule


def down_format(qformat: str | None, down_qformat: str | None,
                w_down_t: torch.Tensor) -> str | None:
    """The block format of w_down_t: `down_qformat` when given; else `qformat` where w_down_t is
    uint8 row blocks (one format for all three matrices), None where it is float."""
    if down_qformat is not None:
        return down_qformat
    return qformat if w_down_t.dtype == torch.uint8 else None


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "relu":
        return F.relu(x)
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "relu2":
        return torch.square(F.relu(x))
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
    qformat: str | None = None,  # w_gate and w_up: uint8 rows of this format, dot layout
) -> torch.Tensor:
    """h [T, m]: the down projection's input for the candidate neurons, before thresholding
    (quantized gate / up rows are in the kernels' dot layout, quant.interleave_blocks, and are
    dotted with x rounded to integer blocks, quant.round_activations)."""
    cd = compute_dtype
    x = quant.round_activations(x, qformat).to(cd)

    def rows(t):
        if t is None:
            return None
        t = t if idx is None else t.index_select(0, idx.long())
        if qformat is not None and t.dim() == 2:  # a weight matrix: only its used rows
            t = quant.dequantize(quant.deinterleave_blocks(t, qformat), qformat, x.shape[-1])
        return t.to(cd)

    gate = None if w_gate is None else F.linear(x, rows(w_gate), rows(b_gate))  # [T, m]
    return combine(F.linear(x, rows(w_up), rows(b_up)), gate, act, drelu)


def combine(up: torch.Tensor, gate: torch.Tensor | None, act: str, drelu: bool) -> torch.Tensor:
    """h [T, m] from the up (and gate) products [T, m]: act(gate) * up (dReLU: * relu(up)),
    or act(up) for a plain block."""
    if gate is None:
        return activation(act, up)
    return activation(act, gate) * (F.relu(up) if drelu else up)


def predicted_candidates(predicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A predictor's mask [T, n_ff] bool -> (idx [m]: the neurons set for any token, ascending;
    allowed [T, m]: which of them each token's row sets), ffn_reference's idx and allowed."""
    idx = predicted.any(0).nonzero().flatten()
    return idx, predicted[:, idx]


def ffn_reference(
    x: torch.Tensor,  # [T, d]
    w_up: torch.Tensor,  # [n_ff, d]
    w_down_t: torch.Tensor,  # [n_ff, d]
    *,
    b_down: torch.Tensor | None = None,  # [d]
    threshold: float = 0.0,
    idx: torch.Tensor | None = None,  # [m] int candidate neurons, or None for all
    allowed: torch.Tensor | None = None,  # [T, m] bool: token t uses candidate i (None: all)
    compute_dtype: torch.dtype = torch.float32,
    qformat: str | None = None,  # w_gate and w_up: uint8 rows of this format, dot layout
    down_qformat: str | None = None,  # w_down_t's format (None: see down_format)
    **gate_and_act,  # w_gate, b_gate, b_up, act, drelu: as down_input takes them
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain-PyTorch reference of the block math above (quantized weights: over the
    dequantized weights).

    Returns (out [T, d] in compute_dtype, active [T, m] bool over the candidates)."""
    h = down_input(x, w_up, idx=idx, compute_dtype=compute_dtype, qformat=qformat,
                   **gate_and_act)  # [T, m]
    active = h.abs() > threshold  # [T, m]
    if allowed is not None:
        active &= allowed
    h = torch.where(active, h, torch.zeros((), dtype=compute_dtype))
    down_qformat = down_format(qformat, down_qformat, w_down_t)
    w_down_t = w_down_t if idx is None else w_down_t.index_select(0, idx.long())
    if down_qformat is not None:
        w_down_t = quant.dequantize(w_down_t, down_qformat, x.shape[-1])
    out = h @ w_down_t.to(compute_dtype)  # [T, d]
    if b_down is not None:
        out = out + b_down.to(compute_dtype)
    return out, active


class SparseFFN(KernelModule):
    """One rewritten FFN block: `y = down(act(gate x) * up x)` computing only the active neurons.

    The fast path (a generated C kernel, later a CUDA kernel) is picked once, when the module is
    built; `forward_native` is the reference every kernel is tested against."""

    qformat: str | None = None  # "q8_0" | "q4_0" | "q4_1": gate / up weights are uint8 row blocks
    down_qformat: str | None = None  # the same for w_down_t (None: float); see quantize_

    def __init__(
        self,
        block: BlockPlan,
        w_up: torch.Tensor,
        w_down_t: torch.Tensor,
        w_gate: torch.Tensor | None = None,
        b_gate: torch.Tensor | None = None,
        b_up: torch.Tensor | None = None,
        b_down: torch.Tensor | None = None,
        qformat: str | None = None,
        down_qformat: str | None = None,
    ):
        """Weights [n_ff, d] float, or with `qformat` already quantized: uint8 row blocks
        [n_ff, quant.row_bytes(d, qformat)], the gate and up rows in the dot layout
        (quant.interleave_blocks; see quantize_). w_down_t: in `down_qformat` when
        given, else in `qformat` when it is uint8, else float [n_ff, d] (down_format)."""
        super().__init__()
        down_qformat = down_format(qformat, down_qformat, w_down_t)
        if qformat is None and (down_qformat is not None or w_down_t.dtype == torch.uint8):
            raise ValueError("picompile: a quantized down projection (down_qformat) needs "
                             "quantized gate and up rows (qformat)")
        if qformat is not None:
            d = None  # the gate / up rows' width, which the down rows must match
            for t, fmt in ((w_up, qformat), (w_gate, qformat), (w_down_t, down_qformat)):
                if t is None:
                    continue
                if fmt is None:  # float down rows
                    if not t.is_floating_point() or t.dim() != 2 or t.shape[1] != d:
                        raise ValueError(f"float down weights are [n_ff, d={d}], got {t.dtype} "
                                         f"{tuple(t.shape)}")
                    continue
                bb = quant.format_of(fmt).block_bytes
                if t.dtype != torch.uint8 or t.dim() != 2 or t.shape[1] % bb:
                    raise ValueError(f"{fmt} weights are uint8 [n_ff, d / {quant.BLOCK} * "
                                     f"{bb}], got {t.dtype} {tuple(t.shape)}")
                d = d or t.shape[1] // bb * quant.BLOCK
                if t.shape[1] != quant.row_bytes(d, fmt):
                    raise ValueError(f"{fmt} weights of d={d} are uint8 [n_ff, "
                                     f"{quant.row_bytes(d, fmt)}], got {tuple(t.shape)}")
        self.qformat = qformat  # None: float weights
        self.down_qformat = down_qformat  # None: float down rows
        self.block = block
        self.act = block.act
        self.drelu = block.kind == "drelu"
        self.threshold = float(block.decided.threshold)

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
        if self.qformat is None:
            return self.w_up.shape[1]
        return self.w_up.shape[1] // quant.format_of(self.qformat).block_bytes * quant.BLOCK

    @property
    def row_bytes(self) -> int:
        """Bytes of one neuron's row of w_gate or w_up: what the kernels read per gate / up row,
        quantized or not (down rows: down_row_bytes)."""
        return self.w_up.shape[1] * self.w_up.element_size()

    @property
    def down_row_bytes(self) -> int:
        """Bytes of one neuron's row of w_down_t (in down_qformat, or its float dtype)."""
        return self.w_down_t.shape[1] * self.w_down_t.element_size()

    @property
    def down_format(self) -> str:
        """The down rows' format, for reports: down_qformat, or w_down_t's float dtype."""
        return self.down_qformat or dtype_name(self.w_down_t.dtype)

    @property
    def float_dtype(self) -> torch.dtype:
        """The dtype of the block's math outside the C kernels (prefill, inputs for timing): the
        weights' dtype, float32 for quantized blocks."""
        return torch.float32 if self.qformat is not None else self.w_up.dtype

    @torch.no_grad()
    def quantize_(self, fmt: str, down_fmt: str | None = None,
                  blocks: dict[str, torch.Tensor] | None = None) -> SparseFFN:
        """Quantize the block in place to `fmt` ("q8_0" | "q4_0" | "q4_1", picompile/quant.py):
        w_gate and w_up become uint8 row blocks [n_ff, d / 32 * block bytes] (GGUF's blocks of
        32 weights along d, one neuron's row contiguous, in the kernels' dot layout:
        quant.interleave_blocks; `row_blocks` gives GGUF's), and so does w_down_t in `down_fmt`
        (GGUF's layout: down rows are added, not dotted)
        (None: `fmt`; a float dtype name, "float32" | "float16" | "bfloat16", keeps the down
        rows float in that dtype); biases float32; the kernel is selected again. A matrix
        already in its format is left as it is; one in another format is dequantized and
        quantized again. Raises ValueError when d is not a multiple of 32 (the block must stay
        float), and for a block split across devices (distribute() runs after quantizing).
        blocks: {"w_gate" | "w_up" | "w_down_t": uint8 [n_ff, row bytes]} chosen elsewhere (GPTQ,
        a GGUF file), in GGUF's layout, taken instead of rounding those rows to nearest.
        Predictors are untouched. Returns self."""
        f = quant.format_of(fmt)
        down_fmt = down_fmt or f.name
        down_float = _FLOAT_DTYPES.get(down_fmt)
        if down_float is None:
            down_fmt = quant.format_of(down_fmt).name
        if self.hybrid is not None:
            raise ValueError("picompile: quantize a block before distribute(): this one already "
                             "runs split across the GPU and the CPU")
        blocks = blocks or {}
        if self.qformat == f.name and self.down_format == down_fmt and not blocks:
            return self
        d = self.d_model
        if d % quant.BLOCK:
            raise ValueError(f"picompile: cannot quantize this FFN block to {fmt}: its rows hold "
                             f"d={d} weights, not a multiple of {quant.BLOCK} (the {fmt} block "
                             "size); the block must stay float")
        for name, have, want in (("w_gate", self.qformat, f.name), ("w_up", self.qformat, f.name),
                                 ("w_down_t", self.down_qformat, down_fmt)):
            w, given = getattr(self, name), blocks.get(name)
            if w is None or (given is None and have == want):
                continue
            dotted = name != "w_down_t" and want not in _FLOAT_DTYPES  # gate / up: dot layout
            if given is not None:
                shape = (self.n_ff, quant.row_bytes(d, want))
                if (want in _FLOAT_DTYPES or given.dtype != torch.uint8
                        or tuple(given.shape) != shape):
                    raise ValueError(f"picompile: {name} blocks given as {given.dtype} "
                                     f"{tuple(given.shape)}; {want} rows of this block are uint8 "
                                     f"{shape}")
                q = given.to(w.device, copy=True)  # never the caller's memory (a mapped file)
            else:
                if have is not None:
                    old = quant.deinterleave_blocks(w, have) if name != "w_down_t" else w
                    w = quant.dequantize(old, have, d).to(w.device)
                if want in _FLOAT_DTYPES:
                    q = w.detach().to(_FLOAT_DTYPES[want]).contiguous()
                else:
                    q = quant.quantize(w, want).to(w.device)
            if dotted:
                q = quant.interleave_blocks(q, want)
            setattr(self, name, nn.Parameter(q, requires_grad=False))
        for name in ("b_gate", "b_up", "b_down"):
            b = getattr(self, name)
            if b is not None:
                setattr(self, name, nn.Parameter(b.detach().to(torch.float32).contiguous(),
                                                 requires_grad=False))
        self.qformat = f.name
        self.down_qformat = None if down_float is not None else down_fmt
        self.select_kernel()
        return self

    def row_blocks(self, name: str) -> torch.Tensor:
        """w_gate / w_up / w_down_t of a quantized block in GGUF's row layout (uint8 [n_ff,
        row_bytes]; the gate and up rows are kept in the dot layout)."""
        t = getattr(self, name)
        fmt = self.down_qformat if name == "w_down_t" else self.qformat
        if t is None or fmt is None:
            raise ValueError(f"{name} of this block is not quantized")
        return t if name == "w_down_t" else quant.deinterleave_blocks(t, fmt)

    def _down_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """w_down_t [n_ff, d] as float `dtype` (quantized rows dequantized; float32 copies in a
        reused buffer)."""
        if self.down_qformat is not None:
            return float_weight(self.w_down_t, self.down_qformat, self.d_model, False, "down").to(dtype)
        if dtype == torch.float32:
            return float32_weight(self.w_down_t, "down")
        return self.w_down_t.to(dtype)

    _BOUND = ("_kernel", "_prefill_kernels")

    def select_kernel(self) -> str:
        """Pick the execution path once. Returns its name (for explain)."""
        self.kernel = None
        self._prefill_kernels = None
        self._selected = True  # select again after a dtype / device change (_apply)
        if reference_forced():
            return "reference (PICOMPILE_REFERENCE set)"
        from picompile.codegen import c as c_codegen

        self.kernel = c_codegen.kernel_for(self)
        self._prefill_kernels = self._select_prefill_kernels()
        return "C" if self.kernel is not None else c_codegen.why_no_kernel(self)

    def _select_prefill_kernels(self) -> dict | None:
        """Dense kernels over the gate and up rows for prefill, where their format runs prefill
        on the kernel (config.PREFILL_KERNEL_FORMATS: the 4-bit formats, float16), else None
        (BLAS). Biases are added outside them."""
        from picompile.codegen import dense

        fmt = self.qformat or dtype_name(self.w_up.dtype)
        if fmt not in PREFILL_KERNEL_FORMATS or self.w_up.device.type != "cpu":
            return None
        kernels = {}
        for role, w in (("up", self.w_up), ("gate", self.w_gate)):
            if w is not None:
                kernels[role] = (dense.dense_kernel_for(w) if self.qformat is None
                                 else dense.quant_kernel_for(w, self.qformat, self.d_model))
                if kernels[role] is None:
                    return None
        return kernels

    def _prefill_down_input(self, x2: torch.Tensor, use_kernels: bool = True) -> torch.Tensor:
        """x2 [T, d] -> h [T, n_ff] for prefill: the gate and up products by the dense kernel
        (float32) where _select_prefill_kernels bound one (and `use_kernels`), else by BLAS in the
        block's dtype (quantized rows dequantized in C, x rounded to integer blocks as the
        kernels do)."""
        kernels = self.__dict__.get("_prefill_kernels") if use_kernels else None
        if kernels is not None:
            def product(role, bias):
                y = kernels[role](x2)  # [T, n_ff] float32
                return y if bias is None else y + bias
            gate = product("gate", self.b_gate) if "gate" in kernels else None
            return combine(product("up", self.b_up), gate, self.act, self.drelu)
        w_up, w_gate, x_in = self.w_up, self.w_gate, x2
        if self.qformat is not None:  # their rows dequantized in C; x rounded as the kernels do
            w_up, w_gate = (None if w is None else float_weight(w, self.qformat, self.d_model, True, slot)
                            for w, slot in ((self.w_up, "up"), (self.w_gate, "gate")))
            x_in = quant.round_activations(x2, self.qformat)
        return down_input(x_in, w_up, w_gate=w_gate, b_gate=self.b_gate, b_up=self.b_up,
                          act=self.act, drelu=self.drelu, compute_dtype=self.float_dtype)

    def rebind_if_moved(self) -> bool:
        """As KernelModule's; a block split across devices is split again where its weights
        changed since (the device holds copies of its hot rows)."""
        if self.hybrid is None:
            return super().rebind_if_moved()
        if not self.hybrid.stale(self):
            return False
        from picompile.runtime.hybrid import HybridFFN

        self.hybrid = HybridFFN(self, self.hybrid.device, self.hybrid.n_hot)
        return True

    def _check_movable(self) -> None:
        if self.hybrid is not None:
            raise RuntimeError(
                "picompile: this block runs split across the GPU and the CPU (distribute()); its "
                "dtype or device cannot change afterwards. Compile the model again with the "
                "dtype / device you want")

    def __setstate__(self, state):
        # pickled before down rows had a format of their own: one format for the three
        state.setdefault("down_qformat", state.get("qformat"))
        super().__setstate__(state)

    def __getstate__(self):
        if self.hybrid is not None and self.hybrid.cuda:
            raise TypeError("picompile: a model distributed across GPU and CPU cannot be pickled; "
                            "save its plan with cm.save(dir) and picompile.load(model, dir)")
        return super().__getstate__()

    def weights(self) -> dict:
        """The tensors in the keyword form ffn_reference and the kernels take (quantized
        blocks: the uint8 row blocks, with their `qformat` and `down_qformat`; float blocks and
        float down rows: None)."""
        return dict(
            w_up=self.w_up,
            w_down_t=self.w_down_t,
            w_gate=self.w_gate,
            b_gate=self.b_gate,
            b_up=self.b_up,
            b_down=self.b_down,
            qformat=self.qformat,
            down_qformat=self.down_qformat,
        )

    def forward_native(
        self, x: torch.Tensor, idx: torch.Tensor | None = None,
        allowed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> (out [T, d] float32, active [T, m] bool). The reference path."""
        return ffn_reference(
            x, **self.weights(), act=self.act, drelu=self.drelu, threshold=self.threshold, idx=idx,
            allowed=allowed,
        )

    def forward(self, x: torch.Tensor, predicted: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., d] -> [..., d]. `predicted` [T, n_ff] bool (from the block's predictor):
        only those neurons are computed; without it every neuron is a candidate."""
        if torch.compiler.is_compiling():  # traced (torch.export): one op node, runtime/ops.py
            return ops.call_sparse_ffn(self, x, predicted)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [T, d]
        tokens = x2.shape[0]
        self.total_pairs += tokens * self.n_ff
        self.rebind_if_moved()  # the weights changed since binding or the split: again
        if self.hybrid is not None:  # hot rows on the GPU, cold rows on the CPU
            return self.hybrid(x2, predicted).to(x.dtype).reshape(shape)
        differentiable = torch.is_grad_enabled() and x.requires_grad  # the kernels have no backward
        if tokens <= KERNEL_MAX_TOKENS and not differentiable:
            # Decode / small batch: the rows of the union of the tokens' predicted neurons are
            # read once; each token uses its own.
            if self.kernel is not None:
                out, n_active = self.kernel(x2, threshold=self.threshold, mask=predicted)
            else:
                idx, allowed = (None, None) if predicted is None else predicted_candidates(predicted)
                out, active = self.forward_native(x2, idx, allowed)
                n_active = int(active.sum())
        else:
            # Prefill (and any call under autograd): every neuron's h (dense kernel or BLAS),
            # masked per token by what fired and, in predicted mode, by what was predicted; the
            # down product by BLAS.
            h = self._prefill_down_input(x2, use_kernels=not differentiable)  # [T, n_ff]
            active = h.abs() > self.threshold
            if predicted is not None:
                active &= predicted
            out = torch.where(active, h, torch.zeros((), dtype=h.dtype)) @ self._down_weight(h.dtype)
            if self.b_down is not None:
                out = out + self.b_down
            n_active = int(active.sum())
        self.active_pairs += n_active
        return out.to(x.dtype).reshape(shape)

    def extra_repr(self) -> str:
        b = self.block
        mode = "exact" if self.threshold == 0 else f"threshold={self.threshold:.4g}"
        q = f", {self.qformat}" if self.qformat is not None else ""
        if self.qformat is not None and self.down_format != self.qformat:
            q += f" (down {self.down_format})"
        return f"{b.kind}, act={b.act}, d={self.d_model}, n_ff={self.n_ff}{q}, {mode}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


