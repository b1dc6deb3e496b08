"""The hybrid executor: hot neurons on the GPU, cold ones on the CPU, computing at once.

Per block and step (SparseFFN.forward hands over when the block has a `hybrid`):

    predicted mask [T, n_ff] on the device (the graph's predictor node), or None (exact)
      1. x and the cold columns of the mask are copied into preallocated pinned host buffers,
         asynchronously, and an event is recorded behind the copies;
      2. the hot part is launched on the device (CUDA kernels; the hot rows are compacted from
         the mask on the device, so nothing waits for the GPU here);
      3. the calling thread waits for the event only (the copies, not the hot kernels), then
         runs the cold part itself: a C kernel over OpenMP threads, the GIL released. No worker
         thread: the launches are already queued, so the CPU has nothing else to do meanwhile;
      4. the cold partial output goes back through a pinned buffer and is added on the device.

One host wait per block (step 3): the CPU cannot start before x exists. Each side is an
ordinary SparseFFN over its rows (a "view"), so decode (the kernels over the predicted rows)
and prefill (dense BLAS over each side's rows, masked) are the same code as the CPU-only
runtime. With `device="cpu"` the CPU stands in for the GPU: every split and merge runs, which is
how CI tests this file.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from picompile.runtime.sparse_ffn import SparseFFN


def _rows(t: torch.Tensor | None, rows: slice, device) -> torch.Tensor | None:
    """A copy of t[rows] on `device`. Always a copy: a view would keep the whole [n_ff, d]
    storage alive on the GPU after distribute() moves the full weights to the CPU."""
    if t is None:
        return None
    return t[rows].detach().to(device, copy=True).contiguous()


def _view(ffn: SparseFFN, rows: slice, device, with_down_bias: bool) -> SparseFFN:
    """A SparseFFN over some of `ffn`'s neurons, on `device`."""
    view = SparseFFN(
        ffn.block,
        w_up=_rows(ffn.w_up, rows, device),
        w_down_t=_rows(ffn.w_down_t, rows, device),
        w_gate=_rows(ffn.w_gate, rows, device),
        b_gate=_rows(ffn.b_gate, rows, device),
        b_up=_rows(ffn.b_up, rows, device),
        b_down=ffn.b_down.detach().to(device, copy=True) if with_down_bias and ffn.b_down is not None else None,
    )
    view.threshold = ffn.threshold
    return view


class CudaHotKernel:
    """Adapts codegen.cuda.CudaFFN to SparseFFN's kernel interface, for the hot rows."""

    def __init__(self, view: SparseFFN):
        from picompile.codegen.cuda import CudaFFN

        self.ffn = CudaFFN(view.w_up, view.w_down_t, w_gate=view.w_gate, b_gate=view.b_gate,
                           b_up=view.b_up, b_down=view.b_down, act=view.act, drelu=view.drelu,
                           threshold=view.threshold)
        self.all_rows = torch.arange(view.n_ff, dtype=torch.int32, device=view.w_up.device)

    def __call__(self, x, threshold: float = 0.0, idx=None, mask=None):
        """SparseFFN's kernel interface: candidates idx [m], else the rows set for any token in
        mask [T, n_hot] (compacted on the device), else all hot rows. n_active stays a device
        tensor: reading it would synchronize every block."""
        if idx is None and mask is not None:
            return self.ffn.ffn_given_mask(x, mask)
        return self.ffn.ffn_given_idx(x, self.all_rows if idx is None else idx)


class _Staging:
    """Pinned host buffers for one block's hand-offs, grown to the largest T seen; the event
    marks when the device-to-host copies into them have landed."""

    def __init__(self, tokens: int, d: int, n_cold: int):
        self.x = torch.empty(tokens, d, dtype=torch.float32, pin_memory=True)  # block input
        self.mask = torch.empty(tokens, n_cold, dtype=torch.bool, pin_memory=True)  # cold mask
        self.out = torch.empty(tokens, d, dtype=torch.float32, pin_memory=True)  # cold output
        self.copied = torch.cuda.Event()


class HybridFFN:
    """Runs one SparseFFN split at `n_hot` across `device` (hot) and the CPU (cold)."""

    def __init__(self, ffn: SparseFFN, device: torch.device | str, n_hot: int):
        self.device = torch.device(device)
        self.n_hot = n_hot = max(0, min(int(n_hot), ffn.n_ff))
        self.n_ff = ffn.n_ff
        self.d = ffn.d_model
        self.hot = _view(ffn, slice(0, n_hot), self.device, with_down_bias=True) if n_hot else None
        cold_bias = n_hot == 0  # b_down is added once, by whichever side exists
        self.cold = _view(ffn, slice(n_hot, None), "cpu", cold_bias) if n_hot < ffn.n_ff else None
        if self.cold is not None:
            self.cold.select_kernel()
        self.cuda = self.device.type == "cuda"
        if self.hot is not None and self.cuda:
            self.hot.kernel = CudaHotKernel(self.hot)
        elif self.hot is not None:
            self.hot.select_kernel()
        self._staging: _Staging | None = None
        # Set to [] to record per-step timings: dicts of tokens, hot_s (GPU time of the hot
        # kernels, from CUDA events), cold_s (the cold C kernel), wall_s (the block, from entry
        # to the merged output; CUDA events on a GPU). Reading the events waits for the device,
        # so `timings()` resolves them afterwards.
        self.timeline: list[dict] | None = None

    def reset_stats(self) -> None:
        for side in (self.hot, self.cold):
            if side is not None:
                side.reset_stats()

    def active_pairs(self) -> int:
        return sum(int(side.active_pairs) for side in (self.hot, self.cold) if side is not None)

    def _stage(self, tokens: int) -> _Staging:
        if self._staging is None or self._staging.x.shape[0] < tokens:
            self._staging = _Staging(max(tokens, 8), self.d, self.n_ff - self.n_hot)
        return self._staging

    def __call__(self, x: torch.Tensor, predicted: torch.Tensor | None) -> torch.Tensor:
        """x [T, d] on the device, predicted [T, n_ff] bool or None -> out [T, d] float32."""
        T = x.shape[0]
        timing = self.timeline is not None
        if timing:
            marks = {k: self._mark() for k in ("start", "hot_start", "hot_end", "end")}
            self._record(marks["start"])
            t0 = time.perf_counter()
        x = x.float()  # both sides add float32 partial outputs
        hot_mask = None if predicted is None else predicted[:, : self.n_hot]
        cold_mask = None if predicted is None else predicted[:, self.n_hot :]
        cold_x = x
        if self.cold is not None and self.cuda:  # 1. device -> pinned host, behind an event
            stage = self._stage(T)
            cold_x = stage.x[:T]
            cold_x.copy_(x, non_blocking=True)
            if cold_mask is not None:
                cold_mask = stage.mask[:T]
                cold_mask.copy_(predicted[:, self.n_hot :], non_blocking=True)
            stage.copied.record()
        out = None
        if self.hot is not None:  # 2. launch the hot part (asynchronous on a GPU)
            if timing:
                self._record(marks["hot_start"])
                t_hot, active_before = time.perf_counter(), self.hot.active_pairs
            out = self.hot(x, hot_mask).float()
            if timing:
                self._record(marks["hot_end"])
                hot_s = time.perf_counter() - t_hot
                candidates = self.n_hot if hot_mask is None else hot_mask.any(0).sum()
                hot_bytes = self._bytes_read(candidates, self.hot.active_pairs - active_before)
        cold_s = 0.0
        if self.cold is not None:
            if self.cuda:
                stage.copied.synchronize()  # 3. the copies only; the GIL is released meanwhile
            t_cold = time.perf_counter()
            with torch.no_grad():
                cold_out = self.cold(cold_x, cold_mask)  # float32 already
            cold_s = time.perf_counter() - t_cold
            if self.cuda:  # 4. back through pinned memory, added on the device
                stage.out[:T].copy_(cold_out)
                cold_out = stage.out[:T].to(self.device, non_blocking=True)
            out = cold_out if out is None else out + cold_out
        if timing:
            self._record(marks["end"])
            step = dict(tokens=T, cold_s=cold_s, wall_s=time.perf_counter() - t0,
                        hot_s=hot_s if self.hot is not None else 0.0,
                        hot_bytes=hot_bytes if self.hot is not None else 0)
            if self.cuda:
                step["events"] = marks
            self.timeline.append(step)
        return out

    def _bytes_read(self, candidates, active):
        """Weight bytes the hot kernels read for `candidates` rows of which `active` fired (device
        tensors stay lazy): a first row per candidate (the gate, or up for plain blocks; gate
        and up for gated non-ReLU blocks), the other rows per firing neuron (up and down, or
        down)."""
        gated, relu = self.hot.w_gate is not None, self.hot.act == "relu"
        first, later = (2, 1) if gated and not relu else (1, 2) if gated else (1, 1)
        row = self.d * self.hot.w_up.element_size()
        return (candidates * first + active * later) * row

    def _mark(self):
        return torch.cuda.Event(enable_timing=True) if self.cuda else None

    def _record(self, event) -> None:
        if event is not None:
            event.record()

    def timings(self) -> list[dict]:
        """The timeline with GPU times resolved from its CUDA events (waits for the device)."""
        if self.timeline is None:
            return []
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for step in self.timeline:
            marks = step.pop("events", None)
            if marks is None:
                continue
            step["wall_s"] = marks["start"].elapsed_time(marks["end"]) / 1e3
            if self.hot is not None:
                step["hot_s"] = marks["hot_start"].elapsed_time(marks["hot_end"]) / 1e3
        for step in self.timeline:
            step["hot_bytes"] = int(step["hot_bytes"])
        return self.timeline


def distribute(model: nn.Module, ffns: dict[str, SparseFFN], device: torch.device | str,
               move_non_ffn: bool = True) -> None:
    """Put the model on `device` as planned: every non-FFN parameter and buffer, each block's
    predictor (float16 on a GPU) and its hot rows (block.hot_neurons of them, hot-first order
    already applied); cold rows stay on the CPU."""
    device = torch.device(device)
    inside = {id(m) for f in ffns.values() for m in f.modules()}
    if move_non_ffn:
        for module in model.modules():
            if id(module) in inside:
                continue
            for name, p in list(module.named_parameters(recurse=False)):
                p.data = p.data.to(device)
            for name, b in list(module.named_buffers(recurse=False)):
                module._buffers[name] = b.to(device)
    for ffn in ffns.values():
        if ffn.predictor is not None:  # float16 on a GPU: half the bytes the budget counts
            ffn.predictor.to(device=device, dtype=torch.float16 if device.type == "cuda" else None)
        ffn.hybrid = HybridFFN(ffn, device, ffn.block.hot_neurons)
        # The views hold the rows now; the full copy stays on the CPU only (for save, explain).
        for name in ("w_gate", "w_up", "w_down_t", "b_gate", "b_up", "b_down"):
            p = getattr(ffn, name)
            if p is not None:
                p.data = p.data.to("cpu")
