"""Quality measures shared by tests and benchmarks."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, batch: int = 4) -> float:
    """exp(mean next-token cross-entropy) over rows of ids [rows, seq], each row on its own."""
    total, count = 0.0, 0
    for i in range(0, ids.shape[0], batch):
        x = ids[i : i + batch]
        logits = model(x, use_cache=False).logits[:, :-1].float()
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       x[:, 1:].reshape(-1).to(logits.device), reduction="sum"))
        count += x[:, 1:].numel()
    return math.exp(total / count)
