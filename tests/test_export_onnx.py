"""ONNX export of the rewritten graphs (issue 11, part 2): read back, one `picompile.SparseFFN`
node per block with the plan's attributes, standard ONNX for the rest, onnx.checker passes, and
the file computes what the graphs compute (onnx's reference evaluator, the custom ops written
here in numpy from their documented math)."""

from __future__ import annotations

import copy
import pathlib
import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from torch import nn

import picompile
from picompile import cli, models, quant
from picompile.export_onnx import DOMAIN, EAGER_DOMAIN
from picompile.runtime.dense_linear import float_weight
from tests import zoo

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "relu_llama"
STANDARD = ("", "ai.onnx")


def _act(name: str, v: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(v)
    return {"relu": F.relu, "silu": F.silu, "gelu": F.gelu,
            "gelu_tanh": lambda z: F.gelu(z, approximate="tanh")}[name](t).numpy()


class SparseFFN(OpRun):
    """The SparseFFN node's documented math, from its inputs and attributes only."""

    op_domain = DOMAIN

    def _run(self, x, w_gate=None, w_up=None, w_down_t=None, b_gate=None, b_up=None, b_down=None,
             p1=None, pb1=None, p2=None, pb2=None, **attrs):
        x2 = x.reshape(-1, self.d_model).astype(np.float32)
        up = x2 @ w_up.T + (0 if b_up is None else b_up)
        if self.kind == "plain":
            h = _act(self.activation, up)
        else:
            gate = _act(self.activation, x2 @ w_gate.T + (0 if b_gate is None else b_gate))
            h = gate * (np.maximum(up, 0) if self.kind == "drelu" else up)
        active = np.abs(h) > self.threshold
        if p1 is not None and self.predictor_enabled:
            predicted = np.maximum(x2 @ p1.T + pb1, 0) @ p2.T + pb2 > self.predictor_tau
            active &= predicted
        y = np.where(active, h, 0) @ w_down_t + (0 if b_down is None else b_down)
        return (y.reshape(x.shape).astype(x.dtype),)


def _custom(model: onnx.ModelProto, domain: str = DOMAIN) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == domain]


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    return next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name)


def _export(cm, tmp_path, **kw) -> onnx.ModelProto:
    path = picompile.export_onnx(cm, tmp_path / "model.onnx", **kw)
    onnx.checker.check_model(str(path))
    return onnx.load(str(path))


def test_llama_fixture_one_custom_node_per_block_with_its_plan_and_weights(tmp_path):
    model, _ = models.load(str(FIXTURE))
    cm = picompile.compile(model, quiet=True)
    exported = _export(cm, tmp_path)

    nodes = _custom(exported)
    assert [_attrs(n)["block"].decode() for n in nodes] == [b.name for b in cm.plan.blocks]
    assert len(nodes) == 4
    for node, block in zip(nodes, cm.plan.blocks):
        a, ffn = _attrs(node), cm.ffns()[block.name]
        assert node.op_type == "SparseFFN"
        assert (a["kind"], a["activation"], a["mode"], a["weight_dtype"]) == (
            b"gated", b"relu", b"exact", b"float32")
        assert (a["d_model"], a["n_ff"], a["threshold"]) == (160, 640, 0.0)
        assert (a["hot_neurons"], a["cold_neurons"]) == (0, 640)
        assert a["skips"] == b"exact zeros" and "predictor_rank" not in a
        w_gate, w_up, w_down_t = node.input[1:4]
        np.testing.assert_array_equal(_initializer(exported, w_up), ffn.w_up.numpy())
        np.testing.assert_array_equal(_initializer(exported, w_down_t), ffn.w_down_t.numpy())
        np.testing.assert_array_equal(_initializer(exported, w_gate), ffn.w_gate.numpy())
    # each captured MLP is its own graph: an input and an output named after the module
    assert [i.name for i in exported.graph.input] == [f"{m}/x" for m in cm.graphs]
    assert [o.name for o in exported.graph.output] == [f"{m}/output" for m in cm.graphs]
    dims = [d.dim_param or d.dim_value for d in exported.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "sequence", 160]
    assert all(n.domain in STANDARD for n in exported.graph.node if n not in nodes)
    assert {i.domain: i.version for i in exported.opset_import} == {"": 20, DOMAIN: 1}


def test_bfloat16_weights_and_inputs_keep_their_dtype(tmp_path):
    cm = picompile.compile(zoo.make("llama_relu"), dtype="bfloat16", quiet=True)
    exported = _export(cm, tmp_path)
    assert exported.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16
    node = _custom(exported)[0]
    assert _attrs(node)["weight_dtype"] == b"bfloat16"
    w_up = _initializer(exported, node.input[2]).astype(np.float32)
    np.testing.assert_array_equal(w_up, cm.ffns()["model.layers.0.mlp.sparse_ffn"].w_up.float().numpy())


def test_quantized_blocks_say_their_formats_and_keep_their_blocks(tmp_path):
    cm = picompile.compile(zoo.make("llama_relu", hidden=64, n_ff=96), quantize="q4_1", quiet=True)
    exported = _export(cm, tmp_path)
    node = _custom(exported)[0]
    attrs = _attrs(node)
    assert (attrs["weight_dtype"], attrs["down_weight_dtype"]) == (b"q4_1", b"q8_0")
    layout = attrs["weight_layout"]
    assert b"GGUF blocks" in layout and b"as GGUF stores them" in layout
    assert b"dot layout" not in layout and b"rounded to 8 bits" in layout
    ffn = cm.ffns()["model.layers.0.mlp.sparse_ffn"]
    np.testing.assert_array_equal(_initializer(exported, node.input[2]), ffn.w_up.numpy())


def test_quantized_gate_and_up_rows_are_written_in_gguf_layout(tmp_path):
    """Rows of 8+ blocks are kept in the kernels' dot layout; the file holds GGUF's blocks
    (also beside float down rows)."""
    cm = picompile.compile(zoo.make("llama_relu", hidden=256, n_ff=96), quiet=True)
    for ffn in cm.ffns().values():
        ffn.quantize_("q4_0", "float16")
    exported = _export(cm, tmp_path)
    node = _custom(exported)[0]
    assert (_attrs(node)["weight_dtype"], _attrs(node)["down_weight_dtype"]) == (b"q4_0", b"float16")
    ffn = cm.ffns()["model.layers.0.mlp.sparse_ffn"]
    assert not torch.equal(ffn.row_blocks("w_up"), ffn.w_up)  # the layouts differ here
    for i, attr in ((1, "w_gate"), (2, "w_up")):
        np.testing.assert_array_equal(_initializer(exported, node.input[i]), ffn.row_blocks(attr).numpy())
        # what the layout attribute says: GGUF's rows, which quant.dequantize reads as they
        # are, to the weights the kernels read from their own layout
        got = quant.dequantize(torch.from_numpy(_initializer(exported, node.input[i])), "q4_0",
                               ffn.d_model)
        want = float_weight(getattr(ffn, attr), "q4_0", ffn.d_model, dot_layout=True)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    np.testing.assert_array_equal(_initializer(exported, node.input[3]).astype(np.float16),
                                  ffn.w_down_t.numpy())


def test_the_file_computes_what_the_rewritten_graphs_compute_with_a_threshold(tmp_path):
    ids = torch.randint(0, zoo.VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    cm = picompile.compile(zoo.make("llama_silu"), sparsity=0.5, calibration=ids, quiet=True)
    exported = _export(cm, tmp_path)
    thresholds = [_attrs(n)["threshold"] for n in _custom(exported)]
    assert thresholds == pytest.approx([b.decided.threshold for b in cm.plan.blocks]) and min(thresholds) > 0

    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(1))
    run = ReferenceEvaluator(exported, new_ops=[SparseFFN])
    got = run.run(None, {f"{m}/x": x.numpy() for m in cm.graphs})
    with torch.no_grad():
        want = [gm(x) for gm in cm.graphs.values()]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.numpy(), atol=1e-5)


def test_opt_exports_its_decoder_layers_as_standard_ops_around_the_block(tmp_path):
    cm = picompile.compile(zoo.make("opt"), quiet=True)
    exported = _export(cm, tmp_path)
    assert len(_custom(exported)) == 2
    eager = _custom(exported, EAGER_DOMAIN)
    assert [(n.op_type, _attrs(n)["module"]) for n in eager] == [
        ("OPTAttention", b"model.decoder.layers.0.self_attn"),
        ("OPTAttention", b"model.decoder.layers.1.self_attn")]
    standard = {n.op_type for n in exported.graph.node if n.domain in STANDARD}
    assert {"LayerNormalization", "Add", "Shape", "Reshape"} <= standard

    class OPTAttention(OpRun):
        """The eager node: the very module it names, called with the inputs it names."""

        op_domain = EAGER_DOMAIN

        def _run(self, *inputs, **attrs):
            module = cm._orig_mod.get_submodule(self.module)
            kwargs = {k: torch.from_numpy(v) for k, v in zip(self.arguments.split(", "), inputs)}
            with torch.no_grad():
                out, weights = module(**kwargs)
            return out.numpy(), np.zeros(0, np.float32) if weights is None else weights.numpy()

    x = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(5)[None]
    feeds = {}
    for m in cm.graphs:
        feeds.update({f"{m}/hidden_states": x.numpy(), f"{m}/position_ids": pos.numpy()})
    got = ReferenceEvaluator(exported, new_ops=[SparseFFN, OPTAttention]).run(None, feeds)
    with torch.no_grad():
        want = [gm(x, position_ids=pos) for gm in cm.graphs.values()]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.numpy(), atol=1e-5)


def test_predictor_and_placement_fold_into_the_block_node(tmp_path):
    ids = torch.randint(0, zoo.VOCAB, (4, 64), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA GPU: the placement is planned only
        cm = picompile.compile(zoo.make("llama_relu"), mode="predicted", calibration=ids,
                               predictors="all", gpu_budget="1GB", quiet=True)
    exported = _export(cm, tmp_path)
    assert not any(n.op_type == "Predictor" for n in exported.graph.node)
    for node in _custom(exported):
        a = _attrs(node)
        block, ffn = cm.plan.block(a["block"].decode()), cm.ffns()[a["block"].decode()]
        assert len(node.input) == 11  # x, 6 block tensors (absent biases as ""), 4 predictor
        assert (a["predictor_rank"], a["predictor_enabled"]) == (ffn.predictor.rank, 1)
        assert a["predictor_tau"] == pytest.approx(ffn.predictor.tau)
        assert a["hot_neurons"] == block.decided.hot_neurons and a["hot_neurons"] + a["cold_neurons"] == 80
        assert a["neuron_order"] == b"hot first (permuted)" and a["mode"] == b"predicted"
        np.testing.assert_array_equal(_initializer(exported, node.input[7]), ffn.predictor.p1.numpy())

    for tokens in (1, 4):  # a decode token; a few, each with its own predicted neurons
        x = torch.randn(1, tokens, 32, generator=torch.Generator().manual_seed(3))
        got = ReferenceEvaluator(exported, new_ops=[SparseFFN]).run(
            None, {f"{m}/x": x.numpy() for m in cm.graphs})
        with torch.no_grad():
            want = [gm(x) for gm in cm.graphs.values()]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w.numpy(), atol=1e-5)


class InlineLM(nn.Module):
    """An LM whose captured block holds ops around the FFN: norm, scale, residual, reshape
    (and, with `flip`, an op the exporter does not map)."""

    def __init__(self, flip: bool = False, d: int = 16, n_ff: int = 40):
        super().__init__()
        self.flip = flip
        self.embed, self.norm = nn.Embedding(zoo.VOCAB, d), nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, n_ff), nn.Linear(n_ff, d)
        self.head = nn.Linear(d, zoo.VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        y = self.down(F.relu(self.up(self.norm(x)))) * 0.5
        y = y.flip(-1) if self.flip else y
        h = (x + y).reshape(-1, x.size(-1))
        return self.head(h.view(x.shape))


def test_standard_ops_around_the_block_compute_what_the_graph_computes(tmp_path):
    torch.manual_seed(0)
    cm = picompile.compile(InlineLM().eval(), quiet=True)
    exported = _export(cm, tmp_path)
    ops = [n.op_type for n in exported.graph.node]
    assert ops.count("SparseFFN") == 1 and "Gather" in ops and "LayerNormalization" in ops
    assert "MatMul" in ops and "Mul" in ops and "Reshape" in ops
    ids = torch.randint(0, zoo.VOCAB, (2, 7))
    (got,) = ReferenceEvaluator(exported, new_ops=[SparseFFN]).run(None, {"ids": ids.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(got, cm(ids).numpy(), atol=1e-5)


def test_an_op_it_cannot_map_is_named_and_leaves_the_old_file(tmp_path):
    cm = picompile.compile(InlineLM(flip=True).eval(), quiet=True)
    target = tmp_path / "model.onnx"
    target.write_bytes(b"old")
    with pytest.raises(ValueError, match=r"cannot export .*`flip`, which the exporter does not map"):
        picompile.export_onnx(cm, target)
    assert target.read_bytes() == b"old" and sorted(tmp_path.iterdir()) == [target]


def test_bad_input_and_bad_paths_say_what_is_wrong(tmp_path):
    dense = zoo.make("llama_relu")
    with pytest.raises(TypeError, match="CompiledModel.*compile the model first"):
        picompile.export_onnx(dense, tmp_path / "model.onnx")
    cm = picompile.compile(copy.deepcopy(dense), quiet=True)
    with pytest.raises(FileNotFoundError, match="does not exist; create it first"):
        picompile.export_onnx(cm, tmp_path / "missing" / "model.onnx")
    with pytest.raises(ValueError, match=r"ending in \.onnx"):
        picompile.export_onnx(cm, tmp_path / "model.txt")
    (tmp_path / "dir.onnx").mkdir()
    with pytest.raises(IsADirectoryError, match="is a directory"):
        picompile.export_onnx(cm, tmp_path / "dir.onnx")
    (tmp_path / "kept.onnx").write_bytes(b"precious")
    (tmp_path / "kept.onnx").chmod(0o444)
    with pytest.raises(PermissionError, match="read-only; picompile does not replace it"):
        picompile.export_onnx(cm, tmp_path / "kept.onnx")
    assert (tmp_path / "kept.onnx").read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.onnx", "kept.onnx"]  # none written


def test_external_data_keeps_the_weights_beside_the_file_and_runs_leave_stats(tmp_path):
    cm = picompile.compile(zoo.make("llama_relu"), quiet=True)
    cm(torch.randint(0, zoo.VOCAB, (1, 4)))
    before = cm.sparsity()
    exported = _export(cm, tmp_path, external_data=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]
    assert (tmp_path / "model.onnx").stat().st_size < (tmp_path / "model.onnx.data").stat().st_size
    w_up = _initializer(exported, _custom(exported)[0].input[2])
    np.testing.assert_array_equal(w_up, cm.ffns()["model.layers.0.mlp.sparse_ffn"].w_up.numpy())
    assert cm.sparsity() == before  # the shape-recording passes are not the user's run


def test_cli_export_writes_the_file_and_refuses_a_bad_output_before_loading(tmp_path, capsys):
    out = tmp_path / "relu_llama.onnx"
    code = cli.main(["export", "--model", str(FIXTURE), "--output", str(out),
                     "--calibration-tokens", "256", "--quiet"])
    err = capsys.readouterr().err
    assert code == 0 and "wrote" in err and "\r" not in err
    assert len(_custom(onnx.load(str(out)))) == 4

    code = cli.main(["export", "--model", str(FIXTURE), "--output", str(tmp_path / "x.txt")])
    err = capsys.readouterr().err
    assert code == 2 and "usage:" in err and "--output" in err and "ending in .onnx" in err
    assert cli.main(["export", "--model", str(FIXTURE)]) == 2
    assert "--output" in capsys.readouterr().err
