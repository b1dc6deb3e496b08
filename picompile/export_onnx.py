"""ONNX export of the rewritten graphs, for inspection (Netron, onnx tooling).

    picompile.export_onnx(cm, "model.onnx")

What is in the file: every graph picompile captured and rewrote (`cm.graphs`: a Llama MLP, a
whole OPT decoder layer, ...), side by side in one ONNX graph, each with its own inputs and
outputs named `<module>/<name>`. Each FFN block is one node `SparseFFN` of the custom domain
`picompile` whose attributes say what compile decided (kind, activation, threshold, hot / cold
split, weight dtype and layout, mode, predictor) and whose inputs are the block's weights (and its
predictor's) as initializers. Everything else in those graphs is standard ONNX (opset 20).

What is not: the parts of the model picompile does not capture (embeddings, attention in Llama,
the LM head) are not in any graph, so not in the file. A module inside a captured graph that
torch.fx could not trace (OPT's attention) runs eagerly; it is one opaque node of the domain
`picompile.eager`, named by its class, with no computation inside. An op the exporter does not
map is a ValueError naming it.

The graphs' inputs and outputs get their dtypes and shapes from two short forward passes on dummy
token ids (batch 1 x 3 tokens, 2 x 5): a size that changes between them is symbolic ("batch",
"sequence"). An argument that was not a tensor in those calls (OPT's past_key_values, a cache
object) is not an input; the node that takes it names it in an attribute.

No ONNX runtime implements the `picompile` ops, so the file is for looking at, not for running.
We build the graph with onnx.helper from the fx graphs rather than torch.onnx.export: the
torch.export-based exporter needs onnxscript, the TorchScript one is deprecated, and neither sees
picompile's graphs (they trace the whole model again).
"""

from __future__ import annotations

import functools
import operator
import os
import pathlib
import shutil
import tempfile
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from picompile import quant
from picompile.capture import check_no_kwargs
from picompile.runtime.predictor import Predictor
from picompile.runtime.dense_linear import DenseLinear
from picompile.runtime.sparse_ffn import SparseFFN, down_format, dtype_name
from picompile.saving import protected

try:  # the `onnx` extra; `import picompile` works without it, export_onnx says what to install
    import onnx
    from onnx import TensorProto, helper
except ImportError:
    onnx = None

OPSET = 20  # Gelu is a standard op from 20 on
DOMAIN = "picompile"  # one SparseFFN node per FFN block
EAGER_DOMAIN = "picompile.eager"  # one opaque node per module kept eager inside a captured graph
PROTOBUF_LIMIT = 2_000_000_000  # bytes: a larger model keeps its weights in FILE.onnx.data
SAMPLE_INPUTS = ((1, 3), (2, 5))  # (batch, tokens) of the forward passes that record shapes
SYMBOLS = {(1, 2): "batch", (3, 5): "sequence", (3, 10): "tokens"}  # sizes in those passes

SPARSE_FFN_DOC = """\
picompile SparseFFN: an activation-sparse FFN block. For each token x and neuron j:
  gated: h = act(x . w_gate[j] + b_gate[j]) * (x . w_up[j] + b_up[j])  (drelu: relu of the up term)
  plain: h = act(x . w_up[j] + b_up[j])
  neuron j is computed only if |h| > threshold (0: exactly the nonzeros) and, with a predictor
  enabled, only if (relu(x p1^T + pb1) p2^T + pb2)[j] > predictor_tau for that token
  y = sum over computed j of h * w_down_t[j] + b_down
w_gate, w_up and w_down_t are [n_ff, d_model], one row per neuron (w_down_t is the down
projection's weight transposed); neurons 0 .. hot_neurons-1 are the hot ones (on the GPU)."""

_ELEM = {} if onnx is None else {
    torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16,
    torch.bfloat16: TensorProto.BFLOAT16, torch.float64: TensorProto.DOUBLE,
    torch.int64: TensorProto.INT64, torch.int32: TensorProto.INT32,
    torch.int8: TensorProto.INT8, torch.uint8: TensorProto.UINT8, torch.bool: TensorProto.BOOL}

_BINARY = {operator.add: "Add", torch.add: "Add", "add": "Add",
           operator.sub: "Sub", torch.sub: "Sub", "sub": "Sub",
           operator.mul: "Mul", torch.mul: "Mul", "mul": "Mul",
           operator.truediv: "Div", torch.div: "Div", "div": "Div",
           operator.pow: "Pow", torch.pow: "Pow", "pow": "Pow",
           operator.matmul: "MatMul", torch.matmul: "MatMul", "matmul": "MatMul"}
_UNARY = {F.relu: "Relu", torch.relu: "Relu", "relu": "Relu",
          torch.sigmoid: "Sigmoid", "sigmoid": "Sigmoid", torch.tanh: "Tanh", "tanh": "Tanh",
          operator.neg: "Neg", torch.neg: "Neg", "neg": "Neg", torch.exp: "Exp", "exp": "Exp",
          torch.sqrt: "Sqrt", "sqrt": "Sqrt", "contiguous": "Identity"}
_CASTS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}
_ACT_MODULES = {nn.ReLU: "Relu", nn.Sigmoid: "Sigmoid", nn.Tanh: "Tanh",
                nn.Dropout: "Identity", nn.Identity: "Identity"}


def _rounding(fmt: str) -> str:
    """How gate and up rows of `fmt` read x (quant.round_activations), for the ONNX metadata."""
    f = quant.format_of(fmt)
    return (f"; gate and up rows dotted with x rounded to {f.activation_bits} bits per block of 32 "
            f"(d = max|x| / {f.activation_levels}, round half to even)")


def require_onnx() -> None:
    if onnx is None:
        raise ImportError("picompile's ONNX export needs the onnx package: "
                          "pip install 'picompile[onnx]'")


def check_target(path) -> pathlib.Path:
    """The output path, refused before a long compile if it cannot be written as asked."""
    path = pathlib.Path(path)
    if path.suffix != ".onnx":
        raise ValueError(f"{path}: give a file name ending in .onnx, e.g. model.onnx")
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a directory; give a file name such as {path / 'model.onnx'}")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path}: the directory {path.parent} does not exist; create it "
                                "first or write the file elsewhere")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{path}: no write permission in {path.parent}")
    if protected(path):
        raise PermissionError(f"{path}: the file is read-only; picompile does not replace it: "
                              "make it writable (chmod u+w) or write elsewhere")
    return path


def export_onnx(cm, path, *, external_data: bool | None = None) -> pathlib.Path:
    """Write the compiled model's rewritten graphs to `path` (.onnx), atomically, after
    onnx.checker passes. external_data: weights in `path`.data next to it (default: only when
    they pass protobuf's 2 GB limit). Returns the path."""
    from picompile.compiled_model import CompiledModel

    require_onnx()
    path = check_target(path)
    if not isinstance(cm, CompiledModel):
        raise TypeError(f"export_onnx takes the CompiledModel that picompile.compile(model) "
                        f"returns, got {type(cm).__name__}; compile the model first")
    model = to_onnx(cm)
    if external_data is None:
        external_data = sum(len(t.raw_data) for t in model.graph.initializer) > PROTOBUF_LIMIT
    _write(model, path, external_data)
    return path


def to_onnx(cm) -> onnx.ModelProto:
    """The ONNX model of cm.graphs (see the module docstring), not yet checked or written."""
    builder = _Builder(cm)
    calls = _record_calls(cm)
    for module_name, gm in cm.graphs.items():
        if module_name not in calls:
            raise ValueError(f"picompile cannot export {module_name}: it did not run in a forward "
                             "pass of the model on token ids, so its shapes are unknown")
        _GraphExport(builder, module_name, gm, calls[module_name]).run()
    graph = helper.make_graph(builder.nodes, f"picompile {type(cm._orig_mod).__name__}",
                              builder.inputs, builder.outputs, builder.initializers,
                              doc_string="picompile's rewritten graphs, side by side, one per "
                                         "captured module")
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)]
    if any(n.domain == EAGER_DOMAIN for n in builder.nodes):
        opsets.append(helper.make_opsetid(EAGER_DOMAIN, 1))
    from picompile import __version__

    model = helper.make_model(graph, opset_imports=opsets, producer_name="picompile",
                              producer_version=__version__,
                              ir_version=helper.find_min_ir_version_for(opsets, ignore_unknown=True))
    model.doc_string = ("For inspection (e.g. Netron): no ONNX runtime implements the "
                        f"'{DOMAIN}' ops. " + SPARSE_FFN_DOC)
    helper.set_model_props(model, {"picompile.model_class": type(cm._orig_mod).__name__,
                                   "picompile.mode": cm.plan.mode,
                                   "picompile.blocks": str(len(cm.plan.blocks))})
    return model


def _write(model: onnx.ModelProto, path: pathlib.Path, external_data: bool) -> None:
    """Save into a temporary directory beside `path`, check the file written, then move it
    (and its .data file) into place: a failed export leaves no half-written file."""
    tmpdir = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        tmp, data = tmpdir / path.name, path.name + ".data"
        onnx.save_model(model, tmp, save_as_external_data=external_data,
                        all_tensors_to_one_file=True, location=data if external_data else None)
        onnx.checker.check_model(tmp)
        if external_data:
            os.replace(tmpdir / data, path.parent / data)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


@dataclass
class _Seen:
    """A tensor as the recording passes saw it: dtype, and its shape in each pass."""

    dtype: torch.dtype
    shapes: list[tuple[int, ...]]

    def type_proto(self, name: str) -> onnx.ValueInfoProto:
        dims = [a if a == b else SYMBOLS.get((a, b), f"{name}_dim{i}")
                for i, (a, b) in enumerate(zip(*self.shapes))]
        return helper.make_tensor_value_info(name, _ELEM[self.dtype], dims)


def _record_calls(cm) -> dict[str, tuple]:
    """Run the model on SAMPLE_INPUTS; per captured module, the (args, kwargs, output) of its
    first call in each pass, tensors as _Seen. The blocks' run statistics are kept as they were."""
    passes: list[dict[str, tuple]] = []  # per pass: module name -> its first call
    blocks = [f for ffn in cm.ffns().values()
              for f in (ffn, *([ffn.hybrid.hot, ffn.hybrid.cold] if ffn.hybrid else [])) if f is not None]
    stats = [(f.active_pairs, f.total_pairs) for f in blocks]
    try:
        for shape in SAMPLE_INPUTS:
            first: dict[str, tuple] = {}
            hooks = [gm.register_forward_hook(functools.partial(_keep_first, first, name), with_kwargs=True)
                     for name, gm in cm.graphs.items()]
            try:
                with torch.no_grad():
                    cm(torch.zeros(shape, dtype=torch.long))
            finally:
                for h in hooks:
                    h.remove()
            passes.append(first)
    except Exception as e:
        raise ValueError(f"picompile's ONNX export runs the model on token ids (a LongTensor "
                         f"[batch, tokens]) to record shapes, and {type(cm._orig_mod).__name__} failed "
                         f"on them: {type(e).__name__}: {e}") from e
    finally:
        for f, (active, total) in zip(blocks, stats):
            f.active_pairs, f.total_pairs = active, total
    return {name: _merge([p[name] for p in passes]) for name in cm.graphs
            if all(name in p for p in passes)}


def _keep_first(store: dict, name: str, module, args, kwargs, output) -> None:
    store.setdefault(name, (args, kwargs, output))


def _merge(values):
    """The same structure recorded in each pass -> one structure, tensors as _Seen."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        return _Seen(first.dtype, [tuple(v.shape) for v in values])
    if isinstance(first, (tuple, list)) and all(len(v) == len(first) for v in values):
        return [_merge([v[i] for v in values]) for i in range(len(first))]
    if isinstance(first, dict) and all(v.keys() == first.keys() for v in values):
        return {k: _merge([v[k] for v in values]) for k in first}
    return first


@dataclass
class _Tensor:
    name: str
    dtype: torch.dtype  # an eager module's outputs: assumed to be its first input's


@dataclass
class _Dims:
    """A torch.Size or part of one, as a 1-D int64 ONNX tensor (x.shape, x.size(-1))."""

    name: str


@dataclass
class _Outputs:
    """The tuple an eager module returns; getitem picks one."""

    items: list


class _Builder:
    """The ONNX graph under construction, shared by every exported fx graph."""

    def __init__(self, cm):
        self.cm = cm
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._by_id: dict[int, str] = {}  # id(tensor) -> its initializer's name
        self._names = {id(t): n for n, t in cm._orig_mod.named_parameters()}
        self._names.update({id(t): n for n, t in cm._orig_mod.named_buffers()})
        self._used: set[str] = set()

    def fresh(self, name: str) -> str:
        """`name`, or `name_2`, ...: unique in the graph."""
        out, i = name, 1
        while out in self._used:
            i += 1
            out = f"{name}_{i}"
        self._used.add(out)
        return out

    def weight(self, t: torch.Tensor | None, fallback: str, data: torch.Tensor | None = None) -> str:
        """The initializer holding `t` (added once, named as in the model's state_dict), or
        `data` in its place (t in another layout); "" for None, ONNX's "optional input left
        out"."""
        if t is None:
            return ""
        if id(t) not in self._by_id:
            name = self.fresh(self._names.get(id(t), fallback))
            self.initializers.append(_tensor_proto(t if data is None else data, name))
            self._by_id[id(t)] = name
        return self._by_id[id(t)]

    def constant(self, value, dtype: torch.dtype, name: str) -> str:
        name = self.fresh(name)
        self.initializers.append(_tensor_proto(torch.tensor(value, dtype=dtype), name))
        return name

    def node(self, op: str, inputs: list[str], name: str, n_out: int = 1, domain: str = "",
             doc: str = "", **attrs) -> list[str]:
        name = self.fresh(name)
        outs = [name] if n_out == 1 else [self.fresh(f"{name}.{i}") for i in range(n_out)]
        while inputs and inputs[-1] == "":  # trailing optional inputs left out
            inputs = inputs[:-1]
        self.nodes.append(helper.make_node(op, inputs, outs, name=name, domain=domain,
                                           doc_string=doc or None, **attrs))
        return outs


def _tensor_proto(t: torch.Tensor, name: str) -> onnx.TensorProto:
    t = t.detach().cpu().contiguous()
    if t.dtype not in _ELEM:
        raise ValueError(f"{name}: ONNX export does not handle tensors of dtype {t.dtype}")
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return helper.make_tensor(name, _ELEM[t.dtype], list(t.shape), raw, raw=True)


class _GraphExport:
    """One captured fx graph -> nodes of the builder, its values named `<module>/<fx name>`."""

    def __init__(self, builder: _Builder, module_name: str, gm: fx.GraphModule, call: tuple):
        self.b, self.module, self.gm = builder, module_name, gm
        self.prefix = f"{module_name}/" if module_name else ""
        self.env: dict[fx.Node, object] = {}
        floats = [p.dtype for p in gm.parameters() if p.is_floating_point()]
        self.dtype = floats[0] if floats else torch.float32  # hidden states: the weights' dtype
        args, kwargs, self.seen_output = call
        # what the recorded calls passed for each placeholder (by position, then by name)
        names = [str(n.target) for n in gm.graph.nodes
                 if n.op == "placeholder" and not str(n.target).startswith("*")]
        self.passed = {**dict(zip(names, args)), **kwargs}

    def run(self) -> None:
        for node in self.gm.graph.nodes:
            try:
                self.env[node] = self.convert(node)
            except _Unsupported as e:
                raise ValueError(
                    f"picompile cannot export {self.module or 'the model'} to ONNX: fx node "
                    f"{node.name!r} ({node.format_node()}) is {e}. The exporter maps the ops "
                    "found around FFN blocks in the supported models; compile another model, "
                    "or look at the graph with print(cm.graphs[name].code)") from None

    def value(self, arg):
        """An fx argument -> _Tensor / _Dims / _Outputs / Python value, recursively."""
        if isinstance(arg, fx.Node):
            return self.env[arg]
        if isinstance(arg, tuple):
            return tuple(self.value(a) for a in arg)
        if isinstance(arg, list):
            return [self.value(a) for a in arg]
        if isinstance(arg, dict):
            return {k: self.value(v) for k, v in arg.items()}
        return arg

    def name(self, node: fx.Node) -> str:
        return self.prefix + node.name

    def convert(self, node: fx.Node):
        if node.op == "placeholder":
            default = node.args[0] if node.args else None
            seen = self.passed.get(str(node.target), default)
            if not isinstance(seen, _Seen):  # None, a flag, a cache object: not a graph input
                return seen
            name = self.b.fresh(self.prefix + str(node.target))
            self.b.inputs.append(seen.type_proto(name))
            return _Tensor(name, seen.dtype)
        if node.op == "get_attr":
            t = operator.attrgetter(node.target)(self.gm)
            if not isinstance(t, torch.Tensor):
                raise _Unsupported(f"an attribute of type {type(t).__name__}, not a tensor")
            return _Tensor(self.b.weight(t, self.name(node)), t.dtype)
        if node.op == "call_module":
            return self.call_module(node, self.gm.get_submodule(node.target))
        if node.op == "call_function" and node.target is check_no_kwargs:
            return None  # picompile's guard on **kwargs: nothing to compute
        if node.op in ("call_function", "call_method"):
            return self.call(node, node.target, self.value(node.args), self.value(node.kwargs))
        if node.op == "output":
            return self.output(self.value(node.args[0]), self.seen_output)
        raise _Unsupported(f"an fx {node.op} node")

    # -- modules -------------------------------------------------------------------------------
    def call_module(self, node: fx.Node, module: nn.Module):
        args, kwargs = self.value(node.args), self.value(node.kwargs)
        name = self.name(node)
        if isinstance(module, SparseFFN):
            return self.sparse_ffn(node, module, args)
        if isinstance(module, Predictor):
            if any(u.op != "call_module" or u.target != node.target.rsplit(".", 1)[0]
                   for u in node.users):
                raise _Unsupported("a predictor whose mask is used outside its SparseFFN")
            return None  # folded into its block's SparseFFN node
        if not type(module).__module__.startswith("torch.nn") and not isinstance(module, DenseLinear):
            return self.eager(node, module, args, kwargs)
        x = self.tensor(args[0] if args else kwargs.get("input"), "its input")
        if isinstance(module, (nn.Linear, DenseLinear)):
            w = self.b.node("Transpose", [self.b.weight(module.weight, f"{name}.weight")],
                            f"{name}.weight_t", perm=[1, 0])[0]
            y = self.b.node("MatMul", [x.name, w], name if module.bias is None else f"{name}.matmul")[0]
            if module.bias is not None:
                y = self.b.node("Add", [y, self.b.weight(module.bias, f"{name}.bias")], name)[0]
            return _Tensor(y, x.dtype)
        if isinstance(module, nn.LayerNorm):
            d = module.normalized_shape
            scale = module.weight if module.weight is not None else torch.ones(d, dtype=self.dtype)
            return _Tensor(self.b.node(
                "LayerNormalization",
                [x.name, self.b.weight(scale, f"{name}.weight"), self.b.weight(module.bias, f"{name}.bias")],
                name, axis=-len(d), epsilon=float(module.eps))[0], x.dtype)
        if isinstance(module, nn.Embedding):
            return _Tensor(self.b.node("Gather", [self.b.weight(module.weight, f"{name}.weight"), x.name],
                                       name, axis=0)[0], module.weight.dtype)
        if isinstance(module, nn.SiLU):
            return self.silu(x, name)
        if isinstance(module, nn.GELU):
            return _Tensor(self.b.node("Gelu", [x.name], name, approximate=module.approximate)[0], x.dtype)
        if type(module) in _ACT_MODULES:
            return _Tensor(self.b.node(_ACT_MODULES[type(module)], [x.name], name)[0], x.dtype)
        raise _Unsupported(f"a {type(module).__name__} module, which the exporter does not map")

    def sparse_ffn(self, node: fx.Node, ffn: SparseFFN, args):
        """The block (and its predictor) as one `picompile.SparseFFN` node."""
        x = self.tensor(args[0], "the block's input")
        b, p, name = ffn.block, ffn.predictor, self.name(node)
        qual = f"{self.module}.{node.target}" if self.module else str(node.target)
        w = lambda attr, owner=ffn: self.b.weight(getattr(owner, attr), f"{qual}.{attr}")  # noqa: E731
        # gate and up rows in GGUF's layout (the kernels keep quantized ones in their dot layout)
        dotted = lambda attr: (w(attr) if ffn.qformat is None or getattr(ffn, attr) is None  # noqa: E731
                               else self.b.weight(getattr(ffn, attr), f"{qual}.{attr}",
                                                  ffn.row_blocks(attr)))
        inputs = [x.name, dotted("w_gate"), dotted("w_up"), w("w_down_t"), w("b_gate"), w("b_up"),
                  w("b_down")]
        attrs = dict(block=b.name, kind=b.kind, activation=b.act, bias=int(b.bias),
                     d_model=ffn.d_model, n_ff=ffn.n_ff, threshold=float(ffn.threshold),
                     mode=self.b.cm.plan.mode,
                     skips="exact zeros" if ffn.threshold == 0 and b.exact else
                           "none (dense)" if ffn.threshold == 0 else "below threshold",
                     hot_neurons=b.decided.hot_neurons, cold_neurons=ffn.n_ff - b.decided.hot_neurons,
                     neuron_order="hot first (permuted)" if ffn.order is not None else "original",
                     weight_dtype=ffn.qformat or dtype_name(ffn.w_up.dtype),
                     down_weight_dtype=(down_format(ffn.qformat, ffn.down_qformat, ffn.w_down_t)
                                        or dtype_name(ffn.w_down_t.dtype)),
                     weight_layout="w_gate, w_up, w_down_t: [n_ff, d_model], one row per neuron"
                                   + ("; quantized: uint8 GGUF blocks of 32 weights along d_model, "
                                      "each row its blocks one after another as GGUF stores "
                                      "them (picompile.quant.dequantize reads them)"
                                      if ffn.qformat else "")
                                   + (_rounding(ffn.qformat) if ffn.qformat else ""),
                     linears=", ".join(f"{k}={v}" for k, v in b.linears.items()),
                     path=self.b.cm.paths.get(b.name, ""))
        if b.measured.sparsity is not None:
            attrs["measured_sparsity"] = float(b.measured.sparsity)
        if p is not None:
            inputs += [w(k, p) for k in ("p1", "pb1", "p2", "pb2")]
            attrs.update(predictor_rank=p.rank, predictor_tau=float(p.tau),
                         predictor_enabled=int(p.enabled),
                         predictor_weight_format="float16 values in float32 tensors")
            if b.measured.predictor_recall is not None:
                attrs["predictor_recall"] = float(b.measured.predictor_recall)
        out = self.b.node("SparseFFN", inputs, name, domain=DOMAIN, doc=SPARSE_FFN_DOC, **attrs)
        return _Tensor(out[0], x.dtype)

    def eager(self, node: fx.Node, module: nn.Module, args, kwargs):
        """A module torch.fx could not trace, run eagerly: one opaque node, its tensor
        arguments as inputs, the others named in an attribute."""
        named = [(f"arg{i}", a) for i, a in enumerate(args)] + list(kwargs.items())
        tensors = [(k, v) for k, v in named if isinstance(v, _Tensor)]
        qual = f"{self.module}.{node.target}" if self.module else str(node.target)
        picks = {u.args[1] for u in node.users if u.target is operator.getitem}
        as_tuple = bool(node.users) and len(picks) == len(node.users) and all(isinstance(i, int) for i in picks)
        reason = next((u.reason for u in self.b.cm.plan.unmatched if u.module == qual), "")
        outs = self.b.node(
            type(module).__name__, [v.name for _, v in tensors], self.name(node),
            n_out=max(picks) + 1 if as_tuple else 1, domain=EAGER_DOMAIN,
            doc="Run eagerly by picompile (not traced): its computation is not in this file.",
            module=qual, module_class=f"{type(module).__module__}.{type(module).__qualname__}",
            arguments=", ".join(k for k, _ in tensors),
            not_exported=", ".join(f"{k}={_short(v)}" for k, v in named if not isinstance(v, _Tensor)),
            **({"reason": reason} if reason else {}))
        first = tensors[0][1].dtype if tensors else self.dtype
        if as_tuple:
            return _Outputs([_Tensor(o, first) for o in outs])
        return _Tensor(outs[0], first)

    # -- functions and methods -----------------------------------------------------------------
    def call(self, node: fx.Node, target, args, kwargs):
        name = self.name(node)
        op = getattr(target, "__name__", str(target))
        if target in _BINARY and not kwargs and len(args) == 2:
            return self.binary(_BINARY[target], args[0], args[1], name)
        if target in _UNARY and not kwargs and len(args) == 1:
            x = self.tensor(args[0], "its input")
            return _Tensor(self.b.node(_UNARY[target], [x.name], name)[0], x.dtype)
        if target is torch.rsqrt or target == "rsqrt":
            x = self.tensor(args[0], "its input")
            s = self.b.node("Sqrt", [x.name], f"{name}.sqrt")[0]
            return _Tensor(self.b.node("Reciprocal", [s], name)[0], x.dtype)
        if target in (F.silu, "silu"):
            return self.silu(self.tensor(args[0], "its input"), name)
        if target is F.gelu:
            x = self.tensor(args[0], "its input")
            return _Tensor(self.b.node("Gelu", [x.name], name,
                                       approximate=kwargs.get("approximate", "none"))[0], x.dtype)
        if target is F.dropout:
            if (args[2] if len(args) > 2 else kwargs.get("training", True)):
                raise _Unsupported("dropout in training mode (call model.eval() before compiling)")
            x = self.tensor(args[0], "its input")
            return _Tensor(self.b.node("Identity", [x.name], name)[0], x.dtype)
        if target is getattr:
            if args[1] != "shape":
                raise _Unsupported(f"getattr(..., {args[1]!r}): only .shape is exported")
            return _Dims(self.b.node("Shape", [self.tensor(args[0], "its input").name], name)[0])
        if target == "size":
            return self.size(self.tensor(args[0], "its input"), args[1] if len(args) > 1 else kwargs.get("dim"), name)
        if target is operator.getitem:
            return self.getitem(args[0], args[1], name)
        if target in ("reshape", "view"):
            shape = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list, _Dims)) else args[1:]
            x = self.tensor(args[0], "its input")
            return _Tensor(self.b.node("Reshape", [x.name, self.dims(shape, name)], name)[0], x.dtype)
        if target in ("to", "type", *_CASTS):
            return self.cast(target, args, kwargs, name)
        if target in (torch.mean, "mean"):
            x = self.tensor(args[0], "its input")
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if dim is None:
                raise _Unsupported("a mean over every dimension")
            axes = self.b.constant(list(dim) if isinstance(dim, (tuple, list)) else [dim],
                                   torch.int64, f"{name}.axes")
            keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
            return _Tensor(self.b.node("ReduceMean", [x.name, axes], name, keepdims=int(bool(keepdim)))[0],
                           x.dtype)
        if target is torch.cat:
            xs = [self.tensor(t, "a concatenated value") for t in args[0]]
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            return _Tensor(self.b.node("Concat", [t.name for t in xs], name, axis=dim)[0], xs[0].dtype)
        raise _Unsupported(f"`{op}`, which the exporter does not map")

    def tensor(self, v, what: str) -> _Tensor:
        if not isinstance(v, _Tensor):
            raise _Unsupported(f"given {type(v).__name__} {v!r} as {what}, where a tensor is expected")
        return v

    def binary(self, op: str, a, c, name: str) -> _Tensor:
        if not (isinstance(a, _Tensor) or isinstance(c, _Tensor)) or isinstance(a, _Dims) or isinstance(c, _Dims):
            raise _Unsupported(f"{op} of {type(a).__name__} and {type(c).__name__} (arithmetic on "
                               "sizes or Python values)")
        dtype = (a if isinstance(a, _Tensor) else c).dtype

        def operand(v):
            if isinstance(v, _Tensor):
                return v.name
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return self.b.constant(v, dtype, f"{name}.scalar")
            raise _Unsupported(f"{op} with a {type(v).__name__} operand")

        return _Tensor(self.b.node(op, [operand(a), operand(c)], name)[0], dtype)

    def silu(self, x: _Tensor, name: str) -> _Tensor:
        s = self.b.node("Sigmoid", [x.name], f"{name}.sigmoid")[0]
        return _Tensor(self.b.node("Mul", [x.name, s], name)[0], x.dtype)

    def size(self, x: _Tensor, dim, name: str) -> _Dims:
        if dim is None:
            return _Dims(self.b.node("Shape", [x.name], name)[0])
        bounds = dict(start=dim) if dim == -1 else dict(start=dim, end=dim + 1)
        return _Dims(self.b.node("Shape", [x.name], name, **bounds)[0])

    def getitem(self, v, index, name: str):
        if isinstance(v, _Outputs):
            return v.items[index]
        if isinstance(v, (tuple, list, dict)):
            return v[index]
        if isinstance(v, _Dims) and isinstance(index, (int, slice)) and not isinstance(index, bool):
            if isinstance(index, slice):
                if index.step not in (None, 1):
                    raise _Unsupported("a strided slice of a shape")
                start, stop = index.start or 0, index.stop
            else:  # shape[i] stays a 1-element shape, to be used in a reshape
                start, stop = index, None if index == -1 else index + 1
            starts = self.b.constant([start], torch.int64, f"{name}.starts")
            ends = self.b.constant([2**63 - 1 if stop is None else stop], torch.int64, f"{name}.ends")
            return _Dims(self.b.node("Slice", [v.name, starts, ends], name)[0])
        raise _Unsupported(f"indexing a {type(v).__name__} with {index!r}")

    def dims(self, shape, name: str) -> str:
        """A shape argument (ints, sizes from .size() / .shape, or a mix) as a 1-D int64 name."""
        if isinstance(shape, _Dims):
            return shape.name
        parts, ints = [], []
        for s in shape:
            if isinstance(s, int) and not isinstance(s, bool):
                ints.append(s)
                continue
            if not isinstance(s, _Dims):
                raise _Unsupported(f"a shape holding {type(s).__name__} {s!r}")
            if ints:
                parts.append(self.b.constant(ints, torch.int64, f"{name}.shape"))
                ints = []
            parts.append(s.name)
        if ints:
            parts.append(self.b.constant(ints, torch.int64, f"{name}.shape"))
        if len(parts) == 1:
            return parts[0]
        return self.b.node("Concat", parts, f"{name}.shape", axis=0)[0]

    def cast(self, target, args, kwargs, name: str) -> _Tensor:
        x = self.tensor(args[0], "its input")
        if target in _CASTS:
            dtype = _CASTS[target]
        else:
            dtype = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
            if dtype is None:  # .to(device) and the like: the values do not change
                if any(isinstance(a, _Tensor) for a in args[1:]):
                    raise _Unsupported(".to(another tensor)")
                return _Tensor(self.b.node("Identity", [x.name], name)[0], x.dtype)
        if dtype not in _ELEM:
            raise _Unsupported(f"a cast to {dtype}")
        return _Tensor(self.b.node("Cast", [x.name], name, to=_ELEM[dtype])[0], dtype)

    def output(self, result, seen) -> None:
        """Graph outputs: the tensors of the returned structure, typed as the recorded calls
        returned them."""
        flat = []

        def walk(v, s):
            if isinstance(v, _Outputs):
                v = v.items
            if isinstance(v, (tuple, list)) and isinstance(s, (tuple, list)):
                for item, s_item in zip(v, s):
                    walk(item, s_item)
            elif isinstance(v, dict) and isinstance(s, dict):
                for k in v:
                    walk(v[k], s.get(k))
            elif isinstance(v, _Tensor) and isinstance(s, _Seen):
                flat.append((v, s))

        walk(result, seen)
        if not flat:
            raise _Unsupported("an output with no tensor in it")
        for i, (t, s) in enumerate(flat):
            name = self.b.fresh(f"{self.prefix}output" + (f".{i}" if len(flat) > 1 else ""))
            self.b.nodes.append(helper.make_node("Identity", [t.name], [name], name=name))
            self.b.outputs.append(s.type_proto(name))


def _short(v) -> str:
    """A non-tensor argument, for an attribute: its value if simple, else its type."""
    return repr(v) if v is None or isinstance(v, (bool, int, float, str)) else type(v).__name__


class _Unsupported(Exception):
    """What about an fx node the exporter cannot map (made into a ValueError naming the node)."""
