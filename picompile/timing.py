"""Decode speed, measured the same way everywhere (CLI, benchmarks): greedy generate, clock
started when the first new token arrives, so prefill is not counted."""

from __future__ import annotations

import math
import time

import torch


class FirstTokenClock:
    """A generate() streamer that notes when the first new token comes and forwards to another."""

    def __init__(self, inner=None):
        self.inner, self.first, self.calls = inner, None, 0

    def put(self, value):
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt, the second the first new token
            self.first = time.perf_counter()
        if self.inner is not None:
            self.inner.put(value)

    def end(self):
        if self.inner is not None:
            self.inner.end()


@torch.no_grad()
def timed_generate(model, ids: torch.Tensor, new_tokens: int, streamer=None,
                   exact_length: bool = False, **generate_kwargs) -> tuple[torch.Tensor, float]:
    """Greedy decode (unless generate_kwargs, passed on, say otherwise) -> (new tokens [n],
    decode tokens/s over the tokens after the first; NaN when fewer than two came: no decode
    step to time)."""
    clock = FirstTokenClock(streamer)
    kw = dict(do_sample=False)
    if exact_length:
        kw["min_new_tokens"] = new_tokens
    kw.update(generate_kwargs)
    out = model.generate(ids, max_new_tokens=new_tokens, streamer=clock, **kw)
    end = time.perf_counter()
    new = out[0, ids.shape[1]:].cpu()
    start = clock.first if clock.first is not None else end
    if len(new) < 2:
        return new, math.nan
    return new, (len(new) - 1) / max(end - start, 1e-9)
