"""The hybrid executor: hot neurons on the GPU, cold ones on the CPU, computing at once.

Per block and step (SparseFFN.forward hands over when the block has a `hybrid`):

    predicted mask [T, n_ff] on the device (the graph's predictor node), or None (exact)
      1. x and the cold columns of the mask are queued for copying into preallocated pinned
         host buffers, then a `ready` flag behind them, and the cold worker is started: a C
         thread (kernels/cold_worker.c) that spins until the flag lands, then runs the cold
         rows' C kernel over OpenMP threads. It needs no GIL and no host wait;
      2. meanwhile the calling thread launches the hot part on the device (CUDA kernels; the
         hot rows are compacted from the mask on the device, so nothing waits for the GPU);
      3. it waits for the worker (the GIL released);
      4. the cold partial output goes back through the pinned buffer and is added on the device.

So the CPU starts the moment x reaches it, and the launches of the GPU part overlap it. The
hand-off's phases are functions of their own (job and start_cold: host; send and wait_done:
device; receive or wait_cold: host), so that the device decoder (runtime/device_decoder.py)
starts the worker once on every split block of a step (a batch, each block's job in order),
replays the device side as one CUDA graph in which the device itself waits for each block's
cold output (wait_done: the worker sets a `done` flag in pinned memory to the batch's serial),
and waits for the worker once (wait_cold). Each side is an ordinary SparseFFN over its rows (a
"view"), so decode (the kernels over the predicted rows) and prefill (dense BLAS over each
side's rows, masked, on the calling thread) are the same code as the CPU-only runtime (but for
calls of 2 to 8 tokens in predicted mode: both sides take the union of their predictions, as the
GPU's kernels do). With `device="cpu"` the CPU stands in for the GPU: every split and merge
runs, which is how CI tests this file.
"""

from __future__ import annotations

import contextlib
import ctypes
import time

import torch
from torch import nn

from picompile.activations import zero_below
from picompile.codegen import cold_worker
from picompile.codegen.decoder import function_pointer
from picompile.config import KERNEL_MAX_TOKENS, cold_threads_override
from picompile.runtime.sparse_ffn import SparseFFN


def cold_threads() -> int:
    """OpenMP threads for the cold part: half of torch's. The other cores are for the thread
    that launches the GPU part meanwhile (on the CPU stand-in, the hot part's own C kernel), and
    for the team's threads spinning after each block: with all cores in the team, the launching
    thread lost its core and decode ran several times slower on a 16-core H100 host
    (BENCHMARKS.md, session 6). $PICOMPILE_COLD_THREADS overrides."""
    override = cold_threads_override()
    if override is not None:
        return max(1, override)
    return max(1, torch.get_num_threads() // 2)


def copy_async(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for two contiguous tensors of one dtype and size. Between a GPU and pinned
    host memory: a bare cudaMemcpyAsync on the current stream (no host-allocator bookkeeping,
    so a CUDA graph captures it as a copy node); elsewhere a plain copy."""
    if dst.device.type == "cuda" or src.device.type == "cuda":
        from picompile.codegen.cuda import memcpy_async

        memcpy_async(dst, src)
    else:
        dst.copy_(src)


def _rows(t: torch.Tensor | None, rows: slice, device, share: bool) -> torch.Tensor | None:
    """t[rows] on `device`: with `share`, a view where t is already there (the cold rows, read
    where distribute() keeps the full weights, so the host holds each row once); else a copy
    (the hot rows: a view would keep the whole [n_ff, d] storage alive on the GPU). Quantized
    rows are taken as they are: the CUDA kernels read the CPU's layout (ffn_cuda_q.cuh)."""
    if t is None:
        return None
    if share and t.device == torch.device(device):
        return t[rows].detach()  # a row range of a contiguous [n_ff, d]: contiguous
    return t[rows].detach().to(device, copy=True).contiguous()


def _view(ffn: SparseFFN, rows: slice, device, with_down_bias: bool, share: bool) -> SparseFFN:
    """A SparseFFN over some of `ffn`'s neurons, on `device` (share: views of ffn's rows)."""
    view = SparseFFN(
        ffn.block,
        w_up=_rows(ffn.w_up, rows, device, share),
        w_down_t=_rows(ffn.w_down_t, rows, device, share),
        w_gate=_rows(ffn.w_gate, rows, device, share),
        b_gate=_rows(ffn.b_gate, rows, device, share),
        b_up=_rows(ffn.b_up, rows, device, share),
        b_down=ffn.b_down.detach().to(device, copy=True) if with_down_bias and ffn.b_down is not None else None,
        qformat=ffn.qformat,
        down_qformat=ffn.down_qformat,
    )
    view.threshold = ffn.threshold
    return view


class CudaHotKernel:
    """Adapts codegen.cuda.CudaFFN to SparseFFN's kernel interface, for the hot rows."""

    def __init__(self, view: SparseFFN):
        from picompile.codegen.cuda import CudaFFN

        # Quantized rows are read as the view holds them (gate / up rows in the dot layout).
        self.ffn = CudaFFN(view.w_up, view.w_down_t, w_gate=view.w_gate, b_gate=view.b_gate,
                           b_up=view.b_up, b_down=view.b_down, act=view.act, drelu=view.drelu,
                           threshold=view.threshold, qformat=view.qformat,
                           down_qformat=view.down_qformat)
        self.all_rows = torch.arange(view.n_ff, dtype=torch.int32, device=view.w_up.device)

    def __call__(self, x, threshold: float = 0.0, idx=None, mask=None):
        """SparseFFN's kernel interface: candidates idx [m], else the rows set for any token in
        mask [T, n_hot] (compacted on the device), else all hot rows. n_active stays a device
        tensor: reading it would synchronize every block."""
        if idx is None and mask is not None:
            return self.ffn.ffn_given_mask(x, mask)
        return self.ffn.ffn_given_idx(x, self.all_rows if idx is None else idx)


class _Staging:
    """Host buffers for one block's hand-offs (pinned on a GPU), for up to `tokens` tokens, and
    the cold worker's job over them. `ready` turns 1 once x and the mask have landed: on a GPU
    a device-to-host copy queued behind theirs writes it, so the worker starts the moment they
    arrive, without the calling thread waiting."""

    def __init__(self, tokens: int, d: int, n_cold: int, pinned: bool):
        self.x = torch.empty(tokens, d, dtype=torch.float32, pin_memory=pinned)  # block input
        self.mask = torch.empty(tokens, n_cold, dtype=torch.bool, pin_memory=pinned)  # cold mask
        self.out = torch.empty(tokens, d, dtype=torch.float32, pin_memory=pinned)  # cold output
        # The device copies the batch's serial into `ready` once x and the mask are in place;
        # the worker sets `done` to it once `out` is written (what the device waits for).
        self.ready = torch.zeros(1, dtype=torch.int32, pin_memory=pinned)
        self.done = torch.zeros(1, dtype=torch.int32, pin_memory=pinned)
        self.job = None  # a cold_worker.Job over these buffers, made by HybridFFN.job


_serial = 0  # the last batch's serial: one cold worker per process, so one count


def start_cold(jobs: list[cold_worker.Job]) -> int:
    """Start the cold worker on `jobs` in order (a batch; each spins on its `ready`). -> the
    batch's serial, which each job writes to its `done` once its output is written: a number
    no earlier batch used (int32, never 0, the flags' first value)."""
    global _serial
    _serial = _serial % (2**31 - 1) + 1
    batch = (cold_worker.Job * len(jobs))(*jobs)
    rc = cold_worker.load().pi_cold_start(batch, len(jobs), _serial)
    if rc != 0:
        raise RuntimeError(f"picompile: the cold worker did not start: "
                           f"{cold_worker.START_ERRORS.get(rc, rc)}")
    return _serial


def wait_cold(n: int) -> list[int]:
    """Wait for the cold worker's batch of n jobs (the GIL released). -> active pairs per job."""
    counts = (ctypes.c_int64 * n)()
    total = cold_worker.load().pi_cold_wait(counts)
    if total < 0:
        raise RuntimeError(f"picompile: cold FFN part failed: "
                           f"{cold_worker.WAIT_ERRORS.get(total, total)}")
    return list(counts)


def release_cold(stages: list[_Staging], serial: int, device: torch.device) -> None:
    """After an error between start_cold and the device's sends of the batch `serial`: let the
    worker run it through (on whatever inputs are there) so that it can be waited for: the
    device's queued copies land first, then each job's `ready` takes the serial."""
    if device.type == "cuda":
        with contextlib.suppress(RuntimeError):  # the error may be the device's own
            torch.cuda.current_stream(device).synchronize()
    for stage in stages:
        cold_worker.load().pi_set_flag(stage.ready.data_ptr(), serial)


def last_cold_seconds(k: int) -> tuple[float, float]:
    """Job k of the last batch: its wait for the input and its kernel time, in s (timelines)."""
    ready_s, run_s = ctypes.c_double(), ctypes.c_double()
    cold_worker.load().pi_cold_last_seconds(k, ctypes.byref(ready_s), ctypes.byref(run_s))
    return ready_s.value, run_s.value


class HybridFFN:
    """Runs one SparseFFN split at `n_hot` across `device` (hot) and the CPU (cold)."""

    def __init__(self, ffn: SparseFFN, device: torch.device | str, n_hot: int):
        self.device = torch.device(device)
        _check_quantized(ffn, self.device)
        self.n_hot = n_hot = max(0, min(int(n_hot), ffn.n_ff))
        self.n_ff = ffn.n_ff
        self.d = ffn.d_model
        self.hot = (_view(ffn, slice(0, n_hot), self.device, with_down_bias=True, share=False)
                    if n_hot else None)
        cold_bias = n_hot == 0  # b_down is added once, by whichever side exists
        self.cold = (_view(ffn, slice(n_hot, None), "cpu", cold_bias, share=True)
                     if n_hot < ffn.n_ff else None)
        self.cuda = self.device.type == "cuda"
        if self.cold is not None:
            self.cold.select_kernel()
        # Decode runs the cold part on the cold worker where its rows have a C kernel.
        self.cold_on_worker = self.cold is not None and self.cold.kernel is not None
        # The per-module path's batch serial, on the device: what send() copies into `ready`.
        self.serial = torch.zeros(1, dtype=torch.int32, device=self.device)
        if self.hot is not None and self.cuda:
            self.hot.kernel = CudaHotKernel(self.hot)
        elif self.hot is not None:
            self.hot.select_kernel()
        self._staging: _Staging | None = None
        # Set to [] to record per-step timings: dicts of tokens, hot_s (GPU time of the hot
        # kernels, from CUDA events), cold_s (the cold C kernel), cold_wait_s (the cold worker's
        # wait for its input), wall_s (the block, from entry to the merged output; CUDA events on
        # a GPU). Reading the events waits for the device, so `timings()` resolves them afterwards.
        self.timeline: list[dict] | None = None
        self._source = _weights_state(ffn)  # what the hot copies were made from

    def stale(self, ffn: SparseFFN) -> bool:
        """Whether `ffn`'s full weights changed since the split (storage swapped, or written in
        place through the Parameters): the hot rows on the device are copies of the old ones."""
        return _weights_state(ffn) != self._source

    def reset_stats(self) -> None:
        for side in (self.hot, self.cold):
            if side is not None:
                side.reset_stats()

    def active_pairs(self) -> int:
        return sum(int(side.active_pairs) for side in (self.hot, self.cold) if side is not None)

    def __getstate__(self):
        """Copies (deepcopy; pickle on the CPU stand-in) leave out the staging: its job holds raw
        pointers into this block's buffers. A copy makes its own on first use."""
        return {**self.__dict__, "_staging": None}

    def staging(self) -> _Staging:
        """This block's hand-off buffers, made once for KERNEL_MAX_TOKENS tokens (the most a
        call hands to the cold worker) and never replaced: the device decoder's CUDA graphs
        hold their addresses."""
        if self._staging is None:
            self._staging = _Staging(KERNEL_MAX_TOKENS, self.d, self.n_ff - self.n_hot, self.cuda)
        return self._staging

    def job(self, T: int, predicted: bool) -> cold_worker.Job:
        """The cold worker's job over this block's staging for T tokens, with the predictor's
        mask or without (made once, its per-call fields set here)."""
        if T > KERNEL_MAX_TOKENS:
            raise ValueError(f"picompile: the cold worker takes up to {KERNEL_MAX_TOKENS} tokens "
                             f"a call, got {T}")
        stage = self.staging()
        if stage.job is None:
            kernel = self.cold.kernel
            stage.job = cold_worker.Job(
                function_pointer(kernel.library.ffn), *kernel.pointers(), self.cold.n_ff, self.d,
                0, self.cold.threshold, stage.x.data_ptr(), None, stage.out.data_ptr(),
                stage.ready.data_ptr(), cold_threads(), stage.done.data_ptr())
        job = stage.job
        job.T = T
        job.mask = stage.mask.data_ptr() if predicted else None
        # The job's threshold follows the block's (calibration may set it after distribute), its
        # threads cold_threads() (whose override may change between steps: a benchmark's sweep).
        job.threshold = self.cold.threshold
        job.threads = cold_threads()
        return job

    def send(self, stage: _Staging, x: torch.Tensor, predicted: torch.Tensor | None,
             serial: torch.Tensor) -> None:
        """Device side of the hand-off: x [T, d] float32 and the cold columns of `predicted`
        into the staging, then the batch's serial [1] int32 (on the device) into `ready` (on a
        GPU, copies queued on the current stream, the flag last: it lands after them). Nothing
        here waits, so a CUDA graph can hold it."""
        T = x.shape[0]
        copy_async(stage.x[:T], x)
        if predicted is not None:
            copy_async(stage.mask[:T], predicted[:, self.n_hot :].contiguous())
        if self.cuda:
            copy_async(stage.ready, serial)
        else:  # the stand-in: a release store, seen after x and the mask
            cold_worker.load().pi_set_flag(stage.ready.data_ptr(), int(serial))

    def wait_done(self, stage: _Staging, serial: torch.Tensor, gave_up: torch.Tensor) -> None:
        """Device side: the device's work that follows waits until the cold worker has written
        this block's output (`done` equals serial [1] int32, on the device). On a GPU a kernel
        queued on the current stream (capturable), which sets gave_up [1] int32 (pinned) if it
        ever stops waiting; on the CPU stand-in this thread waits."""
        if self.cuda:
            from picompile.codegen.cuda import wait_value

            wait_value(stage.done, serial, gave_up)
        elif cold_worker.load().pi_wait_value(stage.done.data_ptr(), int(serial)) != 0:
            raise RuntimeError("picompile: the cold worker never finished a block's rows "
                               "(timed out)")

    def receive(self, stage: _Staging, T: int) -> torch.Tensor:
        """Wait for the cold worker (the GIL released). -> its output [T, d] float32 on the host;
        its active pairs are added to the cold side's count."""
        (n_active,) = wait_cold(1)
        self.cold.active_pairs += n_active
        return stage.out[:T]

    def __call__(self, x: torch.Tensor, predicted: torch.Tensor | None) -> torch.Tensor:
        """x [T, d] on the device, predicted [T, n_ff] bool or None -> out [T, d] float32."""
        T = x.shape[0]
        timing = self.timeline is not None
        if timing:
            marks = {k: self._mark() for k in ("start", "hot_start", "hot_end", "end")}
            self._record(marks["start"])
            t0 = time.perf_counter()
        x = x.float()  # both sides add float32 partial outputs
        if predicted is not None and 1 < T <= KERNEL_MAX_TOKENS:
            # The GPU's kernels compute the union of a few tokens' predicted rows for each of
            # them (codegen/cuda.py); the cold rows do the same, so that the block is one thing
            predicted = predicted.any(0, keepdim=True).expand(T, -1).contiguous()
        hot_mask = None if predicted is None else predicted[:, : self.n_hot]
        # 1. the cold part starts on the worker thread as soon as its input reaches the host
        # (prefill: the cold side's dense BLAS path, on this thread)
        on_worker = self.cold_on_worker and T <= KERNEL_MAX_TOKENS
        stage, serial = self.staging() if on_worker else None, None
        out, cold_s, cold_wait_s = None, 0.0, 0.0
        try:
            if on_worker:  # this block alone as the worker's batch
                serial = start_cold([self.job(T, predicted is not None)])
                self.serial.fill_(serial)
                self.send(stage, x, predicted, self.serial)
            if self.hot is not None:  # 2. meanwhile: the hot part (asynchronous on a GPU)
                if timing:
                    self._record(marks["hot_start"])
                    t_hot, active_before = time.perf_counter(), self.hot.active_pairs
                out = self.hot(x, hot_mask).float()
                if timing:
                    self._record(marks["hot_end"])
                    hot_s = time.perf_counter() - t_hot  # the launches; GPU time from the events
                    candidates = self.n_hot if hot_mask is None else hot_mask.any(0).sum()
                    hot_bytes = self._bytes_read(candidates, self.hot.active_pairs - active_before)
        except BaseException:
            if serial is not None:  # release the worker before waiting for it
                release_cold([stage], serial, self.device)
            raise
        finally:
            if serial is not None:  # 3. the cold part's result (waited for even on an error)
                cold_out = self.receive(stage, T)
                if timing:
                    cold_wait_s, cold_s = last_cold_seconds(0)
        if self.cold is not None:
            if serial is None:  # prefill, or no C kernel for the cold rows: on this thread
                t_cold = time.perf_counter()
                cold_mask = None if predicted is None else predicted[:, self.n_hot :].cpu()
                with torch.no_grad():
                    cold_out = self.cold(x.cpu(), cold_mask)
                cold_s = time.perf_counter() - t_cold
            cold_out = cold_out.to(self.device, non_blocking=True)  # 4. merged on the device
            out = cold_out if out is None else out + cold_out
        elif out is None:
            raise AssertionError("a hybrid block with neither a hot nor a cold part")
        if timing:
            self._record(marks["end"])
            step = dict(tokens=T, cold_s=cold_s, cold_wait_s=cold_wait_s,
                        wall_s=time.perf_counter() - t0,
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
        down; the down row in its own format)."""
        gated, relu = self.hot.w_gate is not None, zero_below(self.hot.act)
        first, later = (2, 1) if gated and not relu else (1, 2) if gated else (1, 1)
        row, down = self.hot.row_bytes, self.hot.down_row_bytes
        return candidates * first * row + active * ((later - 1) * row + down)

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


def _weights_state(ffn: SparseFFN) -> tuple:
    """(storage, in-place version) of each of ffn's weights and biases."""
    return tuple(None if t is None else (t.data_ptr(), t._version)
                 for t in (ffn.w_gate, ffn.w_up, ffn.w_down_t, ffn.b_gate, ffn.b_up, ffn.b_down))


def _check_quantized(ffn: SparseFFN, device: torch.device) -> None:
    """Quantized blocks split across a GPU where its kernels read their formats: any GGUF
    format for the gate / up rows (codegen.cuda's quantized variants) with q8_0 down rows."""
    from picompile.codegen.cuda import DOWN_QFORMAT

    if ffn.qformat is not None and device.type != "cpu" and ffn.down_qformat != DOWN_QFORMAT:
        raise ValueError(
            f"picompile: the FFN block {ffn.block.name} is quantized ({ffn.qformat}, down rows "
            f"{ffn.down_format}) and cannot run split across {device.type} and the CPU: the GPU "
            f"kernels take quantized gate / up rows with {DOWN_QFORMAT} down rows only. "
            f"Quantize with down_fmt='{DOWN_QFORMAT}', keep the model on the CPU, or compile "
            "without quantize= to use the GPU")


def distribute(model: nn.Module, ffns: dict[str, SparseFFN], device: torch.device | str,
               move_non_ffn: bool = True, host_layers: list[str] = ()) -> None:
    """Put the model on `device` as planned: every non-FFN parameter and buffer, each block's
    predictor (16-bit on a GPU) and its hot rows (block.decided.hot_neurons of them, hot-first order
    already applied); cold rows stay on the CPU. The decoder layers named in `host_layers`
    (placement's) stay wholly on the CPU, their blocks unsplit (`hybrid` None); hooks move a
    layer's inputs to the CPU and its output back, for the per-module path (the device decoder
    hands them over itself)."""
    device = torch.device(device)
    host = [model.get_submodule(name) for name in host_layers]
    on_host = {id(m) for layer in host for m in layer.modules()}
    split = {name: f for name, f in ffns.items() if id(f) not in on_host}
    for ffn in split.values():  # before anything moves
        _check_quantized(ffn, device)
    inside = {id(m) for f in ffns.values() for m in f.modules()}
    if move_non_ffn:
        for module in model.modules():
            if id(module) in inside:
                continue
            to = torch.device("cpu") if id(module) in on_host else device
            for name, p in list(module.named_parameters(recurse=False)):
                p.data = p.data.to(to)
            for name, b in list(module.named_buffers(recurse=False)):
                module._buffers[name] = b.to(to)
    for layer in host:
        _run_on_host(layer, device)
    for ffn in ffns.values():
        if id(ffn) in on_host:  # whole, on the CPU, with its CPU kernels and predictor
            ffn.hybrid = None
            ffn.to("cpu")
            ffn.select_kernel()
            if ffn.predictor is not None:
                ffn.predictor.select_kernel()
    for ffn in split.values():
        if ffn.predictor is not None:  # 16 bits on a GPU, as the budget counts it: bfloat16
            # for a bfloat16 model, whose activations may pass float16's range, else float16
            half = torch.bfloat16 if ffn.float_dtype == torch.bfloat16 else torch.float16
            ffn.predictor.to(device=device, dtype=half if device.type == "cuda" else None)
        # The full weights on the CPU (for save, explain), where the cold rows are read as
        # views of them; the hot rows are copied to the device from there.
        for name in ("w_gate", "w_up", "w_down_t", "b_gate", "b_up", "b_down"):
            p = getattr(ffn, name)
            if p is not None:
                p.data = p.data.to("cpu")
        ffn.hybrid = HybridFFN(ffn, device, ffn.block.decided.hot_neurons)


def _to(value, device: torch.device):
    """Every tensor in value (nested tuples, lists, dicts) on `device`; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_to(v, device) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _run_on_host(layer: nn.Module, device: torch.device) -> None:
    """Hooks on a decoder layer left on the CPU: its inputs (hidden states, position embeddings,
    mask) moved to the CPU, its output to `device`, where the next layer is. A KV cache
    object passes as it is: the layer's own entries are made on the CPU."""
    for handle in getattr(layer, "_picompile_host_hooks", ()):
        handle.remove()
    cpu = torch.device("cpu")
    layer._picompile_host_hooks = (
        layer.register_forward_pre_hook(lambda m, args, kwargs: (_to(args, cpu), _to(kwargs, cpu)),
                                        with_kwargs=True),
        layer.register_forward_hook(lambda m, args, output: _to(output, device)),
    )
