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
    freq: torch.Tensor  # [n_ff] float32 on the CPU: share of tokens on which each neuron fired
    x: torch.Tensor  # [N, d] float16: block inputs, on the device they were recorded on
    y: torch.Tensor  # [N, n_ff] bool: which neurons fired for that input, same device as x
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
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, BlockProfile]:
    """Per block, its BlockProfile. device, dtype: as run_calibration's (None: the whole model
    where it is; else layer by layer on that device).

    Counters and samples live on the device the activations are on (no copy to the host per
    call). freq comes back on the CPU; the samples stay where they were recorded, so that a
    GPU that profiled also trains the predictors on them (passes/predictors.py trains on the
    samples' device), at most `memory_bytes` of them."""
    total = ids.numel()
    keep_n = samples_per_block(ffns, total, memory_bytes)
    keep_p = keep_n / total
    gen = torch.Generator().manual_seed(seed)  # on the CPU: the same draws whatever the device
    counts: dict[str, torch.Tensor] = {}  # [n_ff] int64 on the activations' device
    xs: dict[str, list] = {n: [] for n in ffns}
    ys: dict[str, list] = {n: [] for n in ffns}
    seen = {n: 0 for n in ffns}
    calls = {n: 0 for n in ffns}
    # One token subset per forward call, shared by blocks: the block's i-th call with T tokens
    # takes picks[(i, T)], drawn by the first block to need it. Whole-model and layer-by-layer
    # runs call blocks in different orders but draw the same subsets.
    picks: dict[tuple[int, int], torch.Tensor] = {}  # -> [n_kept] token indices, CPU

    def hook(name):
        def record(ffn: SparseFFN, args, _out):
            x = args[0].reshape(-1, ffn.d_model)  # [T, d]
            h = down_input(x, ffn.w_up, w_gate=ffn.w_gate, b_gate=ffn.b_gate, b_up=ffn.b_up,
                           act=ffn.act, drelu=ffn.drelu, qformat=ffn.qformat)
            active = h.abs() > ffn.threshold  # [T, n_ff]
            if name not in counts:
                counts[name] = torch.zeros(ffn.n_ff, dtype=torch.int64, device=active.device)
            counts[name] += active.sum(0).to(counts[name].device)
            seen[name] += x.shape[0]
            key = (calls[name], x.shape[0])
            calls[name] += 1
            if key not in picks:
                picks[key] = (torch.rand(key[1], generator=gen) < keep_p).nonzero().flatten()
            sel = picks[key].to(x.device)
            xs[name].append(x[sel].to(torch.float16))
            ys[name].append(active[sel])
        return record

    run_calibration(model, ids, quiet=quiet, desc="profiling neurons", device=device, dtype=dtype,
                    hooks=[(f, hook(n)) for n, f in ffns.items()], all_logits=False)
    return {
        n: BlockProfile(
            freq=(counts[n].double() / max(seen[n], 1)).float().cpu(),
            x=torch.cat(xs[n])[:keep_n],
            y=torch.cat(ys[n])[:keep_n],
            tokens=seen[n],
        )
        for n in ffns
    }
