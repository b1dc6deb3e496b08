"""Calibrate: run calibration tokens through the model, measure each block's activity, and set
the per-block threshold of SiLU/GELU blocks for a target sparsity.

The criterion is the magnitude of the down projection's input, |act(gate x) * up x|, not the
gate's |act(gate x)| as CATS uses. Measured on SmolLM2-135M over English text (see
BENCHMARKS.md): at 50% sparsity the gate criterion raised perplexity by 39%, the down-input
criterion by 3%. It needs gate and up densely, so in exact mode it saves only the `down` rows;
predictors (mode="predicted") then skip gate and up too."""

from __future__ import annotations

import torch
from torch import nn

from picompile.progress import progress_bar
from picompile.runtime.sparse_ffn import SparseFFN, down_input

# |h| samples kept per block per forward call; the quantile is taken over all of them.
SAMPLES_PER_CALL = 1 << 16


def calibration_ids(calibration, tokenizer, seq_len: int = 256) -> torch.Tensor:
    """calibration: LongTensor [batch, seq] (or [seq]) of ids, or str / list of str with a
    tokenizer. Returns LongTensor [batch, seq]."""
    if isinstance(calibration, torch.Tensor):
        if calibration.dtype not in (torch.int64, torch.int32) or calibration.dim() not in (1, 2):
            raise ValueError(
                "calibration must be token ids: a LongTensor [batch, seq] or [seq], "
                f"got {calibration.dtype} with shape {tuple(calibration.shape)}"
            )
        ids = calibration.long()
        return ids[None] if ids.dim() == 1 else ids
    if isinstance(calibration, str):
        calibration = [calibration]
    if isinstance(calibration, (list, tuple)) and all(isinstance(t, str) for t in calibration):
        if tokenizer is None:
            raise ValueError("calibration was given as text: also pass tokenizer= to turn it into ids")
        ids = tokenizer("\n\n".join(calibration), return_tensors="pt")["input_ids"][0]
        rows = max(1, ids.numel() // seq_len)
        return ids[: rows * seq_len].reshape(rows, -1) if ids.numel() >= seq_len else ids[None]
    raise ValueError(
        "calibration must be a LongTensor of token ids or a list of strings (with tokenizer=), "
        f"got {type(calibration).__name__}"
    )


@torch.no_grad()
def run_calibration(model: nn.Module, ids: torch.Tensor, batch_size: int = 4, quiet: bool = False,
                    desc: str = "calibrating") -> None:
    """Feed calibration rows through the model (no KV cache), `batch_size` rows at a time."""
    device = next(model.parameters()).device
    for start in progress_bar(range(0, ids.shape[0], batch_size), desc=desc, quiet=quiet):
        batch = ids[start : start + batch_size].to(device)
        try:
            model(batch, use_cache=False)
        except TypeError:  # plain nn.Module models take only the ids
            model(batch)


@torch.no_grad()
def calibrate(
    model: nn.Module,
    ffns: dict[str, SparseFFN],
    ids: torch.Tensor,
    sparsity: float | None,
    quiet: bool = False,
) -> None:
    """Set block.measured_sparsity for every block and, when a sparsity is asked for, the
    threshold of every non-ReLU block (ReLU blocks stay exact)."""
    samples: dict[str, list[torch.Tensor]] = {name: [] for name in ffns}
    gen = torch.Generator().manual_seed(0)

    def hook(name):
        def record(ffn: SparseFFN, args, _out):
            x = args[0].reshape(-1, ffn.d_model)
            h = down_input(x, ffn.w_up, w_gate=ffn.w_gate, b_gate=ffn.b_gate, b_up=ffn.b_up,
                           act=ffn.act, drelu=ffn.drelu).abs().flatten()
            if h.numel() > SAMPLES_PER_CALL:
                h = h[torch.randint(h.numel(), (SAMPLES_PER_CALL,), generator=gen)]
            samples[name].append(h)
        return record

    handles = [ffn.register_forward_hook(hook(name)) for name, ffn in ffns.items()]
    try:
        run_calibration(model, ids, quiet=quiet)
    finally:
        for h in handles:
            h.remove()

    for name, ffn in ffns.items():
        h = torch.cat(samples[name])  # [n] |down input| samples
        block = ffn.block
        if sparsity and not block.exact:
            k = max(1, int(round(sparsity * h.numel())))
            block.threshold = float(h.kthvalue(k).values)
        ffn.threshold = block.threshold
        block.measured_sparsity = float((h <= block.threshold).float().mean())
