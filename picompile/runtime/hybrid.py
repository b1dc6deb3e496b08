"""The hybrid executor: hot neurons on the GPU, cold ones on the CPU, computing at once.

Per block and step (SparseFFN.forward hands over when the block has a `hybrid`):

    predicted mask [T, n_ff] on the device (the graph's predictor node)
      -> split: hot columns [:n_hot] stay on the device; cold columns and the block input x
         go to (pinned) host memory, asynchronously
      -> the cold part starts in a worker thread (C kernel, GIL released)
      -> the hot part is launched on the device meanwhile (CUDA kernels, or the torch path)
      -> the cold partial output comes back and is added to the hot one.

Each side is an ordinary SparseFFN over its rows (a "view"), so decode (a few tokens: the
kernels over the predicted rows) and prefill (many tokens: dense BLAS over each side's rows,
masked) are the same code as the CPU-only runtime. With `device="cpu"` the CPU stands in for
the GPU: every split, transfer and merge runs, which is how CI tests this file.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from picompile.runtime.sparse_ffn import SparseFFN

# One worker: blocks run one after another, so at most one cold part is in flight.
_COLD_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="picompile-cold")


def _rows(t: torch.Tensor | None, rows: slice, device) -> torch.Tensor | None:
    return None if t is None else t[rows].detach().to(device).contiguous()


def _view(ffn: SparseFFN, rows: slice, device, with_down_bias: bool) -> SparseFFN:
    """A SparseFFN over some of `ffn`'s neurons, on `device`."""
    view = SparseFFN(
        ffn.block,
        w_up=_rows(ffn.w_up, rows, device),
        w_down_t=_rows(ffn.w_down_t, rows, device),
        w_gate=_rows(ffn.w_gate, rows, device),
        b_gate=_rows(ffn.b_gate, rows, device),
        b_up=_rows(ffn.b_up, rows, device),
        b_down=ffn.b_down.detach().to(device) if with_down_bias and ffn.b_down is not None else None,
    )
    view.threshold = ffn.threshold
    return view


class CudaHotKernel:
    """Adapts codegen.cuda.CudaFFN to SparseFFN's kernel interface, for the hot rows."""

    def __init__(self, view: SparseFFN):
        from picompile.codegen.cuda import CudaFFN

        self.view = view
        self.ffn = CudaFFN(view.w_up, view.w_down_t, w_gate=view.w_gate, b_gate=view.b_gate,
                           b_up=view.b_up, b_down=view.b_down, act=view.act, drelu=view.drelu,
                           threshold=view.threshold)
        self.all_rows = torch.arange(view.n_ff, dtype=torch.int32, device=view.w_up.device)

    def __call__(self, x, threshold: float = 0.0, idx=None, mask=None):
        """SparseFFN's kernel interface: candidates idx [m], else the rows set for any token in
        mask [T, n_hot] (nonzero synchronizes once per block), else all hot rows."""
        if idx is None and mask is not None:
            idx = mask.any(0).nonzero().flatten()
        # n_active stays a device tensor: reading it would synchronize every block.
        return self.ffn.ffn_given_idx(x, self.all_rows if idx is None else idx)


class HybridFFN:
    """Runs one SparseFFN split at `n_hot` across `device` (hot) and the CPU (cold)."""

    def __init__(self, ffn: SparseFFN, device: torch.device | str, n_hot: int):
        self.device = torch.device(device)
        self.n_hot = n_hot = max(0, min(int(n_hot), ffn.n_ff))
        self.n_ff = ffn.n_ff
        self.hot = _view(ffn, slice(0, n_hot), self.device, with_down_bias=True) if n_hot else None
        cold_bias = n_hot == 0  # b_down is added once, by whichever side exists
        self.cold = _view(ffn, slice(n_hot, None), "cpu", cold_bias) if n_hot < ffn.n_ff else None
        if self.cold is not None:
            self.cold.select_kernel()
        if self.hot is not None and self.device.type == "cuda":
            self.hot.kernel = CudaHotKernel(self.hot)
        elif self.hot is not None:
            self.hot.select_kernel()
        self.pinned = self.device.type == "cuda"
        self.timeline: list[dict] | None = None  # set to [] to record per-step timings

    def reset_stats(self) -> None:
        for side in (self.hot, self.cold):
            if side is not None:
                side.reset_stats()

    def active_pairs(self) -> int:
        return sum(int(side.active_pairs) for side in (self.hot, self.cold) if side is not None)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if not self.pinned:
            return t.to("cpu")
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def __call__(self, x: torch.Tensor, predicted: torch.Tensor | None) -> torch.Tensor:
        """x [T, d] on the device, predicted [T, n_ff] bool or None -> out [T, d] float32."""
        t0 = time.perf_counter()
        x = x.float()
        hot_mask = cold_mask = None
        if predicted is not None:
            hot_mask = predicted[:, : self.n_hot]
            cold_mask = self._to_host(predicted[:, self.n_hot :]) if self.cold is not None else None
        cold_future = None
        if self.cold is not None:
            x_host = self._to_host(x)
            if self.pinned:  # the CPU must not read the staging buffers before they land
                torch.cuda.current_stream(self.device).synchronize()
            cold_future = _COLD_WORKER.submit(self._timed, self.cold, x_host, cold_mask)
        t_launch = time.perf_counter()
        out = self.hot(x, hot_mask) if self.hot is not None else None
        t_hot = time.perf_counter()
        if cold_future is not None:
            cold_out, cold_s = cold_future.result()
            cold_out = cold_out.to(self.device, non_blocking=True)
            out = cold_out if out is None else out + cold_out
        if self.timeline is not None:
            self.timeline.append(dict(tokens=x.shape[0], split_s=t_launch - t0,
                                      hot_s=t_hot - t_launch,
                                      cold_s=cold_s if cold_future is not None else 0.0,
                                      wall_s=time.perf_counter() - t0))
        return out

    @staticmethod
    def _timed(side: SparseFFN, x: torch.Tensor, mask):
        t = time.perf_counter()
        with torch.no_grad():
            out = side(x, mask)
        return out, time.perf_counter() - t


def distribute(model: nn.Module, ffns: dict[str, SparseFFN], device: torch.device | str,
               move_non_ffn: bool = True) -> None:
    """Put the model on `device` as planned: every non-FFN parameter and buffer, and each
    block's hot rows (block.hot_neurons of them, hot-first order already applied); cold rows
    stay on the CPU."""
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
        if ffn.predictor is not None:
            ffn.predictor.to(device)
        ffn.hybrid = HybridFFN(ffn, device, ffn.block.hot_neurons)
        # The views hold the rows now; the full copy stays on the CPU only (for save, explain).
        for name in ("w_gate", "w_up", "w_down_t", "b_gate", "b_up", "b_down"):
            p = getattr(ffn, name)
            if p is not None:
                p.data = p.data.to("cpu")
