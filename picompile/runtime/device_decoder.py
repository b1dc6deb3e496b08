"""DeviceDecoder: picompile's decode step for a pre-norm decoder stack (decoder.Family: Llama and
its relatives, Granite, Gemma, OPT) split across a GPU and the CPU.

    dec = DeviceDecoder(model)        # model distributed (runtime/hybrid.distribute); Unsupported
    dec.reserve(max_len)              # static KV cache and RoPE tables on the device
    logits = dec.prefill(input_ids)   # the prompt [1, S] into that cache
    logits = dec.step(tokens, pos)    # tokens [1] long on the device -> [1, vocab] float32
    dec.flush_stats(steps)

The interface and the structure checks (decoder.Stack) of the C whole-step decoder, for the case
that one cannot run, and a prefill of its own (so that on a GPU the only KV cache is the
decoder's, within the budget placement counted for it): the non-FFN layers on the device (the model's own modules: norms,
projections, LM head), attention over a static KV cache written in place, and per layer the
block's hybrid hand-off in its phases (runtime/hybrid.py): the block input sent to the host, the
hot rows' kernels, a wait on the device for the cold output, the cold output merged.

Why a step of its own: Hugging Face eager runs some 15 launches per layer with Python between
them; here every shape is static and the position is a device tensor, so on a GPU the step's
device work is one CUDA graph, replayed per step:

    host:   start the cold worker on every split block of the step (one batch, in order)
    graph:  embed, layer 0 attention, its FFN input sent, hot kernels, wait until the worker
            has written layer 0's cold rows (a kernel polling a pinned flag), merge,
            layer 1 attention, ... final norm, LM head
    worker: per block: spin until its input lands, its cold rows, set its `done` flag
    host:   wait for the worker (its counts, its errors)

So nothing in a step waits for the host, and the host does not wake per block (a GPU waiting
on the host's flag costs about a PCIe read; a host waking and launching the next graph cost
hundreds of microseconds per block). Decoder layers that placement left wholly on the CPU
(their attention did not fit the budget: Placement.host_layers) cut the step into segments:
the residual stream goes to pinned memory at the end of one, the host runs those layers (their
KV cache on the CPU, as one kernels/decoder.c call, or through their modules), and the next
segment starts by copying it back; each segment's split blocks are one batch of the worker.
The graphs are captured at reserve() and checked against the eager step on the same inputs;
where capture fails or differs the decoder runs the same segments eagerly and says why
(`graph_reason`); a timed step (`timeline`) runs them eagerly too, with CUDA events around
each split block. On the CPU stand-in (device "cpu", how CI runs this file) the segments run
eagerly, the calling thread waiting for each block's flag: every hand-off, copy and merge of
the GPU path runs, with no graph.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F
from torch import nn

from picompile.codegen.cuda import HOST_WAIT_TIMEOUT_S, host_wait_works
from picompile.config import KV_CACHE_STEP, cuda_graphs_enabled
from picompile.runtime.decoder import HostLayers, Stack, Unsupported, ffn_block, rotated
from picompile.runtime.hybrid import (copy_async, last_cold_seconds, release_cold, start_cold,
                                      wait_cold)
from picompile.runtime.sparse_ffn import SparseFFN

# Largest difference between a graph replay's logits and the eager step's, relative to the
# largest logit: the same kernels on the same inputs (cuBLAS may pick another algorithm inside
# a capture, so not bit for bit).
GRAPH_RTOL = 1e-2


def _linear_of(mod: nn.Module | None, where: str) -> nn.Module:
    if mod is None or not isinstance(getattr(mod, "in_features", None), int):
        raise Unsupported(f"{where} is a {type(mod).__name__}, not a linear layer")
    return mod


def _hybrid_ffn_of(mlp: nn.Module, where: str) -> SparseFFN:
    ffn = ffn_block(mlp, where)
    hy = ffn.hybrid
    if hy is None:  # a block of a decoder layer placement left on the CPU: runs on the host
        return ffn
    if hy.timeline is not None:
        raise Unsupported(f"{where} times its hand-offs (hybrid timeline): the per-module path "
                          "runs, which records them")
    if hy.hot is not None and hy.hot.kernel is None:
        raise Unsupported(f"{where}: its hot rows have no kernel")
    if hy.cold is not None and not hy.cold_on_worker:
        raise Unsupported(f"{where}: its cold rows have no C kernel")
    return ffn


@functools.lru_cache(maxsize=None)
def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream every device decoder on `device` warms up and captures on: cuBLAS
    keeps a workspace (32 MiB on Hopper) per stream it has run on, never freed, so a new
    stream per capture would add one per decoder built."""
    return torch.cuda.Stream(device)


def _post(norm, y: torch.Tensor) -> torch.Tensor:
    """y normed by a layer's post-norm (Gemma 2), or y where it has none."""
    return y if norm is None else norm.module(y)


class ColdWaitTimeout(RuntimeError):
    """The GPU stopped waiting for a split block's cold rows: a step read an output the CPU
    never wrote (the cold worker hung, or the host is overloaded)."""


class DeviceDecoder(Stack):
    """A decode step over a distributed model, segment by segment (module docstring)."""

    def prefills(self, n: int) -> bool:
        return True  # always: the model's own prefill would fill a cache on the device

    def __init__(self, model: nn.Module):
        super().__init__(model, _linear_of, _hybrid_ffn_of)
        if self.family.parallel:  # its steps read the FFN input after the attention's output
            raise Unsupported(f"{self.family.name}'s parallel attention and FFN (the split step "
                              "runs them one after the other)")
        if self.family.qkv_per_head:  # its attention splits a fused projection as [q; k; v]
            raise Unsupported(f"{self.family.name}'s q, k and v interleaved by head in one "
                              "projection (the split step reads them one after the other)")
        self.device, self.dtype = self.embedding.device, self.embedding.dtype
        self.ffns = [layer.ffn for layer in self.layers]
        # Decoder layers placement left wholly on the CPU (their blocks unsplit): they run on
        # the host between two segments, over a KV cache of their own there.
        self.on_host = [f.hybrid is None for f in self.ffns]
        if all(self.on_host):
            raise Unsupported("no FFN block is split across a device and the CPU")
        inside = {id(p) for layer in self.layers for p in layer.ffn.parameters()}
        host = {id(p) for layer, on_host in zip(self.decoder_layers, self.on_host) if on_host
                for p in layer.parameters()}
        for n, p in model.named_parameters():
            if id(p) in host and p.device.type != "cpu":
                raise Unsupported(f"{n} is in a decoder layer that runs on the CPU but lies on "
                                  f"{p.device}")
            if id(p) not in inside and id(p) not in host and p.device != self.device:
                raise Unsupported(f"{n} is on another device than the embedding ({self.device})")
        self.predicted = [f.predictor is not None and f.predictor.enabled for f in self.ffns]
        self.stages = [None if f.hybrid is None or f.hybrid.cold is None else f.hybrid.staging()
                       for f in self.ffns]
        if self.device.type == "cuda" and any(s is not None for s in self.stages):
            why = host_wait_works(self.device.index or 0)
            if why:  # the per-module path runs instead (its host waits for each block)
                raise Unsupported(why)
        L = len(self.layers)
        self.n_active = torch.zeros(L, dtype=torch.int64, device=self.device)  # hot side, [L]
        # The cold worker's batch's serial (hybrid.start_cold), which it writes to each block's
        # `done` flag and the device waits for: set before each segment runs.
        self.serial = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.tok = torch.zeros(1, dtype=torch.long, device=self.device)  # the step's token
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)  # and its position
        self.pos_host = torch.zeros(1, dtype=torch.long)  # the same, for the host layers
        pinned = self.device.type == "cuda"
        # Set by the device if a wait for a cold output ever gave up (codegen.cuda.wait_value):
        # the step that went on read an output never written, so decoding stops (_check_waits).
        self.gave_up = torch.zeros(1, dtype=torch.int32, pin_memory=pinned)
        self.x_host = torch.empty(1, self.d, dtype=self.dtype, pin_memory=pinned)  # [1, d]
        self.x_back = torch.empty(1, self.d, dtype=self.dtype, device=self.device)  # [1, d]
        self.cold_out = [None if s is None else torch.empty(1, self.d, device=self.device)
                         for s in self.stages]  # [1, d] float32: a cold part's output, landed
        self.max_len = 0
        # Runs of host layers bound to kernels/decoder.c at reserve(), by their layer indices;
        # host_reason: why a run was not (it then runs through the model's modules).
        self.host_runs: dict[tuple, HostLayers] = {}
        self.host_reason = ""
        self.k_cache, self.v_cache = [], []  # per layer [1, KV, max_len, hd], where it runs
        # [] to time each segment and split block of the steps that follow (timings() resolves
        # them); None: off. Timed steps run eagerly and wait for each segment's device work.
        self.timeline: list[dict] | None = None
        self._marks: dict[int, dict] | None = None  # per split block, while a timed step runs
        self.graphs = None
        self.graph_reason = "not captured (no reserve yet)"
        # The step's device work, cut where the residual stream goes to the host layers:
        # [(functions to run in order, the split layers whose cold parts the cold worker
        # computes meanwhile, as one batch, the host layers that run after it)].
        self.segments, fns, cold = [], [self._embed], []
        for i, stage in enumerate(self.stages):
            if self.on_host[i]:
                if i == 0 or not self.on_host[i - 1]:  # a run of host layers starts
                    self.segments.append((fns + [self._to_host], cold, []))
                    fns, cold = [self._from_host], []
                self.segments[-1][2].append(i)
                continue
            fns += [functools.partial(self._attention, i), functools.partial(self._ffn_begin, i)]
            if stage is not None:
                cold.append(i)
                fns.append(functools.partial(self._ffn_wait, i))
            fns.append(functools.partial(self._ffn_end, i))
        self.segments.append((fns + [self._head], cold, []))

    def describe(self) -> str:
        graphs = ("each a CUDA graph" if self.graphs is not None else
                  f"eager: {self.graph_reason}")
        n = sum(self.on_host)
        how = (f"their modules: {self.host_reason}" if self.host_reason else
               "kernels/decoder.c" if self.host_runs else "not bound yet")
        host = (f", {n} decoder layer{'s' if n > 1 else ''} on the CPU between them ({how})"
                if n else "")
        n_seg, n_split = len(self.segments), sum(s is not None for s in self.stages)
        return (f"picompile device decoder (runtime/device_decoder.py, {n_seg} "
                f"segment{'s' if n_seg > 1 else ''} per token{host}, {n_split} split block"
                f"{'s' if n_split != 1 else ''} waited for on the device, {graphs})")

    # ---- the step's pieces (device work only: capturable) --------------------------------
    def _embed(self) -> None:
        self.x = self._embedded(self.tok, self.pos)  # [1, d], the model's dtype

    def _embedded(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tokens [T] at positions pos [T] (device) -> [T, d]: their embeddings (scaled, where
        the model scales them), plus learned positions where the model has them."""
        x = self.embedding.index_select(0, tokens)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        if self.learned_positions is not None:
            x = x + self.learned_positions.index_select(0, pos)
        return x

    def _attention(self, i: int) -> None:
        self.x = self.x + self._attend(i, self.x, self.pos)

    def _to_host(self) -> None:
        copy_async(self.x_host, self.x)  # lands before the host layers run (_run waits)

    def _from_host(self) -> None:
        copy_async(self.x_back, self.x_host)
        self.x = self.x_back

    def _host_layers(self, layers: list[int]) -> None:
        """Layers that placement left on the CPU, over the residual stream in x_host (the
        model's dtype) and their KV cache on the CPU: one kernels/decoder.c call where the run
        is bound (host_runs), else attention here and the FFN through the block's own module
        (its CPU kernels, its predictor)."""
        run = self.host_runs.get(tuple(layers))
        if run is not None:  # one C call (kernels/decoder.c), the stream in float32
            x = self.x_host.float()  # [1, d]
            run(x, int(self.pos_host))
            self.x_host.copy_(x)
            return
        x = self.x_host.clone()  # [1, d]
        for i in layers:
            x = x + self._attend(i, x, self.pos_host)
            x = x + self._ffn_module(i, x)
        self.x_host.copy_(x)

    def _ffn_module(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Layer i's FFN sublayer through its own module, for x [T, d] -> [T, d]."""
        layer = self.layers[i]
        out = layer.mlp(layer.ffn_norm.module(x).unsqueeze(0))[0].to(self.dtype)
        return self._residual(_post(layer.post_norms[1], out))

    def _attend(self, i: int, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Layer i's attention sublayer for x [T, d] at positions pos [T] (device): their keys
        and values written into the cache, each token attending to positions up to its own.
        -> [T, d], the model's dtype."""
        layer = self.layers[i]
        lin = layer.linears
        H, KV, hd, T = self.n_heads, self.n_kv_heads, self.head_dim, x.shape[0]
        h = layer.attn_norm.module(x)  # [T, d]
        if "qkv_proj" in lin:  # fused [q; k; v] (Phi-3)
            q, k, v = lin["qkv_proj"](h).split([H * hd, KV * hd, KV * hd], dim=-1)
        else:
            q, k, v = lin["q_proj"](h), lin["k_proj"](h), lin["v_proj"](h)
        q, k = q.reshape(T, H, hd), k.reshape(T, KV, hd)
        if layer.head_norms is not None:  # each head RMS-normed (Qwen3)
            q, k = layer.head_norms[0].module(q), layer.head_norms[1].module(k)
        q = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, hd]
        k = k.transpose(0, 1).unsqueeze(0)  # [1, KV, T, hd]
        v = v.reshape(T, KV, hd).transpose(0, 1).unsqueeze(0)
        rope, positions = self.tables[x.device.type]  # the device's, or the host layers'
        if self.learned_positions is None:  # RoPE, as HF's apply_rotary_pos_emb, model's dtype
            cos, sin = (t.index_select(0, pos) for t in rope[layer.rope])  # [T, rot]
            q, k = rotated(q, cos, sin), rotated(k, cos, sin)
        self.k_cache[i].index_copy_(2, pos, k)  # [1, KV, max_len, hd]
        self.v_cache[i].index_copy_(2, pos, v)
        visible = positions.view(1, -1) <= pos.view(-1, 1)  # [T, max_len]
        if layer.window:  # a sliding-window layer: the last `window` positions
            visible &= positions.view(1, -1) > pos.view(-1, 1) - layer.window
        visible = visible.view(1, 1, T, -1)
        k, v = self.k_cache[i], self.v_cache[i]  # [1, KV, max_len, hd]
        if self.attn_softcap:  # scores capped by tanh (Gemma 2): not in SDPA
            k, v = (t.repeat_interleave(H // KV, dim=1) for t in (k, v))
            scores = (q @ k.transpose(-1, -2)).float() * self.scale  # [1, H, T, max_len]
            scores = torch.tanh(scores / self.attn_softcap) * self.attn_softcap
            p = scores.masked_fill(~visible, float("-inf")).softmax(-1).to(v.dtype)
            a = p @ v  # [1, H, T, hd]
        else:  # each KV head's G = H / KV query heads as G * T queries of one head (HF's
            # repeat_kv order): SDPA with a mask and enable_gqa takes the math path on CUDA,
            # which repeats the whole cache per query head
            G = H // KV
            a = F.scaled_dot_product_attention(
                q.reshape(1, KV, G * T, hd), k, v, scale=self.scale,
                attn_mask=visible.expand(1, G, T, -1).reshape(1, 1, G * T, -1))  # [1, KV, G*T, hd]
            a = a.reshape(1, H, T, hd)
        out = lin["o_proj"](a[0].transpose(0, 1).reshape(T, H * hd))
        return self._residual(_post(layer.post_norms[0], out))

    def _ffn_begin(self, i: int) -> None:
        """Layer i's FFN input to the cold worker's staging (where it has cold rows) and its hot
        rows' kernels on the device; the hot output and count stay on the device."""
        ffn, hy = self.ffns[i], self.ffns[i].hybrid
        self._mark(i, "begin")
        h = self.layers[i].ffn_norm.module(self.x)  # [1, d]
        predicted = ffn.predictor(h) if self.predicted[i] else None  # [1, n_ff] bool or None
        h = h.float()
        if self.stages[i] is not None:
            hy.send(self.stages[i], h, predicted, self.serial)
        self.hot_out[i] = None
        if hy.hot is not None:
            mask = None if predicted is None else predicted[:, : hy.n_hot]
            out, n_active = hy.hot.kernel(h, threshold=hy.hot.threshold, mask=mask)
            self.n_active[i : i + 1].add_(n_active)
            self.hot_out[i] = out  # [1, d] float32
        self._mark(i, "hot_end")

    def _ffn_wait(self, i: int) -> None:
        """The device waits until the cold worker has written layer i's cold output."""
        self.ffns[i].hybrid.wait_done(self.stages[i], self.serial, self.gave_up)

    def _ffn_end(self, i: int) -> None:
        out = self.hot_out[i]
        if self.stages[i] is not None:  # written on the host: _ffn_wait has seen it
            copy_async(self.cold_out[i], self.stages[i].out[:1])
            out = self.cold_out[i] if out is None else out + self.cold_out[i]
        self.x = self.x + self._residual(_post(self.layers[i].post_norms[1], out.to(self.dtype)))
        self._mark(i, "end")

    def _residual(self, y: torch.Tensor) -> torch.Tensor:
        """A sublayer's output as it joins the residual stream (Granite scales it)."""
        return y if self.residual_scale == 1.0 else y * self.residual_scale

    def _head(self) -> None:
        self.logits = self._logits(self.x)  # [1, vocab]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, d] -> [T, vocab] float32: the final norm, the LM head, the cap of the logits
        where the model caps them (Gemma 2)."""
        logits = self.lm_head(self.final_norm.module(x)).float()
        if self.logit_divisor != 1.0:  # Granite
            logits = logits / self.logit_divisor
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    # ---- running ------------------------------------------------------------------------
    def _run(self) -> None:
        """One step over the inputs in self.tok, self.pos: each segment (a graph replay where
        captured, eagerly while timed), the cold worker started on its split blocks before and
        waited for after; the host layers between segments."""
        self._check_waits()
        timing = self.timeline is not None
        for k, (fns, cold, host) in enumerate(self.segments):
            t0 = time.perf_counter()
            self._marks = {} if timing else None
            serial = None
            try:
                if cold:
                    serial = start_cold([self.ffns[i].hybrid.job(1, self.predicted[i])
                                         for i in cold])
                    self.serial.fill_(serial)
                if self.graphs is not None and not timing:
                    self.graphs[k].replay()
                else:
                    for fn in fns:
                        fn()
            except BaseException:
                if serial is not None:  # release the worker before waiting for it
                    release_cold([self.stages[i] for i in cold], serial, self.device)
                raise
            finally:
                if serial is not None:
                    for i, n in zip(cold, wait_cold(len(cold))):
                        self.ffns[i].hybrid.cold.active_pairs += n
            if timing:
                self._timed(k, cold, t0)
            if host:
                if self.device.type == "cuda":  # x_host has landed
                    torch.cuda.current_stream(self.device).synchronize()
                t_host = time.perf_counter()
                self._host_layers(host)
                if timing:
                    self.timeline[-1]["host_s"] = time.perf_counter() - t_host
        self._marks = None

    def _check_waits(self) -> None:
        """Raise if the device ever stopped waiting for a cold output (a step already run read
        one never written; the device's work runs behind the host, so a later step or
        flush_stats finds out)."""
        if int(self.gave_up):
            self.gave_up.zero_()  # said once: the steps after it are the user's to retry
            raise ColdWaitTimeout(
                "picompile: the GPU stopped waiting for the CPU's cold rows of a split FFN block "
                f"after {HOST_WAIT_TIMEOUT_S:g} s, so a decode step used an output never written: "
                "the cold worker hung or the host is overloaded. Decode again; if it recurs, run "
                "on the CPU (gpu_budget=None) and report it")

    # ---- timing -------------------------------------------------------------------------
    def _mark(self, i: int, key: str) -> None:
        """While a timed step runs: a time stamp of split block i's `key` point (a CUDA event
        on a GPU, recorded on the stream; the host's clock on the stand-in)."""
        if self._marks is None or self.stages[i] is None:
            return
        if self.device.type == "cuda":
            mark = torch.cuda.Event(enable_timing=True)
            mark.record()
        else:
            mark = time.perf_counter()
        self._marks.setdefault(i, {})[key] = mark

    def _timed(self, k: int, cold: list[int], t0: float) -> None:
        """Segment k's entries, its device work waited for: one per split block (its time
        stamps, the cold worker's own times), then the segment's wall time."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        wall = time.perf_counter() - t0
        for j, i in enumerate(cold):
            wait_s, cold_s = last_cold_seconds(j)
            self.timeline.append(dict(segment=k, layer=i, marks=self._marks.pop(i), cold_s=cold_s,
                                      cold_wait_s=wait_s, host_s=0.0))
        self.timeline.append(dict(segment=k, layer=None, wall_s=wall, host_s=0.0))

    def timings(self) -> list[dict]:
        """The timeline: per segment (layer None) wall_s and host_s (the host layers that run
        after it, if any: not in wall_s); per split block (layer i) wall_s (from its FFN input
        to its merged output), device_s (its norm, predictor and hot rows; on a GPU both from
        CUDA events), cold_s and cold_wait_s (the cold worker's kernel time and its wait for
        the input)."""
        for entry in self.timeline or []:
            marks = entry.pop("marks", None)
            if marks is None:
                continue
            if self.device.type == "cuda":
                span = lambda a, b: marks[a].elapsed_time(marks[b]) / 1e3  # noqa: E731
            else:
                span = lambda a, b: marks[b] - marks[a]  # noqa: E731
            entry["wall_s"], entry["device_s"] = span("begin", "end"), span("begin", "hot_end")
        return self.timeline or []

    def step(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        """tokens [1] (long) at position pos -> logits [1, vocab] float32 (a buffer reused by
        the next step). The KV cache holds positions 0..pos-1."""
        if not 0 <= pos < self.max_len:
            raise IndexError(f"position {pos} outside the reserved {self.max_len}")
        self.tok.copy_(tokens.reshape(1))
        self.pos.fill_(pos)
        self.pos_host.fill_(pos)
        self._run()
        return self.logits

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        """input_ids [1, S] (long, on the device) at positions start..S-1 into the KV cache
        (reserved for S positions and more; positions 0..start-1 already there: the prompt
        cache) -> logits [1, vocab] float32 of the last. Eager, through the model's own FFN
        modules (each side of a split block batched), so the cache the decode steps read is the
        only one on the device."""
        S = input_ids.shape[-1]
        if S > self.max_len:
            raise IndexError(f"{S} prompt positions, room for {self.max_len} (reserve first)")
        pos = torch.arange(start, S, device=self.device)
        x = self._embedded(input_ids.reshape(S)[start:], pos)  # [S - start, d]
        for i in range(len(self.layers)):
            where = "cpu" if self.on_host[i] else self.device
            x = x.to(where)
            x = x + self._attend(i, x, pos.to(where))
            x = x + self._ffn_module(i, x)
        return self._logits(x[-1:].to(self.device))

    def set_threads(self) -> None:
        """The cold worker sets its own OpenMP threads (hybrid.cold_threads)."""

    def release(self) -> None:
        """Drop the graphs (and their memory pool), the KV cache and the tables now: the steps
        refer to the decoder itself (a reference cycle), so a replaced decoder would otherwise
        hold that GPU memory next to its successor's until the collector ran."""
        self.graphs, self.segments, self.graph_reason = None, [], "released"
        self.k_cache = self.v_cache = self.hot_out = []
        self.host_runs = {}
        self.tables, self.max_len, self.x, self.logits = {}, 0, None, None

    def reserve(self, max_len: int) -> bool:
        """Make room for positions 0..max_len-1 (static KV cache, RoPE tables; on a GPU the
        step's graphs captured for them); False where a step cannot run that many
        (Stack.fits)."""
        if not self.fits(max_len):
            return False
        if max_len <= self.max_len:
            return True
        # Up to a whole KV_CACHE_STEP, not geometrically: on a GPU the cache is counted in the
        # budget (placement's max_context, rounded so), and each growth captures the graphs again.
        max_len = self.room(-(-max_len // KV_CACHE_STEP) * KV_CACHE_STEP)
        shape = (1, self.n_kv_heads, max_len, self.head_dim)  # per layer, where it runs
        where = ["cpu" if h else self.device for h in self.on_host]
        old = self.max_len

        def grown(caches: list[torch.Tensor]) -> list[torch.Tensor]:
            new = [torch.zeros(shape, dtype=self.dtype, device=w) for w in where]
            for n, c in zip(new, caches if old else []):  # the positions cached so far stay
                n[:, :, :old] = c  # (the prompt cache reads them)
            return new

        self.k_cache, self.v_cache = grown(self.k_cache), grown(self.v_cache)
        rope, rope32 = {}, None  # {kind: cos, sin [max_len, rot]}, the model's dtype; float32
        if self.learned_positions is None:
            tables = self.rope_tables(max_len)
            rope = {kind: (cos.to(self.dtype), sin.to(self.dtype))
                    for kind, (cos, sin) in tables.items()}
            rope32 = {kind: (cos.float().cpu().contiguous(), sin.float().cpu().contiguous())
                      for kind, (cos, sin) in tables.items()}
        positions = torch.arange(max_len, device=self.device)
        # {device type: (RoPE tables, positions)} for the layers that run there
        self.tables = {t.type: ({k: (c.to(t), s.to(t)) for k, (c, s) in rope.items()},
                                positions.to(t))
                       for t in {self.device, torch.device("cpu")}}
        self.hot_out = [None] * len(self.layers)
        self.max_len = max_len
        self._bind_host_runs(rope32)
        self.graphs = None
        self.graph_reason = self._capture()
        return True

    def _bind_host_runs(self, rope32: dict | None) -> None:
        """Each run of host layers through kernels/decoder.c (HostLayers), over their KV caches
        here; a run it cannot bind keeps the model's modules, and host_reason says why."""
        self.host_runs, self.host_reason = {}, ""
        for _, _, host in self.segments:
            if not host:
                continue
            try:
                self.host_runs[tuple(host)] = HostLayers(self, host, self.k_cache, self.v_cache,
                                                         rope32)
            except (Unsupported, OSError, RuntimeError) as e:  # RuntimeError: the library
                self.host_reason = f"{type(e).__name__}: {e}"  # cannot be built or loaded

    # ---- CUDA graphs ----------------------------------------------------------------------
    def _capture(self) -> str:
        """Capture each segment as a CUDA graph (sharing one memory pool, in replay order, so a
        tensor one segment leaves for the next stays put) and check a replayed step against the
        eager one. -> "" when the graphs run, else why not."""
        if self.device.type != "cuda":
            return f"no CUDA graphs on {self.device.type}"
        if not cuda_graphs_enabled():
            return "CUDA graphs switched off (PICOMPILE_CUDA_GRAPHS=0)"
        counts = self.n_active.clone(), [f.hybrid.cold.active_pairs if s is not None else 0
                                         for f, s in zip(self.ffns, self.stages)]
        timeline, self.timeline = self.timeline, None  # the scratch steps are not timed
        try:
            # A scratch step at the last position (rewritten when decoding reaches it), eager
            # on a side stream first: cuBLAS, cupy's modules and the allocator warm up there,
            # and the graphs are captured on the same stream (cuBLAS keeps a workspace per
            # stream for the process's life: place.CUBLAS_WORKSPACE_BYTES counts this one and
            # the default stream's, so every capture uses the one side stream).
            self.tok.zero_()
            self.pos.fill_(self.max_len - 1)
            self.pos_host.fill_(self.max_len - 1)
            side = _capture_stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._run()
            side.synchronize()
            self._check_waits()  # a wait that gave up is no capture problem: raised as it is
            torch.cuda.current_stream(self.device).wait_stream(side)
            want = self.logits.clone()
            pool, graphs = torch.cuda.graph_pool_handle(), []
            for fns, _, _ in self.segments:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=side,
                                      capture_error_mode="thread_local"):
                    for fn in fns:
                        fn()
                graphs.append(graph)
            self.graphs = graphs
            self._run()
            err = float((self.logits - want).abs().max()) / max(float(want.abs().max()), 1e-6)
            if not err <= GRAPH_RTOL:
                self.graphs = None
                return (f"a replayed step differed from the eager one by {err:.2g} of the "
                        f"largest logit (tolerance {GRAPH_RTOL:g}); running eagerly")
            return ""
        except ColdWaitTimeout:
            raise
        except RuntimeError as e:  # capture refused an operation: run the same steps eagerly
            self.graphs = None
            first = (str(e).strip().splitlines() or [""])[0][:200]
            return f"capture failed ({type(e).__name__}: {first}); running eagerly"
        finally:
            self.timeline = timeline
            self.n_active.copy_(counts[0])
            for f, s, cold in zip(self.ffns, self.stages, counts[1]):
                if s is not None:
                    f.hybrid.cold.active_pairs = cold

    def settle(self) -> None:
        """Wait for the device's steps so far; raise ColdWaitTimeout if a wait gave up."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._check_waits()

    # ---- statistics -----------------------------------------------------------------------
    def flush_stats(self, steps: int) -> None:
        """Add what `steps` decode steps computed to each block's statistics: the hot side's
        active pairs (counted on the device) to its hot rows, n_ff pairs per token to the block.
        The cold side counted its own (wait_cold)."""
        for run in self.host_runs.values():  # the host layers that ran in C
            for i, n in zip(run.indices, run.n_active.tolist()):
                self.ffns[i].active_pairs += n
                self.ffns[i].total_pairs += steps * self.ffns[i].n_ff
            run.n_active.zero_()
        for ffn, n in zip(self.ffns, self.n_active.tolist()):  # (waits for the device)
            if ffn.hybrid is None:  # a host layer's block: counted above, or its own module
                continue
            if ffn.hybrid.hot is not None:
                ffn.hybrid.hot.active_pairs += n
            ffn.total_pairs += steps * ffn.n_ff
        self.reset_counts()
        self._check_waits()  # the device is done: a wait of the last step that gave up shows
