"""Detect: find FFN blocks in an fx graph by subgraph matching (networkx).

The fx graph becomes a networkx DiGraph (producer -> consumer) whose nodes carry a label: a
`linear`, an activation `act:<name>`, `mul`, `chunk`, `getitem` or `other`. Each block shape is a
small pattern DiGraph; `DiGraphMatcher.subgraph_monomorphisms_iter` finds its occurrences, and
checks on the match (shared input, shapes, no outside users of intermediates) keep only those that
can be rewritten without changing what the graph computes.

    plain  down(act(up(x)))
    gated  down(act(gate(x)) * up(x))
    drelu  down(relu(gate(x)) * relu(up(x)))
    fused  down(act(a) * b)   with a, b = gate_up(x).chunk(2, dim=-1)
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import networkx as nx
import torch
import torch.fx as fx
import torch.nn.functional as F
from networkx.algorithms.isomorphism import DiGraphMatcher
from torch import nn

from picompile.activations import ACTIVATIONS, module_activation

RELU_FUNCS = {F.relu, torch.relu, torch.nn.functional.relu}
SILU_FUNCS = {F.silu, torch.nn.functional.silu}
GELU_FUNCS = {F.gelu, torch._C._nn.gelu}
MUL_FUNCS = {operator.mul, torch.mul}


@dataclass
class Match:
    """One FFN block found in a graph."""

    kind: str  # "plain" | "gated" | "drelu"
    act: str  # "relu" | "silu" | "gelu" | "gelu_tanh" | "relu2"
    x: fx.Node  # the block input
    down: fx.Node  # its output node
    up: fx.Node  # call_module linear (or the fused gate_up linear)
    gate: fx.Node | None = None
    fused_gate_half: int | None = None  # fused gate_up: which chunk (0/1) is the gate
    nodes: list[fx.Node] = field(default_factory=list)  # every node the block replaces


def _module(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    if node.op == "call_module":
        return gm.get_submodule(node.target)
    return None


def activation_of(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """The activation a node applies, by our names, or None if it is not one we know."""
    mod = _module(gm, node)
    if mod is not None:
        if isinstance(mod, nn.ReLU):
            return "relu"
        if isinstance(mod, nn.SiLU):
            return "silu"
        if isinstance(mod, nn.GELU):
            return "gelu_tanh" if mod.approximate == "tanh" else "gelu"
        return module_activation(mod)
    if node.op == "call_function":
        if node.target in RELU_FUNCS:
            return "relu"
        if node.target in SILU_FUNCS:
            return "silu"
        if node.target in GELU_FUNCS:
            return "gelu_tanh" if node.kwargs.get("approximate", "none") == "tanh" else "gelu"
    if node.op == "call_method" and node.target in ("relu", "relu_"):
        return "relu"
    if _squared_relu(gm, node) is not None:
        return "relu2"
    return None


def _squared_relu(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """The ReLU node that `node` squares (relu(v) ** 2, relu(v).pow(2), torch.square(relu(v)),
    r * r for r = relu(v)) when that ReLU feeds nothing else: the two are one squared ReLU."""
    args = node.args
    if node.op == "call_function" and node.target is torch.square or (
            node.op == "call_method" and node.target == "square"):
        arg = args[0] if len(args) == 1 else None
    elif node.op == "call_function" and node.target in (operator.pow, torch.pow) or (
            node.op == "call_method" and node.target == "pow"):
        arg = args[0] if len(args) == 2 and args[1] == 2 else None
    elif _is_mul(node):
        arg = args[0] if len(args) == 2 and args[0] is args[1] else None
    else:
        return None
    if (isinstance(arg, fx.Node) and not node.kwargs and len(arg.users) == 1
            and activation_of(gm, arg) == "relu"):
        return arg
    return None


def _is_mul(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in MUL_FUNCS) or (
        node.op == "call_method" and node.target == "mul")


def label(gm: fx.GraphModule, node: fx.Node) -> str:
    if isinstance(_module(gm, node), nn.Linear):
        return "linear"
    act = activation_of(gm, node)
    if act is not None:
        return f"act:{act}"
    if _is_mul(node):
        return "mul"
    if node.op in ("call_method", "call_function") and node.target in ("chunk", torch.chunk):
        return "chunk"
    if node.op == "call_function" and node.target is operator.getitem:
        return "getitem"
    return "other"


def graph_to_nx(gm: fx.GraphModule) -> nx.DiGraph:
    """The graph as networkx sees it; a ReLU squared in a second node becomes one `act:relu2`
    node (the ReLU in its `folded` list, which a match replaces with it)."""
    g = nx.DiGraph()
    squares = {n: r for n in gm.graph.nodes if (r := _squared_relu(gm, n)) is not None}
    folded = set(squares.values())
    for node in gm.graph.nodes:
        if node in folded:
            continue
        relu = squares.get(node)
        g.add_node(node, label=label(gm, node), folded=[relu] if relu is not None else [])
        for inp in (relu or node).all_input_nodes:
            g.add_edge(inp, node)
    return g


def _pattern(edges: list[tuple[str, str]], labels: dict[str, str]) -> nx.DiGraph:
    p = nx.DiGraph()
    for name, lab in labels.items():
        p.add_node(name, label=lab)
    p.add_edges_from(edges)
    return p


PATTERNS: dict[str, nx.DiGraph] = {
    "drelu": _pattern(
        [("gate", "act"), ("up", "act2"), ("act", "mul"), ("act2", "mul"), ("mul", "down")],
        dict(gate="linear", up="linear", act="act:relu", act2="act:relu", mul="mul", down="linear"),
    ),
    "fused": _pattern(
        [("up", "chunk"), ("chunk", "ga"), ("chunk", "gb"), ("ga", "act"), ("act", "mul"),
         ("gb", "mul"), ("mul", "down")],
        dict(up="linear", chunk="chunk", ga="getitem", gb="getitem", act="act", mul="mul",
             down="linear"),
    ),
    "gated": _pattern(
        [("gate", "act"), ("act", "mul"), ("up", "mul"), ("mul", "down")],
        dict(gate="linear", act="act", up="linear", mul="mul", down="linear"),
    ),
    "plain": _pattern(
        [("up", "act"), ("act", "down")], dict(up="linear", act="act", down="linear")
    ),
}


def _label_match(graph_attrs: dict, pattern_attrs: dict) -> bool:
    g, p = graph_attrs["label"], pattern_attrs["label"]
    return g == p or (p == "act" and g.startswith("act:"))


# nn.Linear subclasses known to compute exactly x @ W.T + b with W stored as usual.
AFFINE_LINEAR_SUBCLASSES = {"FalconLinear"}


def plain_affine(mod: nn.Module) -> bool:
    """True for layers whose weight means what nn.Linear's does (not quantized or LoRA ones)."""
    return type(mod).forward is nn.Linear.forward or type(mod).__name__ in AFFINE_LINEAR_SUBCLASSES


def _input(node: fx.Node) -> fx.Node | None:
    return node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None


def _check(gm: fx.GraphModule, kind: str, m: dict[str, fx.Node],
           folded: list[fx.Node]) -> tuple[Match | None, str]:
    """Build a Match from a pattern occurrence, or say why it cannot be rewritten. folded: the
    graph nodes the occurrence's nodes stand for besides themselves (a squared ReLU's ReLU)."""
    up, down = m["up"], m["down"]
    act_name = label(gm, m["act"]).removeprefix("act:")
    x = _input(up)
    if x is None:
        return None, "the up projection's input is not a graph value"
    for node in (m["act"], m["mul"]) if "mul" in m else (m["act"],):
        if _input(node) is None:
            return None, f"{node.name} has an unexpected form"
    gate, half = m.get("gate"), None
    if kind == "fused":
        chunk, ga, gb = m["chunk"], m["ga"], m["gb"]
        n_chunks = chunk.args[1] if len(chunk.args) > 1 else chunk.kwargs.get("chunks")
        dim = chunk.args[2] if len(chunk.args) > 2 else chunk.kwargs.get("dim", 0)
        if n_chunks != 2 or dim != -1:
            return None, f"fused projection split by chunk({n_chunks}, dim={dim}), not chunk(2, dim=-1)"
        if not (isinstance(ga.args[1], int) and isinstance(gb.args[1], int)) or ga.args[1] == gb.args[1]:
            return None, "fused projection halves are not taken as [0] and [1]"
        half = ga.args[1]
        kind = "gated"
    if gate is not None and _input(gate) is not x:
        return None, "gate and up projections read different inputs"
    mul = m.get("mul")
    if mul is not None and (len(mul.args) != 2 or mul.kwargs):
        return None, "the product has more than two operands"
    up_mod, down_mod = gm.get_submodule(up.target), gm.get_submodule(down.target)
    for node in (up, down, gate):
        if node is not None and not plain_affine(gm.get_submodule(node.target)):
            return None, f"{node.target} is a {type(gm.get_submodule(node.target)).__name__}, not a plain linear layer"
    n_ff = up_mod.out_features // (2 if half is not None else 1)
    if down_mod.in_features != n_ff or down_mod.out_features != up_mod.in_features:
        return None, (f"projection shapes do not chain: up {up_mod.in_features}->{up_mod.out_features}, "
                      f"down {down_mod.in_features}->{down_mod.out_features}")
    if gate is not None:
        g_mod = gm.get_submodule(gate.target)
        if g_mod.weight.shape != up_mod.weight.shape:
            return None, "gate and up projections differ in shape"
        if (g_mod.bias is None) != (up_mod.bias is None):
            return None, "only one of gate and up has a bias"
    inner = [n for k, n in m.items() if k != "down"] + folded
    for node in inner:
        outside = [u for u in node.users if u not in inner and u is not down]
        if outside:
            return None, f"{node.name} is also used outside the FFN (by {outside[0].name})"
    match = Match(kind=kind, act=act_name, x=x, down=down, up=up, gate=gate,
                  fused_gate_half=half, nodes=list(m.values()) + folded)
    return match, ""


@dataclass
class Detection:
    matches: list[Match]
    rejected: list[str]  # why pattern occurrences were left dense


def detect(gm: fx.GraphModule) -> Detection:
    """All FFN blocks in one captured graph; each node belongs to at most one block."""
    g = graph_to_nx(gm)
    taken: set[fx.Node] = set()
    near: set[fx.Node] = set()  # the nodes of occurrences left dense, with their reasons
    matches, rejected = [], []
    for kind, pattern in PATTERNS.items():
        matcher = DiGraphMatcher(g, pattern, node_match=_label_match)
        for mapping in matcher.subgraph_monomorphisms_iter():
            m = {p: gnode for gnode, p in mapping.items()}  # pattern name -> fx node
            if taken & set(m.values()):
                continue
            match, why = _check(gm, kind, m, [f for n in m.values() for f in g.nodes[n]["folded"]])
            if match is None:
                rejected.append(f"{m['down'].name}: {why}")
                near |= set(m.values())
                continue
            matches.append(match)
            taken |= set(match.nodes)
    rejected += _unsupported_activations(gm, g, taken)
    rejected += _activations_in_other_forms(gm, g, taken | near)
    return Detection(matches, sorted(set(rejected)))


def _activations_in_other_forms(gm: fx.GraphModule, g: nx.DiGraph, seen_to: set[fx.Node],
                                hops: int = 8) -> list[str]:
    """A known activation between linear layers but in no pattern (a norm, a scale or a third
    operand in between: BitNet's sub-norm, Falcon-H1's multipliers): name the path from the
    nearest linear before it to the nearest one after, so the reason is not left unsaid.
    seen_to: nodes matched, or rejected with a reason already."""
    def nearest_linear(start, step) -> list[fx.Node] | None:
        paths, seen = [[start]], {start}
        for _ in range(hops):
            grown = []
            for path in paths:
                for nxt in step(path[-1]):
                    if nxt in seen:
                        continue
                    if g.nodes[nxt]["label"] == "linear":
                        return path + [nxt]
                    seen.add(nxt)
                    grown.append(path + [nxt])
            paths = grown
        return None

    out = []
    for node in g.nodes:
        if node in seen_to or not g.nodes[node]["label"].startswith("act:"):
            continue
        before = nearest_linear(node, g.predecessors)
        after = nearest_linear(node, g.successors)
        if before is None or after is None:
            continue
        path = " -> ".join(str(n.target if n.op == "call_module" else n.name)
                           for n in before[::-1] + after[1:])
        act = g.nodes[node]["label"].removeprefix("act:")
        out.append(f"{node.name}: the {act} activation is in {path}, not in a supported form")
    return out


def _unsupported_activations(gm: fx.GraphModule, g: nx.DiGraph, taken: set[fx.Node]) -> list[str]:
    """linear -> f -> linear with an f we do not know: say so instead of staying silent."""
    out = []
    for node in g.nodes:
        if node in taken or g.nodes[node]["label"] != "other" or node.op == "placeholder":
            continue
        preds = list(g.predecessors(node))
        succs = list(g.successors(node))
        if (len(preds) == 1 and g.nodes[preds[0]]["label"] == "linear" and preds[0] not in taken
                and any(g.nodes[s]["label"] == "linear" and s not in taken for s in succs)):
            what = node.target if node.op != "call_module" else type(gm.get_submodule(node.target)).__name__
            out.append(f"{node.name}: activation {getattr(what, '__name__', what)} is not supported "
                       f"(supported: {', '.join(ACTIVATIONS)})")
    return out
