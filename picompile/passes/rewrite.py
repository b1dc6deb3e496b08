"""Rewrite: replace each matched FFN block in a graph with one `SparseFFN` call_module node.

The new module takes the block's weights in row-per-neuron layout (`down` transposed), so the
graph stays a plain, printable, re-traceable fx graph (with picompile's Tracer, which treats
SparseFFN as a leaf)."""

from __future__ import annotations

import torch
import torch.fx as fx

from picompile.passes.detect import Match
from picompile.plan import BlockPlan
from picompile.runtime.sparse_ffn import SparseFFN, dtype_name


def block_plan(gm: fx.GraphModule, match: Match, module_name: str, block_name: str) -> BlockPlan:
    up = gm.get_submodule(match.up.target)
    down = gm.get_submodule(match.down.target)
    linears = {"up": match.up.target, "down": match.down.target}
    if match.gate is not None:
        linears["gate"] = match.gate.target
    if match.fused_gate_half is not None:
        linears = {"gate_up": match.up.target, "down": match.down.target}
    return BlockPlan(
        name=block_name,
        module=module_name,
        kind=match.kind,
        act=match.act,
        d_model=down.out_features,
        d_ff=down.in_features,
        bias=up.bias is not None,
        dtype=dtype_name(up.weight.dtype),
        linears=linears,
        fused_gate_half=match.fused_gate_half,
    )


def weights_of(gm: fx.GraphModule, match: Match) -> dict[str, torch.Tensor | None]:
    """The block's tensors in SparseFFN's layout: every matrix [n_ff, d], one row per neuron."""
    up = gm.get_submodule(match.up.target)
    down = gm.get_submodule(match.down.target)
    w_up, b_up = up.weight, up.bias
    w_gate = b_gate = None
    if match.gate is not None:
        gate = gm.get_submodule(match.gate.target)
        w_gate, b_gate = gate.weight, gate.bias
    if match.fused_gate_half is not None:  # [2 n_ff, d] -> gate half, up half
        halves_w = up.weight.chunk(2, dim=0)
        halves_b = up.bias.chunk(2) if up.bias is not None else (None, None)
        g = match.fused_gate_half
        w_gate, w_up = halves_w[g], halves_w[1 - g]
        b_gate, b_up = halves_b[g], halves_b[1 - g]
    return dict(
        w_up=w_up.detach(),
        w_down_t=down.weight.detach().t().contiguous(),
        w_gate=None if w_gate is None else w_gate.detach(),
        b_gate=None if b_gate is None else b_gate.detach(),
        b_up=None if b_up is None else b_up.detach(),
        b_down=None if down.bias is None else down.bias.detach(),
    )


def rewrite(gm: fx.GraphModule, match: Match, block: BlockPlan, attr: str) -> SparseFFN:
    """Swap the matched nodes for `self.<attr>(x)`; returns the new SparseFFN."""
    ffn = SparseFFN(block, **weights_of(gm, match))
    gm.add_submodule(attr, ffn)
    graph = gm.graph
    with graph.inserting_before(match.down):
        node = graph.call_module(attr, (match.x,))
    match.down.replace_all_uses_with(node)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for old in sorted(match.nodes, key=order.__getitem__, reverse=True):
        graph.erase_node(old)
    return ffn


def finish(gm: fx.GraphModule) -> None:
    """Drop the replaced Linear modules from the graph module and regenerate its code."""
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
