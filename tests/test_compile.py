"""End to end: compiled == dense for every architecture, plus the errors a user can hit."""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import torch.nn.functional as F
import transformers as T
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import picompile
from picompile.capture import Tracer
from tests import zoo

# Logit tolerance by model dtype: bf16 models round every op; our FFN accumulates in fp32.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=6e-2, rtol=6e-2)}


def compile_pair(arch, dtype=torch.float32, seed=0, **kw):
    dense = zoo.make(arch, dtype, seed)
    return dense, picompile.compile(copy.deepcopy(dense), quiet=True, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("arch", zoo.ALL_ARCHS)
@settings(max_examples=6, deadline=None)
@given(batch=st.integers(1, 4), seq=st.integers(1, 32), seed=st.integers(0, 2**16))
def test_exact_mode_equals_dense(arch, dtype, batch, seq, seed):
    dense, cm = compile_pair(arch, dtype, seed)
    assert cm.plan.blocks, "no FFN block was found"
    ids = torch.randint(0, zoo.VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want, got = zoo.logits(dense, ids), zoo.logits(cm, ids)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_gelu_written_out_by_a_module_compiles_as_gelu_tanh():
    """Phi-1/2's NewGELUActivation (GELU's tanh approximation as mul / tanh / pow, also GPT-J's):
    kept whole by capture, read by detect, and the compiled model equals the dense one (it
    was "no FFN block" before)."""
    dense, cm = compile_pair("phi")
    assert [b.act for b in cm.plan.blocks] == ["gelu_tanh"] * 2
    ids = torch.randint(0, zoo.VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(cm, ids), zoo.logits(dense, ids), **TOL[torch.float32])
    want = dense.generate(ids[:1], max_new_tokens=8, do_sample=False)
    assert torch.equal(cm.generate(ids[:1], max_new_tokens=8, do_sample=False), want)


def test_opt_with_eager_attention_runs_without_a_cache():
    """OPT's eager attention traces, and inline in its decoder layer the trace fixed its
    `if cache is not None` branch: calibration and any call without a cache crashed. An
    attention (no block, no activation) stays a module of its own in the layer's graph."""
    config = zoo.hf_config("opt")
    config._attn_implementation = "eager"  # as from_pretrained(attn_implementation="eager")
    torch.manual_seed(0)
    dense = T.OPTForCausalLM(config).eval()
    ids = torch.randint(0, zoo.VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    cm = picompile.compile(copy.deepcopy(dense), sparsity=0.5, calibration=ids, quiet=True)
    gm = cm.graphs["model.decoder.layers.0"]
    assert any(n.op == "call_module" and n.target == "self_attn" for n in gm.graph.nodes)
    exact = picompile.compile(copy.deepcopy(dense), quiet=True)
    with torch.no_grad():
        torch.testing.assert_close(exact(ids, use_cache=False).logits,
                                   dense(ids, use_cache=False).logits, **TOL[torch.float32])


def test_bloom_gelu_module_compiles_as_gelu_tanh():
    config = T.BloomConfig(vocab_size=zoo.VOCAB, hidden_size=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    dense = T.BloomForCausalLM(config).eval()
    cm = picompile.compile(copy.deepcopy(dense), quiet=True)
    assert [b.act for b in cm.plan.blocks] == ["gelu_tanh"] * 2
    ids = torch.randint(0, zoo.VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(cm, ids), zoo.logits(dense, ids), **TOL[torch.float32])


def test_refusals_name_the_ffn_picompile_does_not_compile():
    """xIELU (Apertus): the block and its activation module, before the attention that did not
    trace; a mixture of experts (Mixtral): said so, and that it is not compiled."""
    apertus = T.ApertusForCausalLM(T.ApertusConfig(
        vocab_size=zoo.VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64))
    with pytest.raises(ValueError, match=r"found no FFN block in ApertusForCausalLM "
                                         r"\(model.layers.0.mlp: act_fn: activation "
                                         r"XIELUActivation is not supported"):
        picompile.compile(apertus.eval(), quiet=True)
    mixtral = T.MixtralForCausalLM(T.MixtralConfig(
        vocab_size=zoo.VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, num_local_experts=4,
        max_position_embeddings=64))
    with pytest.raises(ValueError, match="mixture-of-experts blocks .*MixtralSparseMoeBlock"):
        picompile.compile(mixtral.eval(), quiet=True)
    # a model named so itself (GraniteMoeForCausalLM): the experts' module is named, not ""
    granite = T.GraniteMoeForCausalLM(T.GraniteMoeConfig(
        vocab_size=zoo.VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, num_local_experts=4,
        max_position_embeddings=64))
    with pytest.raises(ValueError, match=r"mixture-of-experts blocks \(model.layers.0"):
        picompile.compile(granite.eval(), quiet=True)


def test_an_activation_in_another_form_is_named_with_its_path():
    """A known activation between linears but not in a pattern (BitNet's sub-norm before down,
    here an affine norm): the refusal names the path instead of only unrelated reasons."""
    class SubNormMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up, self.down = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 16)
            self.norm = nn.LayerNorm(32)

        def forward(self, x):
            return self.down(self.norm(F.silu(self.gate(x)) * self.up(x)))

    with pytest.raises(ValueError, match=r"found no FFN block in SubNormMLP \(SubNormMLP: silu: the silu "
                       r"activation is in gate -> silu -> mul -> norm -> down, not in a "
                       r"supported form.*run the model with transformers as it is"):
        picompile.compile(SubNormMLP().eval(), quiet=True)


def _profiling_fails(monkeypatch):
    """compile fails inside profiling, after capture rewrote the model (calibration ids it
    cannot take are refused before capture)."""
    from picompile.passes import profile as profile_pass

    def fail(*args, **kwargs):
        raise RuntimeError("profiling failed")

    monkeypatch.setattr(profile_pass, "profile", fail)


def test_gpt2_conv1d_layers_become_linear_and_come_back_when_compile_fails(monkeypatch):
    """GPT-2's Conv1D (x @ W + b, W [in, out]) are read as nn.Linear: its MLPs are GELU blocks,
    its attention projections and head run on the dense kernels. A compile that fails puts
    each Conv1D back (the same module, its weights unchanged); a plan loads onto a fresh one."""
    model = zoo.make("gpt2")
    convs = {n: m for n, m in model.named_modules() if type(m).__name__ == "Conv1D"}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with monkeypatch.context() as patch:
        _profiling_fails(patch)
        with pytest.raises(RuntimeError, match="profiling failed"):
            picompile.compile(model, mode="predicted", calibration=torch.randint(0, zoo.VOCAB, (2, 8)))
    assert {n: m for n, m in model.named_modules() if type(m).__name__ == "Conv1D"} == convs
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="no FFN block"):
        picompile.compile(torch.nn.Sequential(model.transformer.h[0].attn), quiet=True)
    assert model.transformer.h[0].attn.c_attn is convs["transformer.h.0.attn.c_attn"]

    dense, cm = compile_pair("gpt2")
    assert [(b.kind, b.act, b.linears) for b in cm.plan.blocks] == [
        ("plain", "gelu_tanh", {"up": "c_fc", "down": "c_proj"})] * 2
    assert not any(type(m).__name__ == "Conv1D" for m in cm._orig_mod.modules())
    assert "5 C float32" in picompile.explain(cm)  # c_attn, attention's c_proj x 2, lm_head
    with tempfile.TemporaryDirectory() as d:
        cm.save(d)
        loaded = picompile.load(zoo.make("gpt2"), d, quiet=True)
    ids = torch.randint(0, zoo.VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(loaded, ids), zoo.logits(dense, ids), **TOL[torch.float32])


@pytest.mark.parametrize("arch", ["llama_relu", "opt"])
def test_greedy_generate_matches_dense_for_relu_models(arch):
    dense, cm = compile_pair(arch)
    ids = torch.randint(0, zoo.VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    want = dense.generate(ids, max_new_tokens=12, do_sample=False)
    got = cm.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)
    assert 0.2 < cm.sparsity() < 0.9  # random ReLU blocks: about half the neurons fire


@pytest.mark.parametrize("arch,kind,act,bias", [
    ("llama_relu", "gated", "relu", False), ("llama_silu", "gated", "silu", False),
    ("opt", "plain", "relu", True), ("falcon", "plain", "gelu", False),
    ("gpt_neox", "plain", "gelu", True), ("gemma", "gated", "gelu_tanh", False),
    ("phi", "plain", "gelu_tanh", True),
    ("tiny_drelu", "drelu", "relu", False), ("tiny_fused_silu", "gated", "silu", False),
    ("tiny_plain_relu", "plain", "relu", True), ("nemotron", "plain", "relu2", False),
    ("tiny_gated_relu2", "gated", "relu2", False),
])
def test_detects_every_block_kind(arch, kind, act, bias):
    _, cm = compile_pair(arch)
    assert [(b.kind, b.act, b.bias) for b in cm.plan.blocks] == [(kind, act, bias)] * 2
    for name, gm in cm.graphs.items():
        assert "sparse_ffn" in gm.code
        Tracer().trace(gm)  # the rewritten graph stays traceable


def test_opt_block_is_captured_inline_in_the_decoder_layer():
    _, cm = compile_pair("opt")
    assert sorted(cm.graphs) == ["model.decoder.layers.0", "model.decoder.layers.1"]
    assert cm.plan.blocks[0].linears == {"up": "fc1", "down": "fc2"}


def test_graphs_and_explain():
    _, cm = compile_pair("llama_silu")
    assert sorted(cm.graphs) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    report = picompile.explain(cm)
    assert "model.layers.0.mlp.sparse_ffn" in report and "silu" in report and "dense" in report
    assert "self_attn" in report  # modules kept eager are listed with the reason


def test_threshold_sparsity_zero_equals_dense():
    dense, cm = compile_pair("llama_silu", sparsity=0.0,
                             calibration=torch.randint(0, zoo.VOCAB, (2, 16)))
    assert all(b.decided.threshold == 0.0 for b in cm.plan.blocks)
    ids = torch.randint(0, zoo.VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(cm, ids), zoo.logits(dense, ids), **TOL[torch.float32])


SQUARED_RELU_FORMS = {
    "pow": lambda u: F.relu(u) ** 2,
    "square": lambda u: torch.square(F.relu(u)),
    "pow_method": lambda u: torch.relu(u).pow(2),
    "self_mul": lambda u: (lambda r: r * r)(F.relu(u)),
    "square_method": lambda u: F.relu(u).square(),
}


class WrittenFFN(nn.Module):
    """ids [B, T] -> logits: an embedding, two residual FFNs of the given activation, a head."""

    def __init__(self, form, d=32, n_ff=96):
        super().__init__()
        self.form, self.embed, self.head = form, nn.Embedding(zoo.VOCAB, d), nn.Linear(d, zoo.VOCAB)
        self.ups = nn.ModuleList(nn.Linear(d, n_ff) for _ in range(2))
        self.downs = nn.ModuleList(nn.Linear(n_ff, d) for _ in range(2))

    def forward(self, ids):
        x = self.embed(ids)
        for up, down in zip(self.ups, self.downs):
            x = x + down(self.form(up(x)))
        return self.head(x)


@pytest.mark.parametrize("form", sorted(SQUARED_RELU_FORMS))
def test_squared_relu_written_out_is_one_exact_block(form):
    """relu(v) ** 2 in any of the ways one writes it is one squared-ReLU block, exact (no
    threshold even with a target sparsity) and equal to the dense module."""
    torch.manual_seed(0)
    dense = WrittenFFN(SQUARED_RELU_FORMS[form]).eval()
    calib = torch.randint(0, zoo.VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    cm = picompile.compile(copy.deepcopy(dense), quiet=True, sparsity=0.9, calibration=calib)
    assert [(b.kind, b.act, b.exact) for b in cm.plan.blocks] == [("plain", "relu2", True)] * 2
    assert all(b.decided.threshold == 0 and 0.3 < b.measured.sparsity < 0.7 for b in cm.plan.blocks)
    for gm in cm.graphs.values():
        assert "relu" not in gm.code and "pow" not in gm.code and "square" not in gm.code
    ids = torch.randint(0, zoo.VOCAB, (3, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(cm(ids), dense(ids), **TOL[torch.float32])


@pytest.mark.parametrize("second,then", [(lambda r: r ** 3, "pow_1"), (lambda r: r * r + r, "add")])
def test_a_relu_squared_only_in_part_is_not_a_squared_relu(second, then):
    """relu(v) ** 3, or a ReLU used besides its square: no squared ReLU; the refusal names the
    ReLU's path (and not the ModuleLists, which have no forward to trace)."""
    with pytest.raises(ValueError, match=rf"no FFN block in WrittenFFN \(WrittenFFN: relu: the relu "
                       rf"activation is in ups.0 -> relu -> {then} -> downs.0, not in a supported "
                       r"form; [^)]*relu_1[^)]*\)\. Supported"):
        picompile.compile(WrittenFFN(lambda u: second(F.relu(u))).eval(), quiet=True)


@pytest.mark.parametrize("arch, measured", [("llama_silu", False), ("llama_relu", True)])
def test_calibration_without_a_target_runs_only_where_there_is_sparsity_to_measure(arch, measured):
    """No sparsity= asked: ReLU blocks get their natural sparsity measured; SiLU blocks (which
    skip nothing at threshold 0) do not make compile run its calibration tokens for nothing,
    nor the plan and explain() say it calibrated on them."""
    calib = torch.randint(0, zoo.VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    _, cm = compile_pair(arch, calibration=calib)
    assert cm.plan.calibration_tokens == (calib.numel() if measured else 0)
    assert (f"calibrated on {calib.numel()} tokens" in picompile.explain(cm)) == measured
    for b in cm.plan.blocks:
        assert b.decided.threshold == 0.0
        assert (b.measured.sparsity is not None) == measured
        if measured:
            assert 0.2 < b.measured.sparsity < 0.8  # random ReLU blocks: about half fire


@pytest.mark.parametrize("target", [0.3, 0.5, 0.9])
def test_threshold_calibration_reaches_target_sparsity(target):
    calib = torch.randint(0, zoo.VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    dense, cm = compile_pair("llama_silu", sparsity=target, calibration=calib)
    for b in cm.plan.blocks:
        assert b.decided.threshold > 0
        assert abs(b.measured.sparsity - target) < 0.02
    cm.reset_stats()
    with torch.no_grad():
        cm(calib)  # the same tokens: the runtime skips the calibrated share
    assert abs(cm.sparsity() - target) < 0.03
    assert "threshold" in repr(cm.ffns()["model.layers.0.mlp.sparse_ffn"])


def test_calibration_rows_past_learned_positions_are_refused_before_capture():
    model = zoo.make("gpt2")  # 128 positions
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"rows of {limit + 1} tokens are longer than the model's "
                                         f"{limit} learned positions"):
        picompile.compile(model, sparsity=0.5, calibration=torch.randint(0, zoo.VOCAB, (2, limit + 1)))
    assert any(type(m).__name__ == "Conv1D" for m in model.modules())


def test_calibration_text_needs_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        compile_pair("llama_silu", sparsity=0.5, calibration=["some text"])


def test_bad_inputs_say_what_is_wrong():
    model = zoo.make("llama_relu")
    with pytest.raises(ValueError, match="sparsity"):
        picompile.compile(model, sparsity=1.0)
    with pytest.raises(ValueError, match="sparsity"):
        picompile.compile(model, sparsity=-0.1)
    with pytest.raises(ValueError, match="mode"):
        picompile.compile(model, mode="fast")
    with pytest.raises(ValueError, match="gpu_budget"):
        picompile.compile(model, gpu_budget="24 parsecs")
    with pytest.raises(TypeError, match="nn.Module"):
        picompile.compile("meta-llama/Llama-2-7b")
    with pytest.raises(ValueError, match="calibration"):
        picompile.compile(zoo.make("llama_silu"), sparsity=0.5)
    with pytest.raises(ValueError, match="no FFN block"):
        picompile.compile(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)))
    with pytest.raises(TypeError, match="CompiledModel"):
        picompile.explain(model)
    calib = torch.randint(0, zoo.VOCAB, (2, 16))
    for kw, what in [(dict(calibration=calib[:, :0]), "no token ids"),
                     (dict(calibration=[], tokenizer=lambda text, **_: {
                         "input_ids": torch.empty(1, 0, dtype=torch.long)}), "no tokens"),
                     (dict(tokenizer=object()), "tokenizer= takes"),
                     (dict(mode="predicted", calibration=calib, target_recall=-1), "target_recall"),
                     (dict(mode="predicted", calibration=calib, target_recall=2.0), "target_recall"),
                     (dict(max_context=-5), "max_context"),
                     (dict(quantize="q8_0", gguf="/nonexistent.gguf"), "not a file")]:
        with pytest.raises(ValueError, match=what):
            picompile.compile(zoo.make("llama_silu"), sparsity=0.5, quiet=True, **kw)


class TanhMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.gate, self.up2, self.down2 = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        y = self.down(torch.tanh(self.up(x)))  # unsupported activation
        g = F.silu(self.gate(x))
        return y + self.down2(g * self.up2(x)) + g.sum(-1, keepdim=True)  # g used outside


def test_unmatched_blocks_say_why():
    with pytest.raises(ValueError) as err:
        picompile.compile(TanhMLP())
    message = str(err.value)
    assert "tanh" in message and "not supported" in message
    assert "also used outside the FFN" in message


def test_compiled_model_forwards_attributes():
    dense, cm = compile_pair("llama_relu")
    assert cm.config is cm._orig_mod.config
    assert isinstance(cm, nn.Module) and cm.plan.mode == "exact"


def test_a_refused_compile_leaves_the_model_untouched():
    model = zoo.make("llama_silu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="calibration"):
        picompile.compile(model, mode="predicted")
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_compile_that_fails_while_profiling_puts_the_model_back(monkeypatch):
    model = zoo.make("llama_relu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with monkeypatch.context() as patch:
        _profiling_fails(patch)
        with pytest.raises(RuntimeError, match="profiling failed"):
            picompile.compile(model, mode="predicted", calibration=torch.randint(0, zoo.VOCAB, (2, 8)))
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    cm = picompile.compile(model, mode="predicted", calibration=torch.randint(0, zoo.VOCAB, (2, 8)),
                           predictors="all", quiet=True)  # a retry starts from the model as it was
    assert all(not gm.meta.get("picompile_original") for gm in cm.graphs.values())
