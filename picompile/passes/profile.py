"""Profile: run calibration tokens through the model and record, per block, how often each
neuron fires and (block input, active mask) samples to train its predictor on.

"Fires" means what the runtime computes: |h| > threshold, h the down projection's input (for
ReLU blocks threshold 0, so exactly the nonzeros). Samples are kept within a memory bound:
inputs as float16, masks as bool, at most `max_samples` tokens per block, drawn uniformly from
all calibration tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from picompile.passes.calibrate import run_calibration
from picompile.runtime.sparse_ffn import SparseFFN, down_input

DEFAULT_SAMPLE_BYTES = 2 * 10**9  # all blocks' samples together stay under this


@dataclass
class BlockProfile:
    freq: torch.Tensor  # [n_ff] float32: share of tokens on which each neuron fired
    x: torch.Tensor  # [N, d] float16: block inputs
    y: torch.Tensor  # [N, n_ff] bool: which neurons fired for that input
    tokens: int  # calibration tokens seen

    @property
    def density(self) -> float:
        """Share of (token, neuron) pairs that fired."""
        return float(self.freq.mean())


def samples_per_block(ffns: dict[str, SparseFFN], total_tokens: int, memory_bytes: int) -> int:
    per_token = sum(2 * f.d_model + f.n_ff for f in ffns.values())  # fp16 x + bool mask
    return max(1, min(total_tokens, memory_bytes // max(per_token, 1)))


@torch.no_grad()
def profile(
    model: nn.Module,
    ffns: dict[str, SparseFFN],
    ids: torch.Tensor,  # [batch, seq] calibration token ids
    memory_bytes: int = DEFAULT_SAMPLE_BYTES,
    quiet: bool = False,
    seed: int = 0,
) -> dict[str, BlockProfile]:
    total = ids.numel()
    keep_n = samples_per_block(ffns, total, memory_bytes)
    keep_p = keep_n / total
    gen = torch.Generator().manual_seed(seed)
    counts = {n: torch.zeros(f.n_ff, dtype=torch.float64) for n, f in ffns.items()}
    xs: dict[str, list] = {n: [] for n in ffns}
    ys: dict[str, list] = {n: [] for n in ffns}
    seen = {n: 0 for n in ffns}
    order = list(ffns)
    picks: dict[int, torch.Tensor] = {}  # one token subset per forward call, shared by blocks

    def hook(name):
        def record(ffn: SparseFFN, args, _out):
            x = args[0].reshape(-1, ffn.d_model)  # [T, d]
            h = down_input(x, ffn.w_up, w_gate=ffn.w_gate, b_gate=ffn.b_gate, b_up=ffn.b_up,
                           act=ffn.act, drelu=ffn.drelu)
            active = h.abs() > ffn.threshold  # [T, n_ff]
            counts[name] += active.sum(0, dtype=torch.float64)
            seen[name] += x.shape[0]
            key = x.shape[0]
            if name == order[0] or key not in picks:
                picks[key] = (torch.rand(key, generator=gen) < keep_p).nonzero().flatten()
            sel = picks[key]
            xs[name].append(x[sel].to(torch.float16))
            ys[name].append(active[sel])
        return record

    handles = [f.register_forward_hook(hook(n)) for n, f in ffns.items()]
    try:
        run_calibration(model, ids, quiet=quiet, desc="profiling neurons")
    finally:
        for h in handles:
            h.remove()
    return {
        n: BlockProfile(
            freq=(counts[n] / max(seen[n], 1)).float(),
            x=torch.cat(xs[n])[:keep_n],
            y=torch.cat(ys[n])[:keep_n],
            tokens=seen[n],
        )
        for n in ffns
    }
