"""DenseLinear: an nn.Linear run by picompile's dense C kernel at decode, F.linear otherwise.
QuantLinear (below): the same with a block-quantized weight (picompile.quant).

    y = x @ weight.T + bias          x [..., K] -> y [..., O], in x's dtype

`forward_native` is F.linear, the reference the kernel is tested against. `forward` runs the
kernel (picompile/kernels/dense.c through picompile.codegen.dense) when 1 <= T <= 8 tokens
(leading dimensions flattened) on the CPU, and for prefill too where the weights' format is in
config.PREFILL_KERNEL_FORMATS (float16, the 4-bit formats); F.linear for the other prefills, on
other devices, and where there is no kernel. The kernel accumulates in float32 and its result is
cast to x's dtype.

The module holds the very Parameter objects of the nn.Linear it replaces (`from_linear`), so tied
weights stay tied (an LM head tied to the embedding) and state_dict keys are unchanged.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from picompile.runtime import ops
from picompile.runtime.kernel_module import KernelModule
from picompile.config import KERNEL_MAX_TOKENS, PREFILL_KERNEL_FORMATS, reference_forced


_scratch = threading.local()  # per thread: slot -> float32 buffer, reused by float_weight
SCRATCH_MAX_BYTES = 256 << 20  # larger weights get a buffer of their own each call


def float_weight(q: torch.Tensor, fmt: str, cols: int, dot_layout: bool,
                 slot: str = "linear") -> torch.Tensor:
    """Quantized rows uint8 [rows, row_bytes] (in the dot layout when `dot_layout`)
    as float32 [rows, cols] for prefill's BLAS: dequantized in C where the dense library builds
    (the same values, in one pass), else by the reference, quant.dequantize.

    The C path writes into this thread's scratch buffer for `slot`, kept between calls: a
    fresh buffer per call costs the kernel's page faults and zeroing, more than the
    dequantization itself. So the result is valid until the next call with the same slot: a
    caller using several weights at once gives each its own slot."""
    from picompile import quant
    from picompile.codegen import dense

    out = _scratch_float32(q.shape[0], cols, slot)
    w = dense.dequantize(q, fmt, cols, dot_layout, out)
    if w is None:
        w = quant.dequantize(quant.deinterleave_blocks(q, fmt) if dot_layout else q, fmt, cols)
    return w


def float32_weight(w: torch.Tensor, slot: str) -> torch.Tensor:
    """A float weight [rows, cols] as float32 for prefill's BLAS (w itself when it is float32,
    else a copy in this thread's scratch buffer for `slot`, valid until the next call with it)."""
    if w.dtype == torch.float32:
        return w
    out = _scratch_float32(w.shape[0], w.shape[1], slot)
    return w.to(torch.float32) if out is None else out.copy_(w)


def _scratch_float32(rows: int, cols: int, slot: str) -> torch.Tensor | None:
    """This thread's float32 [rows, cols] buffer for `slot` (None above SCRATCH_MAX_BYTES, or
    while autograd records)."""
    if rows * cols * 4 > SCRATCH_MAX_BYTES:
        return None
    if torch.is_grad_enabled():  # autograd may keep the weight for backward: a tensor of its own
        return None
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buf = buffers.get(slot)
    if buf is None or buf.numel() < rows * cols:
        with torch.inference_mode(False):  # a normal tensor, writable outside inference mode
            buf = buffers[slot] = torch.empty(rows * cols, dtype=torch.float32)
    return buf[: rows * cols].view(rows, cols)


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


_PREFILL_KERNEL_DTYPES = frozenset(getattr(torch, name) for name in PREFILL_KERNEL_FORMATS
                                   if name in ("float32", "float16", "bfloat16"))


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

    @classmethod
    def from_linear(cls, linear: nn.Linear, select: bool = True) -> DenseLinear:
        mod = cls(linear.weight, linear.bias)
        mod.train(linear.training)
        if select:
            mod.select_kernel()
        return mod

    def select_kernel(self) -> str:
        """Pick the execution path once; returns its name ("C float32 avx2", "reference (...)")."""
        from picompile.codegen import dense

        self.kernel = None
        self._selected = True  # select again after a dtype / device change (_apply)
        if reference_forced():
            self.path = "reference (PICOMPILE_REFERENCE set)"
            return self.path
        if self.weight.is_cuda:  # forward_native there is cuBLAS: the GPU's own fast path
            self.path = "PyTorch on the GPU (cuBLAS)"
            return self.path
        self.kernel = dense.dense_kernel_for(self.weight, self.bias)
        self.path = (f"C {self.kernel.variant}" if self.kernel is not None
                     else dense.why_no_kernel(self.weight, self.bias))
        return self.path

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., O]: the reference path."""
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., O] in x's dtype."""
        if torch.compiler.is_compiling():  # traced (torch.export): one op node, runtime/ops.py
            return ops.call_linear(self, x)
        params = self._parameters  # (faster than attribute lookups: this runs per token)
        weight, bias = params["weight"], params["bias"]
        kernel = self.kernel
        if kernel is None or not x.is_cpu or x.dim() == 0:
            return F.linear(x, weight, bias)
        K = x.shape[-1]
        T = x.numel() // K if K else 0
        if T < 1 or not x.is_floating_point() or (
                T > KERNEL_MAX_TOKENS and weight.dtype not in _PREFILL_KERNEL_DTYPES):
            return F.linear(x, weight, bias)
        if self.rebind_if_moved():  # storage swapped since binding (.data = ...): bound again
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


class QuantLinear(KernelModule):
    """A linear layer whose weight is block-quantized (picompile.quant: GGUF's q8_0 / q4_0 /
    q4_1), run by the dense C kernel's quantized build at decode.

        y = x' @ dequantize(qweight).T + bias       x [..., K] -> y [..., O], in x's dtype

    x' = quant.round_activations(x, format): x rounded to integer blocks (the kernel dots integers).

    `qweight` (a buffer, so state_dict holds it) is uint8 [O, K / 32 * block_bytes], GGUF's
    blocks in the layout the kernel reads (quant.interleave_blocks: each run of 8 blocks of a
    row interleaved; `row_blocks()` gives GGUF's layout back);
    the constructor takes GGUF's row layout. `bias` a float32 Parameter or None. No float copy
    of the weight is kept: `forward_native` (the reference) dequantizes on each call. `forward`
    runs the kernel on the CPU for 1 <= T <= 8 tokens and, for the formats of
    config.PREFILL_KERNEL_FORMATS, for prefill too (else BLAS over the weight dequantized in C);
    forward_native where autograd records x or there is no kernel. On a CUDA device (`.to("cuda")`
    moves the blocks as they are) `forward` runs codegen.cuda.quant_linear, the same arithmetic
    on the GPU; other devices and dtype changes are refused.
    """

    def __init__(self, qweight: torch.Tensor, qformat: str, in_features: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        from picompile import quant

        quant.format_of(qformat)  # raises for an unknown format
        rb = quant.row_bytes(in_features, qformat)
        if in_features % quant.BLOCK or qweight.dtype != torch.uint8 or qweight.dim() != 2 \
                or qweight.shape[1] != rb:
            raise ValueError(f"a {qformat} weight of {in_features} input features is uint8 "
                             f"[O, {rb}] with {in_features} a multiple of {quant.BLOCK}; got "
                             f"{str(qweight.dtype).removeprefix('torch.')} {tuple(qweight.shape)}")
        self.qformat = qformat
        self.in_features = in_features
        self.out_features = qweight.shape[0]
        self.register_buffer("qweight", quant.interleave_blocks(qweight.detach().contiguous(),
                                                              qformat))
        if bias is not None:
            if bias.shape != (self.out_features,):
                raise ValueError(f"bias {tuple(bias.shape)} for {self.out_features} outputs")
            # (shares the storage of a float32 bias; no gradient: the layer is not trainable)
            bias = nn.Parameter(bias.detach().to(torch.float32), requires_grad=False)
        self.register_parameter("bias", bias)  # [O] float32 or None
        self.kernel = None  # set by select_kernel(); None runs forward_native
        self.path = "reference (C kernel not selected)"

    @classmethod
    def from_linear(cls, linear: nn.Module, fmt: str, select: bool = True) -> QuantLinear:
        """The layer of `linear` (an nn.Linear or DenseLinear) with its weight quantized to
        `fmt`; its bias is kept (as float32). Raises ValueError where the weight cannot be
        quantized (its input dimension not a multiple of 32: that layer must stay float)."""
        from picompile import quant

        quant.format_of(fmt)
        weight = linear.weight
        why = quant.why_not_quantizable(weight.shape)
        if why is not None:
            raise ValueError(f"cannot quantize this linear layer to {fmt}: {why}; "
                             "it must stay float")
        bias = None if linear.bias is None else linear.bias.detach().cpu()
        mod = cls(quant.quantize(weight, fmt), fmt, weight.shape[1], bias).to(weight.device)
        mod.train(linear.training)
        if select:
            mod.select_kernel()
        return mod

    def _apply(self, fn, recurse=True):
        # Where would the blocks go? (.cuda(), .to(device) move every tensor; .half() / .float()
        # leave uint8 tensors as they are.) Refuse a device without kernels before anything moves.
        probe = fn(torch.empty(0, dtype=torch.uint8))
        if probe.device.type not in ("cpu", "cuda") or probe.dtype != torch.uint8:
            raise RuntimeError(f"picompile: quantized ({self.qformat}) linear layers run on the "
                               f"CPU or a CUDA GPU, as uint8 blocks; not as {probe.dtype} on "
                               f"{probe.device}")
        return super()._apply(fn, recurse)

    def select_kernel(self) -> str:
        """Pick the execution path once; returns its name ("C q4_0 avx512", "reference (...)")."""
        from picompile.codegen import dense

        self.kernel = None
        self._selected = True
        if reference_forced():
            self.path = "reference (PICOMPILE_REFERENCE set)"
            return self.path
        if self.qweight.is_cuda:
            self.path = f"CUDA {self.qformat} (codegen.cuda.quant_linear)"
            return self.path
        self.kernel = dense.quant_kernel_for(self.qweight, self.qformat, self.in_features,
                                             self.bias)
        self.path = (f"C {self.kernel.variant}" if self.kernel is not None else
                     dense.why_no_quant_kernel(self.qweight, self.qformat, self.in_features,
                                               self.bias))
        return self.path

    def row_blocks(self) -> torch.Tensor:
        """The weight's blocks in GGUF's row layout, uint8 [O, row_bytes] (a copy)."""
        from picompile import quant

        return quant.deinterleave_blocks(self.qweight, self.qformat)

    def load_row_blocks(self, blocks: torch.Tensor) -> None:
        """Overwrite the weight with `blocks` in GGUF's row layout (uint8 [O, row_bytes], as a
        GGUF file holds them), in place: the kernel stays bound."""
        from picompile import quant

        if blocks.shape != self.qweight.shape or blocks.dtype != torch.uint8:
            raise ValueError(f"{self.qformat} blocks for this layer are uint8 "
                             f"{tuple(self.qweight.shape)}, got {blocks.dtype} {tuple(blocks.shape)}")
        self.qweight.copy_(quant.interleave_blocks(blocks, self.qformat))

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as float32 [O, K] (quant.dequantize: the reference)."""
        from picompile import quant

        return quant.dequantize(self.row_blocks(), self.qformat, self.in_features)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., O] in x's dtype: dequantize, then F.linear (the reference; x
        rounded to int8 blocks first, quant.round_activations)."""
        from picompile import quant

        w = self.dequantized_weight().to(x.dtype)
        x = quant.round_activations(x, self.qformat).to(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., O] in x's dtype."""
        if torch.compiler.is_compiling():  # traced (torch.export): one op node, runtime/ops.py
            return ops.call_linear(self, x)
        kernel = self.kernel
        K = x.shape[-1] if x.dim() else 0
        T = x.numel() // K if K else 0
        bias = self._parameters["bias"]
        if x.dim() == 0 or not x.is_floating_point() or (torch.is_grad_enabled() and (
                x.requires_grad or (bias is not None and bias.requires_grad))):
            return self.forward_native(x)
        if self.qweight.is_cuda and x.device == self.qweight.device and not reference_forced():
            from picompile.codegen import cuda

            y = cuda.quant_linear(x.reshape(T, K), self.qweight, self.qformat, bias)  # [T, O]
            return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        if kernel is None or not x.is_cpu or not self.qweight.is_cpu or (
                torch.is_grad_enabled() and x.requires_grad):  # (the kernels have no backward)
            return self.forward_native(x)
        if T > KERNEL_MAX_TOKENS and self.qformat not in PREFILL_KERNEL_FORMATS:
            # prefill where BLAS is the faster: over the weight dequantized in C
            from picompile import quant

            w = float_weight(self.qweight, self.qformat, self.in_features, dot_layout=True)
            xr = quant.round_activations(x, self.qformat).to(x.dtype)
            return F.linear(xr, w.to(x.dtype), None if bias is None else bias.to(x.dtype))
        if T < 1:
            return self.forward_native(x)
        if self.rebind_if_moved():  # storage swapped since binding (load_state_dict, .data = ...)
            kernel = self.kernel
            if kernel is None:
                return self.forward_native(x)
        out = kernel(x)  # [..., O] float32
        return out if x.dtype is torch.float32 else out.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format={self.qformat}, path={self.path}")
