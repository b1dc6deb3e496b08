"""Passes over the exported step graphs (capture_whole.py): aten-level rewrites of what tracing
made slower than the eager model.

`gqa_attention(gm)`: grouped-query attention. Traced, transformers repeats each KV head for its
query heads before scaled_dot_product_attention (`repeat_kv`: unsqueeze -> expand -> reshape,
a copy of the whole static cache per layer and step); eager decode avoids the copy by another
path that tracing cannot take. The pass gives SDPA the cache itself with `enable_gqa=True`,
which computes the same attention without the copy.
"""

from __future__ import annotations

import torch
import torch.fx as fx

_aten = torch.ops.aten
_SDPA = _aten.scaled_dot_product_attention.default


def _repeated_kv(node) -> fx.Node | None:
    """The [B, KV, L, D] tensor that `node` repeats per query head, where node is
    reshape(expand(unsqueeze(kv, 2), [B, KV, R, L, D]), [B, KV * R, L, D]); else None."""
    if not (isinstance(node, fx.Node) and node.target == _aten.reshape.default):
        return None
    expand = node.args[0]
    if not (isinstance(expand, fx.Node) and expand.target == _aten.expand.default):
        return None
    unsqueeze = expand.args[0]
    if not (isinstance(unsqueeze, fx.Node) and unsqueeze.target == _aten.unsqueeze.default
            and unsqueeze.args[1] == 2):
        return None
    kv = unsqueeze.args[0]
    kv_val, out_val = kv.meta.get("val"), node.meta.get("val")  # fake tensors from export
    if kv_val is None or out_val is None or kv_val.dim() != 4 or out_val.dim() != 4:
        return None
    b, heads, length, d = out_val.shape
    if (kv_val.shape[0], kv_val.shape[2], kv_val.shape[3]) != (b, length, d) \
            or heads % kv_val.shape[1]:
        return None
    return kv


def gqa_attention(gm: fx.GraphModule) -> int:
    """Rewrite every SDPA whose key and value are repeated KV heads to take the KV heads with
    enable_gqa=True (in place); returns how many were rewritten."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != _SDPA or len(node.args) < 3:
            continue
        if node.kwargs.get("enable_gqa", False):
            continue
        key, value = _repeated_kv(node.args[1]), _repeated_kv(node.args[2])
        if key is None or value is None:
            continue
        node.args = (node.args[0], key, value, *node.args[3:])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        rewritten += 1
    if rewritten:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return rewritten
