"""Whole-model capture (picompile/capture_whole.py) and the picompile custom ops it shows
(picompile/runtime/ops.py): the exported prefill and decode steps against the eager compiled
model over a static cache, the op nodes in the graphs, the fake impls' shapes, refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM, StaticCache

import picompile
from picompile import capture_whole, config
from picompile.runtime.predictor import Predictor
from picompile.runtime import ops
from picompile.runtime.dense_linear import DenseLinear, QuantLinear
from picompile.runtime.generate import cache_kwarg
from tests import zoo

MAX_LEN = 24
PROMPT = [3, 5, 7, 9, 11, 13, 17, 19, 23, 29]  # 10 tokens: prefill above KERNEL_MAX_TOKENS
DECODE = [31, 37, 41]


def _calibration(n=256, seed=0):
    return torch.randint(3, zoo.VOCAB, (4, n // 4), generator=torch.Generator().manual_seed(seed))


def _eager_logits(cm, tokens: list[int], prompt: int) -> list[torch.Tensor]:
    """The compiled model run eagerly on its own StaticCache: logits [1, vocab] of the last
    position after the prompt, then after each further token."""
    model = cm._orig_mod
    cache = StaticCache(config=model.config, max_cache_len=MAX_LEN)
    kw = {cache_kwarg(model): cache, "use_cache": True}
    out = []
    with torch.no_grad():
        for start, end in [(0, prompt)] + [(i, i + 1) for i in range(prompt, len(tokens))]:
            ids = torch.tensor([tokens[start:end]])  # [1, T]
            pos = torch.arange(start, end)[None]  # [1, T]
            out.append(model(input_ids=ids, position_ids=pos, **kw).logits[:, -1])
    return out


def _graph_logits(steps, tokens: list[int], prompt: int) -> list[torch.Tensor]:
    out = [steps.prefill(torch.tensor([tokens[:prompt]]))]
    for i in range(prompt, len(tokens)):
        out.append(steps.decode(torch.tensor([tokens[i]]), i))
    return out


def _count(program, name: str) -> int:
    return capture_whole.picompile_ops(program).count(f"picompile.{name}")


def _lowered(cm) -> int:
    return sum(isinstance(m, (DenseLinear, QuantLinear)) for m in cm._orig_mod.modules())


CASES = [(arch, "exact") for arch in zoo.HF_ARCHS] + [("llama_silu", "threshold"),
                                                     ("gpt_neox", "q8_0")]
COMPILE_KW = {"exact": {}, "threshold": dict(sparsity=0.5, calibration=_calibration()),
              "q8_0": dict(quantize="q8_0")}


@pytest.mark.parametrize("arch,how", CASES)
def test_exported_steps_equal_eager(arch, how):
    cm = picompile.compile(zoo.make(arch), quiet=True, **COMPILE_KW[how])
    if how == "threshold":
        assert any(f.threshold > 0 for f in cm.ffns().values())
    steps = cm.capture_steps(max_len=MAX_LEN)
    assert steps.reasons == {}
    assert set(steps.programs) == {"decode", "prefill"}
    tokens = PROMPT + DECODE
    want = _eager_logits(cm, tokens, len(PROMPT))
    got = _graph_logits(steps, tokens, len(PROMPT))
    for w, g in zip(want, got):
        assert g.shape == w.shape == (1, zoo.VOCAB)
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for kind in ("decode", "prefill"):  # one op node per FFN block and per lowered linear
        program = steps.programs[kind]
        assert _count(program, "sparse_ffn") == len(cm.ffns()) == 2
        assert _count(program, "linear") == _lowered(cm) > 0
        assert "torch.ops.picompile.sparse_ffn" in program.graph_module.code
    # passes/step_graph.gqa_attention: the runnable graphs attend over the KV heads as cached
    kv_heads = getattr(cm.config, "num_key_value_heads", None)
    gqa = kv_heads is not None and kv_heads < cm.config.num_attention_heads  # fewer KV heads
    gqa = gqa and not getattr(cm.config, "attn_logit_softcapping", None)  # capped: no SDPA
    assert steps.gqa_rewrites == {"decode": 2 * gqa, "prefill": 2 * gqa}
    assert steps._run["decode"].gm.code.count("enable_gqa = True") == 2 * gqa
    # never silently slower: the graph runs only where it timed faster, and explain says so
    assert steps.eager_us > 0 and steps.graph_us > 0
    faster = steps.eager_us / steps.graph_us > capture_whole.MIN_SPEEDUP
    assert steps.use == (cm.decoder() is None and faster)
    line = picompile.explain(cm).split("whole-model graph: ")[1].splitlines()[0]
    assert f"({steps.graph_us:.0f} vs {steps.eager_us:.0f} us per step)" in line
    if cm.decoder() is not None:  # Llama family: the C decode step runs, not the graph
        assert steps.why.startswith("generate runs the C whole-step decoder")
    if how == "q8_0":
        assert _lowered(cm) == sum(isinstance(m, QuantLinear) for m in cm._orig_mod.modules())


def test_predictor_is_an_op_node():
    """A block with an enabled predictor: picompile::predictor feeds picompile::sparse_ffn, and
    the graph's logits equal the eager model's."""
    from picompile.compiler import _attach_predictor

    cm = picompile.compile(zoo.make("opt"), quiet=True)
    g = torch.Generator().manual_seed(1)
    for ffn in cm.ffns().values():
        d, n_ff, r = ffn.d_model, ffn.n_ff, 4
        p = Predictor(torch.randn(r, d, generator=g), torch.zeros(r),
                      torch.randn(n_ff, r, generator=g), torch.zeros(n_ff), tau=0.0)
        p.select_kernel()
        _attach_predictor(cm.graphs, ffn, p)
    cm.use_predictors("all")
    steps = cm.capture_steps(max_len=MAX_LEN)
    decode = steps.programs["decode"]
    assert _count(decode, "predictor") == _count(decode, "sparse_ffn") == 2
    for node in decode.graph.nodes:  # the mask goes from the predictor into the block
        if node.op == "call_function" and "sparse_ffn" in str(node.target):
            assert "predictor" in str(node.args[2].target)
    tokens = PROMPT + DECODE
    want = _eager_logits(cm, tokens, len(PROMPT))
    for w, g_ in zip(want, _graph_logits(steps, tokens, len(PROMPT))):
        torch.testing.assert_close(g_, w, rtol=1e-5, atol=1e-5)
    cm.use_predictors("none")  # the graph baked in the switch: no longer current
    assert not steps.current(cm._orig_mod)
    assert picompile.explain(cm).split("whole-model graph: ")[1].startswith("stale")


class _Branchy(LlamaForCausalLM):
    """A causal LM whose forward branches on a token's value: torch.export cannot trace it."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, **kw):
        if int(input_ids.max()) >= self.config.vocab_size:
            raise ValueError("token id out of range")
        if cache is not None:
            kw["cache"] = cache
        return super().forward(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, **kw)


def test_model_that_does_not_export_gives_the_reason():
    torch.manual_seed(0)
    cm = picompile.compile(_Branchy(zoo.hf_config("llama_relu")).eval(), quiet=True)
    ids = torch.tensor([PROMPT])
    want = cm.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    steps = cm.capture_steps(max_len=MAX_LEN)
    assert steps.programs == {} and not steps.use
    reason = steps.reasons["decode"]
    assert reason.split(":")[0].isidentifier() and "\n" not in reason  # "Type: first line"
    line = picompile.explain(cm).split("whole-model graph: ")[1].splitlines()[0]
    assert line == f"not captured: {reason}"
    assert torch.equal(cm.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0), want)


def test_plain_module_is_refused_with_a_reason():
    cm = picompile.compile(zoo.make("tiny_gated_relu"), quiet=True)
    steps = cm.capture_steps()
    assert steps.programs == {}
    assert "not a Hugging Face generative model" in steps.reasons["decode"]


def test_generate_runs_the_decode_graph_where_used(monkeypatch):
    """generate runs the graphs only where capture decided so (here: forced), with the eager
    path's tokens; the graphs' cache is what they wrote. (The C decoder, off here, would take
    the steps before them.)"""
    monkeypatch.setenv(config.DECODER_ENV, "0")
    cm = picompile.compile(zoo.make("gpt_neox"), quiet=True)
    assert cm.decoder() is None
    ids = torch.tensor([PROMPT])
    want = cm.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    steps = cm.capture_steps(max_len=MAX_LEN)
    keys = steps._step.keys_0  # [1, heads, MAX_LEN, head_dim], the cache both graphs write
    steps.use = True
    keys.zero_()
    assert torch.equal(cm.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0), want)
    written = keys[0, 0].abs().sum(-1) > 0  # [MAX_LEN]: positions the graphs wrote
    assert written[: len(PROMPT) + 5].all() and not written[len(PROMPT) + 5:].any()
    keys.zero_()  # too long for the captured cache: the eager path
    long = cm.generate(ids, max_new_tokens=MAX_LEN, do_sample=False, pad_token_id=0)
    assert long.shape[1] == len(PROMPT) + MAX_LEN and not keys.any()


@pytest.fixture(scope="module")
def modules():
    """A SparseFFN, a DenseLinear and a QuantLinear of a compiled model, and a Predictor."""
    cm = picompile.compile(zoo.make("llama_relu"), quiet=True, quantize="q8_0")
    ffn = next(iter(cm.ffns().values()))
    quant = next(m for m in cm._orig_mod.modules() if isinstance(m, QuantLinear))
    cm2 = picompile.compile(zoo.make("llama_relu"), quiet=True)
    ffn = next(iter(cm2.ffns().values()))
    dense = next(m for m in cm2._orig_mod.modules() if isinstance(m, DenseLinear))
    g = torch.Generator().manual_seed(0)
    pred = Predictor(torch.randn(4, ffn.d_model, generator=g), torch.zeros(4),
                     torch.randn(ffn.n_ff, 4, generator=g), torch.zeros(ffn.n_ff))
    pred.select_kernel()
    return dict(ffn=ffn, dense=dense, quant=quant, pred=pred, keep=(cm, cm2))


@pytest.mark.parametrize("tokens", [1, 3, 12])
def test_ops_equal_module_forward_and_fake_shapes(modules, tokens):
    """Each op gives its module's forward; opcheck checks the schema and the fake impl."""
    ffn, dense, quant, pred = (modules[k] for k in ("ffn", "dense", "quant", "pred"))
    x = torch.randn(2, tokens, ffn.d_model, generator=torch.Generator().manual_seed(tokens))
    mask = pred(x)  # [2 * tokens, n_ff] bool
    cases = [
        (torch.ops.picompile.sparse_ffn.default, (x, ops.handle(ffn), None), ffn(x)),
        (torch.ops.picompile.sparse_ffn.default, (x, ops.handle(ffn), mask), ffn(x, mask)),
        (torch.ops.picompile.predictor.default, (x, ops.handle(pred), ffn.n_ff), mask),
        (torch.ops.picompile.linear.default, (x, ops.handle(dense), dense.out_features), dense(x)),
        (torch.ops.picompile.linear.default, (x, ops.handle(quant), quant.out_features), quant(x)),
    ]
    for op, args, want in cases:
        got = op(*args)
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want)
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
        assert fake.shape == want.shape and fake.dtype == want.dtype
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_handles_are_per_module_and_freed_modules_raise():
    a = DenseLinear(torch.nn.Parameter(torch.randn(4, 8)))
    b = DenseLinear(torch.nn.Parameter(torch.randn(4, 8)))
    ha, hb = ops.handle(a), ops.handle(b)
    assert ha != hb and ops.handle(a) == ha and ops.module_of(hb) is b
    del b
    with pytest.raises(RuntimeError, match="no longer exists"):
        torch.ops.picompile.linear(torch.randn(1, 8), hb, 4)


def test_dynamo_traces_the_ops_as_nodes():
    """torch.compile (Dynamo) traces the compiled model in one graph, each kernel module one
    picompile op node (the handles are constants), with the eager model's logits."""
    cm = picompile.compile(zoo.make("gpt_neox"), quiet=True)
    ids = torch.tensor([PROMPT])
    want = cm._orig_mod(ids).logits
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    try:
        got = torch.compile(cm._orig_mod, backend=backend, fullgraph=True)(ids).logits
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum(t.startswith("picompile.sparse_ffn") for t in targets) == len(cm.ffns()) == 2
    assert sum(t.startswith("picompile.linear") for t in targets) == _lowered(cm)
