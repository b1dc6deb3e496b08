"""The whole-step decoder (runtime/decoder.py, kernels/decoder.c) against the model's own forward.

Per architecture (tiny random configs, tests/zoo.py): each decode step through the decoder gives
the logits the compiled model's per-module path gives for the same token and cache, and
generate() through it gives Hugging Face's tokens. Models it does not run are refused with a
reason, and generate() still works (per module)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, StaticCache

import picompile
from picompile.runtime.decoder import Decoder
from picompile.runtime.generate import cache_kwarg, generate
from tests import zoo

RUNS = ["llama_relu", "llama_silu", "mistral", "qwen2", "qwen3", "phi3", "opt", "gemma",
        "gemma2", "gemma3", "granite", "arcee", "gpt2", "nemotron", "phi", "gpt_neox", "falcon"]
REFUSED = ["qwen3_next"]


def _calibration(n=256, seed=0):
    return torch.randint(3, zoo.VOCAB, (4, n // 4), generator=torch.Generator().manual_seed(seed))


def _compile_kw(how: str) -> dict:
    """compile() arguments for each FFN mode: "exact", "threshold" (50%) or "predicted"."""
    kw = dict(quiet=True)
    if how == "threshold":
        kw.update(sparsity=0.5, calibration=_calibration())
    elif how == "predicted":
        kw.update(mode="predicted", sparsity=0.5, calibration=_calibration(), predictors="all")
    return kw


def _model(arch, **sizes):
    return _randomized(zoo.make(arch, **sizes))


def _randomized(model):
    with torch.no_grad():  # random biases and norms, so that every pointer the decoder reads
        for name, p in model.named_parameters():  # is exercised (LayerNorm's bias too)
            gen = torch.Generator().manual_seed(len(name))
            if name.endswith(("_proj.bias", "lm_head.bias", "c_attn.bias", "query_key_value.bias",
                              "attn.c_proj.bias", "attention.dense.bias")):
                p.normal_(0, 0.5, generator=gen)
            elif "norm" in name or ".ln_" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2, generator=gen)
    return model


@torch.no_grad()
def _step_logits(cm, decoder, ids, prompt: int):
    """Logits of each decode step after a prompt of `prompt` tokens, (per-module, decoder):
    [n - prompt, vocab] each. Per module: T = 1 calls with HF's static cache, as decode runs."""
    n = ids.shape[1]
    cache = StaticCache(config=cm.config, max_cache_len=n)
    kv = cache_kwarg(cm._orig_mod)
    cm._orig_mod(ids[:, :prompt], **{kv: cache}, use_cache=True)
    assert decoder.reserve(n)
    decoder.load_cache(cache, prompt)
    decoder.set_threads()
    want, got = [], []
    for pos in range(prompt, n):
        tok = ids[:, pos]
        want.append(cm._orig_mod(tok[:, None], **{kv: cache}, use_cache=True,
                                 position_ids=torch.tensor([[pos]])).logits[0, -1].float())
        got.append(decoder.step(tok, pos)[0].clone())
    return torch.stack(want), torch.stack(got)


@pytest.mark.parametrize("arch", RUNS)
@pytest.mark.parametrize("how", ["exact", "threshold", "predicted"])
def test_steps_equal_the_per_module_path(arch, how):
    model = _model(arch, layers=3)
    cm = picompile.compile(model, **_compile_kw(how))
    dec = cm.decoder()
    assert dec is not None, cm.decoder_reason
    assert "picompile decoder" in picompile.explain(cm)
    if how == "predicted":
        assert all(ffn.predictor.enabled for ffn in cm.ffns().values())
    ids = torch.randint(3, zoo.VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    want, got = _step_logits(cm, dec, ids, prompt=5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_dynamic_ntk_rope_is_refused():
    """Dynamic NTK RoPE scales its frequencies by the sequence's length as it grows: tables made
    once for the reserved length rotate every position otherwise than the model does."""
    config = zoo.hf_config("llama_silu")
    config.max_position_embeddings = 32
    config.rope_parameters = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    torch.manual_seed(0)
    dense = _randomized(AutoModelForCausalLM.from_config(config).eval())
    cm = picompile.compile(copy.deepcopy(dense), quiet=True)
    assert cm.decoder() is None and "dynamic NTK RoPE" in cm.decoder_reason
    ids = torch.randint(3, zoo.VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=20, do_sample=False)
    assert torch.equal(cm.generate(ids, **kw), dense.generate(ids, **kw))


@pytest.mark.parametrize("kw", [dict(multi_query=False), dict(parallel_attn=False, bias=True),
                                dict(multi_query=False, parallel_attn=False, bias=True)])
def test_falcon_layouts_step_as_the_per_module_path(kw):
    """Falcon-7B's layout is the zoo's (multi-query, parallel); without multi-query its fused
    query_key_value gives each head's q, k and v in turn, and without parallel_attn the FFN
    reads the attention's output through post_attention_layernorm."""
    config = zoo.hf_config("falcon", layers=2)
    for key, value in kw.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = _randomized(AutoModelForCausalLM.from_config(config).eval())
    cm = picompile.compile(model, quiet=True)
    dec = cm.decoder()
    assert dec is not None, cm.decoder_reason
    ids = torch.randint(3, zoo.VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    want, got = _step_logits(cm, dec, ids, prompt=5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize("arch", RUNS)
@pytest.mark.parametrize("how", ["exact", "threshold", "predicted"])
def test_a_step_of_several_tokens_equals_the_per_module_path(arch, how):
    """Steps of 3, 8, 1 and 4 tokens (a token and those drafted after it): each gives the
    logits of every position that the per-module path gives for the same tokens in one call
    (in predicted mode each token with its own predicted neurons)."""
    model = _model(arch, layers=3)
    cm = picompile.compile(model, **_compile_kw(how))
    dec = cm.decoder()
    assert dec is not None, cm.decoder_reason
    ids = torch.randint(3, zoo.VOCAB, (1, 21), generator=torch.Generator().manual_seed(4))
    cache = StaticCache(config=cm.config, max_cache_len=21)
    kv = cache_kwarg(cm._orig_mod)
    with torch.no_grad():
        cm._orig_mod(ids[:, :5], **{kv: cache}, use_cache=True)
        assert dec.reserve(21)
        dec.load_cache(cache, 5)
        dec.set_threads()
        pos = 5
        for T in (3, 8, 1, 4):
            toks = ids[0, pos:pos + T]
            want = cm._orig_mod(toks[None], **{kv: cache}, use_cache=True,
                                position_ids=torch.arange(pos, pos + T)[None]).logits[0].float()
            got = dec.step(toks, pos).clone()
            assert got.shape == (T, zoo.VOCAB)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
            pos += T


@pytest.mark.parametrize("how", ["exact", "threshold", "predicted"])
def test_quantized_steps_of_several_tokens_are_bit_for_bit_steps_of_one(how):
    """With integer dots (quantized rows) nothing a token computes depends on the other tokens
    of its step: the predictor's sums, its picks at tau and the FFN's chunks of neurons are
    those of a step of its own, so drafted tokens are checked exactly (prompt lookup)."""
    model = _model("llama_silu", layers=2, hidden=64, n_ff=192)
    cm = picompile.compile(model, quantize="q8_0", **_compile_kw(how))
    dec = cm.decoder()
    assert dec is not None, cm.decoder_reason
    ids = torch.randint(3, zoo.VOCAB, (12,), generator=torch.Generator().manual_seed(2))
    assert dec.reserve(12)
    dec.set_threads()
    for p in range(4):
        dec.step(ids[p:p + 1], p)
    one = torch.stack([dec.step(ids[p:p + 1], p)[0].clone() for p in range(4, 12)])
    several = dec.step(ids[4:12], 4).clone()
    assert torch.equal(several, one)


@pytest.mark.parametrize("arch", ["llama_silu", "qwen3", "phi3", "opt", "gemma3"])
def test_steps_that_go_back_overwrite_what_was_rejected(arch):
    """Speculative decoding's pattern: a step of several tokens, then the next step starts
    after the accepted ones, overwriting the rest. Every position's logits equal the
    model's own forward over the sequence so far (exact mode)."""
    model = _model(arch, layers=3)
    ref = copy.deepcopy(model)
    cm = picompile.compile(model, quiet=True)
    dec = cm.decoder()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, zoo.VOCAB, (1, 30), generator=gen)
    assert dec.reserve(30)
    dec.set_threads()
    pos, n = 0, 0
    with torch.no_grad():
        want = ref(ids).logits[0].float()  # [30, vocab]
        while pos < 24:
            T = int(torch.randint(1, 7, (1,), generator=gen))
            toks = ids[0, pos:pos + T].clone()
            wrong = torch.rand(T, generator=gen) < 0.3  # drafted tokens the model rejects
            toks[1:][wrong[1:]] = 1
            got = dec.step(toks, pos)
            ok = 1 + int(torch.cumprod(~wrong[1:], 0).sum())  # the first token is always right
            torch.testing.assert_close(got[:ok], want[pos:pos + ok], rtol=1e-4,
                                       atol=1e-4 * float(want.abs().max()))
            pos, n = pos + ok, n + 1
    assert n < 24  # some steps took several tokens


def test_a_step_takes_at_most_step_max_tokens():
    cm = picompile.compile(_model("llama_relu"), quiet=True)
    dec = cm.decoder()
    dec.reserve(32)
    with pytest.raises(ValueError, match="1 to 8 tokens"):
        dec.step(torch.arange(9) + 3, 0)
    with pytest.raises(IndexError, match="outside"):
        dec.step(torch.arange(4) + 3, dec.max_len - 3)


@pytest.mark.parametrize("arch", ["llama_relu", "qwen2", "qwen3", "phi3", "opt", "gemma2",
                                  "gemma3"])
def test_generate_matches_hugging_face_and_counts_neurons(arch):
    model = _model(arch)
    ref = copy.deepcopy(model)
    cm = picompile.compile(model, quiet=True)
    assert cm.decoder() is not None, cm.decoder_reason
    ids = torch.randint(3, zoo.VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    want = ref.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                        pad_token_id=0)
    cm.reset_stats()
    got = cm.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    ffns = cm.ffns().values()
    # the prompt (7 tokens) and 15 decoder steps, every block counted as per module
    assert all(f.total_pairs == (7 + 15) * f.n_ff for f in ffns)
    decoded = cm.sparsity()
    cm.reset_stats()
    generate(cm._orig_mod, ids, max_new_tokens=16, min_new_tokens=16)  # per module
    assert decoded == pytest.approx(cm.sparsity(), abs=0.02)


@pytest.mark.parametrize("arch", REFUSED)
def test_models_it_does_not_run_are_refused_with_a_reason(arch):
    model = zoo.make(arch)
    ref = copy.deepcopy(model)
    cm = picompile.compile(model, quiet=True)
    assert cm.decoder() is None
    assert cm.decoder_reason
    assert f"whole-step decoder: {cm.decoder_reason}" in picompile.explain(cm)
    ids = torch.randint(3, zoo.VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(cm.generate(ids, **kw), ref.generate(ids, **kw), rtol=0, atol=0)


def test_rope_over_interleaved_pairs_is_refused_also_where_16_bits_hide_it():
    """GLM rotates interleaved pairs: the decoder's rotate-half RoPE is wrong for it. In float32
    the numeric check saw it; in bfloat16 its tolerance let it through (logits off by a fifth of
    their range). A structural check refuses it in every dtype."""
    for dtype in (torch.float32, torch.bfloat16):
        cm = picompile.compile(zoo.make("glm", dtype), quiet=True)
        assert cm.decoder() is None
        assert "interleaved pairs" in cm.decoder_reason, cm.decoder_reason


@pytest.mark.parametrize("arch", ["mistral", "gemma3", "qwen2"])
def test_sliding_windows_past_their_size_match_hugging_face(arch):
    """A window of 4 positions (every layer in Mistral, every other in Gemma 3 and Qwen2), a
    7-token prompt: the prefill's cache holds only the last positions of those layers."""
    config = zoo.hf_config(arch)
    config.sliding_window = 4
    if arch == "qwen2":
        config.use_sliding_window, config.max_window_layers = True, 1
        config.layer_types = ["full_attention", "sliding_attention"]
    torch.manual_seed(0)
    model = _randomized(AutoModelForCausalLM.from_config(config).eval())
    ref = copy.deepcopy(model)
    cm = picompile.compile(model, quiet=True)
    dec = cm.decoder()
    assert dec is not None, cm.decoder_reason
    assert any(layer.window == 4 for layer in dec.layers)
    ids = torch.randint(3, zoo.VOCAB, (1, 7), generator=torch.Generator().manual_seed(8))
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    want = ref.generate(ids, **kw)
    assert torch.equal(cm.generate(ids, **kw), want)


@pytest.mark.parametrize("arch, kv_cache", [("llama_silu", None), ("gemma2", None),
                                           ("gemma3", None), ("qwen3", "float16")])
def test_long_contexts_split_attention_into_chunks(arch, kv_cache):
    """Steps at 700 positions: attention runs in several chunks of positions per KV head, on
    both threads, merged (kernels/decoder.c attention); Gemma 2's capped scores, Gemma 3's
    64-position windows (their chunks start past 0) and a float16 cache among them. The steps
    equal the per-module path's."""
    config = zoo.hf_config(arch, hidden=64)
    config.max_position_embeddings = 1024
    torch.manual_seed(0)
    model = _randomized(AutoModelForCausalLM.from_config(config).eval())
    cm = picompile.compile(model, kv_cache=kv_cache, max_context=1024, quiet=True)
    dec = cm.decoder()
    assert dec is not None, cm.decoder_reason
    ids = torch.randint(3, zoo.VOCAB, (1, 704), generator=torch.Generator().manual_seed(4))
    want, got = _step_logits(cm, dec, ids, prompt=700)
    tol = 1e-4 if kv_cache is None else 0.05
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))


def test_attention_exponentials_equal_torch_exp():
    """The decoder's vectorized exp (kernels/decoder.c exp8, its scalar tail expf) against
    torch.exp over scores down to -100 below their maximum: within 2 ulp (float32), 0 where e^x
    is below float32's normal range, the sum returned within float32 rounding."""
    import ctypes

    from picompile.codegen import decoder as native

    lib = native.load()
    gen = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 100, 4099):  # the 8-lane body and the scalar tail
        s = torch.rand(n, generator=gen) * 100 - 90  # [-90, 10]
        mx = float(s.max())
        want = torch.exp((s - mx).double())  # of the float32 differences, as the kernel takes
        got = s.clone()
        total = lib.pi_decoder_softmax_exp(ctypes.c_void_p(got.data_ptr()), n, mx)
        normal = want >= torch.finfo(torch.float32).tiny
        ulp = torch.finfo(torch.float32).eps * want[normal]
        assert ((got.double()[normal] - want[normal]).abs() <= 2 * ulp).all()
        assert (got[~normal] <= torch.finfo(torch.float32).tiny).all()
        assert abs(total - float(want.sum())) <= 1e-6 * float(want.sum()) + 1e-30


def test_post_norm_opt_is_refused_with_a_reason():
    model = zoo.make("opt")
    model.config.do_layer_norm_before = False
    for layer in model.model.decoder.layers:
        layer.do_layer_norm_before = False
    ref = copy.deepcopy(model)
    cm = picompile.compile(model, quiet=True)
    assert cm.decoder() is None and "post-norm" in cm.decoder_reason
    ids = torch.randint(3, zoo.VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(cm.generate(ids, **kw), ref.generate(ids, **kw), rtol=0, atol=0)


def test_learned_positions_bound_the_positions_a_step_runs():
    cm = picompile.compile(_model("opt"), quiet=True)
    dec = cm.decoder()
    n = cm.config.max_position_embeddings  # OPT's table: positions 0..n-1
    assert dec.reserve(n) and dec.max_len == n
    assert not dec.reserve(n + 1)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # its forward takes HF's older cache name
def test_a_look_alike_is_caught_by_the_numeric_check():
    """Only the verification step tells a model that computes differently with the same modules
    apart; generate then runs per module and matches the model's own."""
    torch.manual_seed(0)
    model = zoo.HalvedLogitsLlama(zoo.hf_config("llama_relu")).eval()
    ref = copy.deepcopy(model)
    cm = picompile.compile(model, quiet=True)
    assert cm.decoder() is None
    assert "differs from the model's forward" in cm.decoder_reason
    ids = torch.randint(3, zoo.VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=6, do_sample=True, top_k=0, temperature=1.0, pad_token_id=0)
    torch.manual_seed(1)
    want = ref.generate(ids, **kw)
    torch.manual_seed(1)
    assert torch.equal(cm.generate(ids, **kw), want)


def test_rebuilt_when_kernels_change():
    model = _model("llama_silu")
    cm = picompile.compile(model, sparsity=0.5, calibration=_calibration(), quiet=True)
    first = cm.decoder()
    assert cm.decoder() is first  # nothing changed: the same binding
    ffn = next(iter(cm.ffns().values()))
    ffn.threshold = 0.0
    second = cm.decoder()
    assert second is not None and second is not first
    cm._orig_mod.to(torch.bfloat16)  # every kernel is selected again for the new tensors
    third = cm.decoder()
    assert third is not None and third is not second, cm.decoder_reason
    ids = torch.randint(3, zoo.VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    want, got = _step_logits(cm, third, ids, prompt=4)
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * float(want.abs().max()))


def test_an_in_place_edit_of_the_rotary_frequencies_is_followed():
    """The RoPE tables are the rotary module's at build time: an edit of its inv_freq buffer
    (a context-extension trick) builds the decoder again, so generate still equals HF's."""
    model = _model("llama_silu")
    ref = copy.deepcopy(model)
    cm = picompile.compile(model, quiet=True)
    first = cm.decoder()
    ids = torch.randint(3, zoo.VOCAB, (1, 6), generator=torch.Generator().manual_seed(8))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    before = cm.generate(ids, **kw)
    for m in (cm._orig_mod, ref):
        m.model.rotary_emb.inv_freq.mul_(0.25)
    assert cm.decoder() is not first
    got = cm.generate(ids, **kw)
    assert torch.equal(got, ref.generate(ids, **kw)) and not torch.equal(got, before)


def test_batches_and_padding_run_per_module():
    model = _model("llama_relu")
    ref = copy.deepcopy(model)
    cm = picompile.compile(model, quiet=True)
    ids = torch.randint(3, zoo.VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, attention_mask=mask)
    torch.testing.assert_close(cm.generate(ids, **kw), ref.generate(ids, **kw), rtol=0, atol=0)


def test_switched_off_the_modules_run_each_step(monkeypatch):
    model = _model("opt")
    ref = copy.deepcopy(model)
    cm = picompile.compile(model, quiet=True)
    assert cm.decoder() is not None, cm.decoder_reason
    monkeypatch.setenv("PICOMPILE_DECODER", "0")
    assert cm.decoder() is None and "PICOMPILE_DECODER=0" in cm.decoder_reason
    ids = torch.randint(3, zoo.VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(cm.generate(ids, **kw), ref.generate(ids, **kw), rtol=0, atol=0)
    monkeypatch.setenv("PICOMPILE_DECODER", "1")
    assert cm.decoder() is not None  # switched on again: built again


def test_reference_forced_has_no_decoder(monkeypatch):
    monkeypatch.setenv("PICOMPILE_REFERENCE", "1")
    cm = picompile.compile(_model("llama_relu"), quiet=True)
    assert cm.decoder() is None
    assert "reference" in cm.decoder_reason


def test_step_refuses_positions_outside_the_cache():
    cm = picompile.compile(_model("llama_relu"), quiet=True)
    dec = cm.decoder()
    dec.reserve(8)
    with pytest.raises(IndexError, match="outside"):
        dec.step(torch.tensor([3]), dec.max_len)


def test_q_k_v_run_in_one_call():
    """q, k and v share their library: the decoder binds pi_dense_multi for the three."""
    cm = picompile.compile(_model("llama_relu"), quiet=True)
    dec = cm.decoder()
    dec.reserve(8)
    assert all(layer.qkv_fn for layer in dec._layers)


def test_key_names_the_bound_kernels():
    cm = picompile.compile(_model("llama_relu"), quiet=True)
    key = Decoder.key(cm._orig_mod)
    lin = cm._orig_mod.model.layers[0].self_attn.q_proj
    lin.select_kernel()  # a new kernel object: pointers may differ
    assert Decoder.key(cm._orig_mod) != key


@pytest.mark.parametrize("arch", ["llama_silu", "opt"])
@pytest.mark.parametrize("dtype", ["float16", torch.bfloat16])
def test_compile_converts_the_weights_and_the_decoder_runs_them(arch, dtype):
    cm = picompile.compile(_model(arch), dtype=dtype, quiet=True)
    want = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    assert {p.dtype for p in cm._orig_mod.parameters()} == {want}
    assert cm.decoder() is not None, cm.decoder_reason
    ids = torch.randint(3, zoo.VOCAB, (1, 10), generator=torch.Generator().manual_seed(6))
    want_logits, got = _step_logits(cm, cm.decoder(), ids, prompt=4)
    torch.testing.assert_close(got, want_logits, rtol=0.05, atol=0.05 * float(want_logits.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_model_caches_keys_and_values_in_its_dtype(dtype):
    """The cache holds what Hugging Face's would (its dtype, rounded to nearest even) where the
    library has the 16-bit path; the first layer's new row equals the float32 cache's, rounded
    (later layers read the rounded cache, so their rows may differ in the last bits)."""
    cm = picompile.compile(_model("llama_silu"), dtype=dtype, quiet=True)
    dec16 = cm.decoder()
    assert dec16.lib.pi_decoder_kv_16bit() == 1  # this machine has AVX2 and F16C
    assert dec16.kv_dtype == dtype
    dec32 = Decoder(cm._orig_mod)
    dec32.kv_dtype = torch.float32
    ids = torch.randint(3, zoo.VOCAB, (1, 9), generator=torch.Generator().manual_seed(7))
    cache = StaticCache(config=cm.config, max_cache_len=16)
    cm._orig_mod(ids[:, :8], **{cache_kwarg(cm._orig_mod): cache}, use_cache=True)
    for dec in (dec16, dec32):
        assert dec.reserve(16)
        dec.load_cache(cache, 8)
        dec.set_threads()
        dec.step(ids[0, 8:], 8)
    assert dec16.k_cache.dtype == dtype and dec32.k_cache.dtype == torch.float32
    torch.testing.assert_close(dec16.k_cache[:, :, :8], dec32.k_cache[:, :, :8].to(dtype),
                               rtol=0, atol=0)  # the prefill's rows, converted on load
    for cache16, cache32 in ((dec16.k_cache, dec32.k_cache), (dec16.v_cache, dec32.v_cache)):
        assert torch.equal(cache16[0, :, 8], cache32[0, :, 8].to(dtype))
    got, want = dec16.logits[0], dec32.logits[0]
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * float(want.abs().max()))


def test_kv_cache_option_gives_a_float32_model_a_16_bit_cache():
    """compile(kv_cache="float16"): the C decoder of a float32 model keeps keys and values in
    float16 (its new rows are the float32 cache's, rounded) and its steps stay within float16's
    tolerance of the float32 cache's; cm.kv_cache_dtype set back to None rebuilds the decoder
    with the model's float32."""
    cm = picompile.compile(_model("llama_silu"), kv_cache="float16", quiet=True)
    dec16 = cm.decoder()
    assert dec16 is not None, cm.decoder_reason
    assert dec16.kv_dtype == torch.float16 and "float16 KV cache" in picompile.explain(cm)
    ids = torch.randint(3, zoo.VOCAB, (1, 12), generator=torch.Generator().manual_seed(8))
    want, got = _step_logits(cm, dec16, ids, prompt=6)
    assert dec16.k_cache.dtype == torch.float16
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * float(want.abs().max()))
    assert not torch.equal(got, want)  # the rounding took effect
    cm.kv_cache_dtype = None
    dec32 = cm.decoder()
    assert dec32 is not dec16 and dec32.kv_dtype == torch.float32
    want, got = _step_logits(cm, dec32, ids, prompt=6)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_kv_cache_option_refuses_other_dtypes():
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        picompile.compile(_model("llama_relu"), kv_cache="int8", quiet=True)
    cm = picompile.compile(_model("llama_relu"), quiet=True)
    cm.kv_cache_dtype = "fp8"
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        cm.decoder()


def test_compile_refuses_other_dtypes():
    with pytest.raises(ValueError, match="dtype must be one of"):
        picompile.compile(_model("llama_relu"), dtype="int8", quiet=True)


def test_keys_past_float16s_range_raise_rather_than_pick_from_nan():
    """kv_cache="float16" on a float32 model whose keys and values reach 1e5 for one token."""
    model = zoo.make("llama_relu", layers=2)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, 0] = 0
        emb[7] = 0
        emb[7, 0] = 1.0
        attn = model.model.layers[0].self_attn
        attn.k_proj.weight[:, 0] = 1.2e4
        attn.v_proj.weight[:, 0] = 1.2e4
    cm = picompile.compile(model, kv_cache="float16", quiet=True)
    assert cm.decoder() is not None, cm.decoder_reason  # the probe's tokens stay in range
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    with pytest.raises(FloatingPointError, match="float16 KV cache"):
        cm.generate(ids, max_new_tokens=4)


@pytest.mark.parametrize("arch", ["llama_silu", "opt", "gemma3"])
def test_short_prompts_prefill_through_the_decoders_steps(arch, monkeypatch):
    """A prompt of STEP_PREFILL_MAX_TOKENS or fewer runs through the C decoder's steps of up
    to 8 tokens (20 tokens: 8, 8, 4), not the model's prefill; the same tokens either way, and
    its neurons counted as a prefill's."""
    cm = picompile.compile(_model(arch, layers=2), quiet=True)
    dec = cm.decoder()
    ids = torch.randint(3, zoo.VOCAB, (1, 20), generator=torch.Generator().manual_seed(6))
    sizes = []
    step = dec.step
    monkeypatch.setattr(dec, "step", lambda t, pos: sizes.append(t.shape[0]) or step(t, pos))
    cm.reset_stats()
    got = cm.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert sizes == [8, 8, 4, 1, 1, 1, 1, 1]
    assert all(f.total_pairs == (20 + 5) * f.n_ff for f in cm.ffns().values())
    sizes.clear()
    dec.forget()
    monkeypatch.setenv("PICOMPILE_STEP_PREFILL", "0")
    want = cm.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert sizes == [1] * 5
    assert torch.equal(got, want)
