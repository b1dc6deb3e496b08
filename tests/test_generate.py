"""picompile's own generate loop (picompile.runtime.generate) against Hugging Face generate."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers import GenerationConfig, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

import picompile
from picompile.runtime.generate import generate, generate_hf, supported
from picompile.runtime.sampling import NUCLEUS_PROBE, FrequencyPresencePenalty, Picker, draw
from tests import zoo

NEW = 12


def _hf(model, ids, mask=None, **kw):
    kw.setdefault("max_new_tokens", NEW)
    kw.setdefault("do_sample", False)
    kw.setdefault("pad_token_id", 0)
    if "eos_token_id" not in kw:
        kw["eos_token_id"] = None
    return model.generate(ids, attention_mask=mask, **kw)


def _prompt(length, seed):
    return torch.randint(3, zoo.VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def _left_padded(rows, pad=0):
    s = max(len(r) for r in rows)
    ids = torch.full((len(rows), s), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), s, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, s - len(r):], mask[i, s - len(r):] = r, 1
    return ids, mask


@pytest.fixture(scope="module", params=zoo.HF_ARCHS)
def arch_model(request):
    return request.param, zoo.make(request.param)


def test_greedy_equals_hf_batch_1(arch_model):
    _, model = arch_model
    ids = _prompt(7, 1)[None]
    assert torch.equal(generate(model, ids, max_new_tokens=NEW), _hf(model, ids))


def test_greedy_equals_hf_left_padded_batch(arch_model):
    """Rows of 5, 9 and 3 tokens, left padded: each row as HF generates it alone, and the
    whole batch as HF generates the same padded batch."""
    _, model = arch_model
    rows = [_prompt(n, 10 + n) for n in (5, 9, 3)]
    ids, mask = _left_padded(rows)
    got = generate(model, ids, mask, max_new_tokens=NEW)
    assert got.shape == (3, ids.shape[1] + NEW)
    assert torch.equal(got[:, : ids.shape[1]], ids)
    for i, r in enumerate(rows):
        assert torch.equal(got[i, ids.shape[1]:], _hf(model, r[None])[0, len(r):]), f"row {i}"
    assert torch.equal(got, _hf(model, ids, mask))


@pytest.mark.parametrize("arch", ["llama_relu", "opt"])
def test_compiled_model_equals_dense_hf(arch):
    dense = zoo.make(arch)
    cm = picompile.compile(copy.deepcopy(dense), quiet=True)
    ids = _prompt(6, 3)[None]
    assert torch.equal(generate(cm._orig_mod, ids, max_new_tokens=NEW), _hf(dense, ids))
    batch, mask = _left_padded([_prompt(4, 4), _prompt(8, 5)])
    assert torch.equal(generate(cm._orig_mod, batch, mask, max_new_tokens=NEW), _hf(dense, batch, mask))
    # cm.generate with HF arguments: picompile's loop once CompiledModel.generate is wired to it
    assert torch.equal(_hf(cm, batch, mask), _hf(dense, batch, mask))
    # penalties act on the logits of the C decoder's steps as on HF's; sampled, the same draws
    # as the loop's on the dense model's per-module steps
    assert cm.decoder() is not None, cm.decoder_reason
    assert torch.equal(_hf(cm, ids, repetition_penalty=1.4),
                       _hf(dense, ids, repetition_penalty=1.4))
    kw = dict(max_new_tokens=NEW, pad_token_id=0, do_sample=True, min_p=0.1, temperature=1.5)
    torch.manual_seed(9)
    got = cm.generate(ids, **kw)
    torch.manual_seed(9)
    assert torch.equal(got, generate_hf(dense, ids, **kw))


@pytest.fixture(scope="module")
def llama():
    return zoo.make("llama_silu")


def _eos_batch(model):
    """A padded batch and an EOS token that its greedy rows reach at different steps."""
    ids, mask = _left_padded([_prompt(5, 20), _prompt(8, 21), _prompt(3, 22)])
    free = generate(model, ids, mask, max_new_tokens=NEW)[:, ids.shape[1]:]
    eos = int(free[0, 2])  # row 0 stops at its third new token (others maybe elsewhere, or never)
    return ids, mask, eos


def test_eos_stops_a_row_and_pads_it(llama):
    ids, mask, eos = _eos_batch(llama)
    got = generate(llama, ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    want = _hf(llama, ids, mask, eos_token_id=eos)
    assert torch.equal(got, want)
    s = ids.shape[1]
    first = (got[0, s:] == eos).nonzero()[0, 0]
    assert first <= 2 and (got[0, s + first + 1:] == 0).all()


def test_eos_list_and_every_row_finished_stops_early(llama):
    ids = _prompt(6, 30)[None]
    free = generate(llama, ids, max_new_tokens=NEW)[0, 6:]
    eos = [95, int(free[3])]
    got = generate(llama, ids, max_new_tokens=NEW, eos_token_id=eos)
    assert got.shape[1] <= 6 + 4 and int(got[0, -1]) == eos[1]
    assert torch.equal(got, _hf(llama, ids, eos_token_id=eos))


def test_min_new_tokens_holds_eos_back(llama):
    ids = _prompt(6, 31)[None]
    eos = int(generate(llama, ids, max_new_tokens=1)[0, -1])  # the very first greedy token
    assert generate(llama, ids, max_new_tokens=NEW, eos_token_id=eos).shape[1] == 7
    got = generate(llama, ids, max_new_tokens=NEW, eos_token_id=eos, min_new_tokens=4)
    assert got.shape[1] >= 6 + 4 and not (got[0, 6:10] == eos).any()
    assert torch.equal(got, _hf(llama, ids, eos_token_id=eos, min_new_tokens=4))
    outside = [eos, llama.config.vocab_size + 5]  # a config's id past the vocabulary: as HF
    got = generate(llama, ids, max_new_tokens=NEW, eos_token_id=outside, min_new_tokens=4)
    assert torch.equal(got, _hf(llama, ids, eos_token_id=outside, min_new_tokens=4))


class _Recorder:
    """The HF streamer protocol: put(ids) for the prompt then each token, end() once."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended += 1


def test_streamer_sees_prompt_then_each_token_like_hf(llama):
    ids = _prompt(6, 32)[None]
    ours, theirs, tokens = _Recorder(), _Recorder(), []
    got = generate(llama, ids, max_new_tokens=NEW, streamer=ours, callback=tokens.append)
    _hf(llama, ids, streamer=theirs)
    assert ours.ended == theirs.ended == 1
    assert len(ours.puts) == len(theirs.puts) == 1 + NEW
    for a, b in zip(ours.puts, theirs.puts):
        assert torch.equal(a, b)
    assert torch.equal(torch.stack(tokens, 1), got[:, 6:])


def test_sampling_is_reproducible_and_degenerates_to_greedy(llama):
    ids, mask = _left_padded([_prompt(5, 40), _prompt(7, 41)])
    greedy = generate(llama, ids, mask, max_new_tokens=NEW)
    kw = dict(max_new_tokens=NEW, do_sample=True, temperature=1.3)
    a = generate(llama, ids, mask, seed=7, **kw)
    assert torch.equal(a, generate(llama, ids, mask, seed=7, **kw))
    assert not torch.equal(a, generate(llama, ids, mask, seed=8, **kw))
    assert not torch.equal(a, greedy)
    assert torch.equal(generate(llama, ids, mask, seed=1, top_k=1, **kw), greedy)
    assert torch.equal(generate(llama, ids, mask, seed=1, top_p=1e-6, **kw), greedy)


WARPS = [dict(temperature=0.7, top_k=20, top_p=0.9), dict(temperature=1.4, top_k=40, min_p=0.05),
         dict(top_p=0.5), dict(top_p=0.0), dict(top_k=3000, top_p=0.99), dict(min_p=0.2),
         dict(temperature=0.3, top_p=0.8, min_p=0.1)]


PEAKED = [dict(top_p=0.9), dict(temperature=0.8, top_p=0.95, min_p=0.05), dict(top_p=0.3)]


@pytest.mark.parametrize("kw, scale", [(kw, 3.0) for kw in WARPS] + [(kw, 9.0) for kw in PEAKED])
def test_warped_scores_equal_hfs_warpers(kw, scale):
    """The distribution sampled from: HF's warpers' scores, exactly (the -inf included), over
    logits of a 32k vocabulary (tied scores at the top-p boundary may fall either way: the
    order of equal values is the sort's). Peaked logits (scale 9) put the nucleus among the
    likeliest NUCLEUS_PROBE tokens, which top-p without top-k then reads alone."""
    from transformers.generation import logits_process as lp

    g = torch.Generator().manual_seed(len(str(kw)))
    scores = torch.randn(3, 32000, generator=g) * scale
    if kw in PEAKED:
        _, index = Picker(do_sample=True, **kw).candidates(scores.clone())
        assert index is not None and index.shape[1] == NUCLEUS_PROBE
    hf = [lp.TemperatureLogitsWarper(kw["temperature"])] if "temperature" in kw else []
    hf += [lp.TopKLogitsWarper(kw["top_k"])] if "top_k" in kw else []
    hf += [lp.TopPLogitsWarper(kw["top_p"])] if "top_p" in kw else []
    hf += [lp.MinPLogitsWarper(kw["min_p"])] if "min_p" in kw else []
    want = LogitsProcessorList(hf)(None, scores.clone())
    got = Picker(do_sample=True, **kw).warp(scores.clone())
    assert torch.equal(torch.isinf(got), torch.isinf(want)), kw
    assert torch.equal(got[~torch.isinf(got)], want[~torch.isinf(want)])


def test_top_k_keeps_the_tokens_tied_with_its_kth_as_hf_does():
    from transformers.generation import logits_process as lp

    scores = (torch.randn(2, 5000, generator=torch.Generator().manual_seed(1)) * 2).round()
    want = lp.TopKLogitsWarper(20)(None, scores.clone())
    got = Picker(do_sample=True, top_k=20, min_p=0.0).warp(scores.clone())
    assert (torch.isfinite(got).sum(-1) > 20).any()  # ties with the 20th kept (in a row)
    assert torch.equal(got, want)


def test_draws_follow_the_distribution_and_never_pick_a_zero():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    g = torch.Generator().manual_seed(0)
    picks = torch.stack([draw(probs, g) for _ in range(20000)])  # [n, 2]
    freq = torch.bincount(picks[:, 0], minlength=6).float() / len(picks)
    assert (freq[probs[0] == 0] == 0).all() and (picks[:, 1] == 5).all()
    assert torch.allclose(freq, probs[0], atol=0.015), freq  # 4.7 sigma at n = 20000
    again = torch.Generator().manual_seed(0)
    assert torch.equal(torch.stack([draw(probs, again) for _ in range(50)]), picks[:50])


def test_repetition_penalty_equals_hf_greedy_and_left_padded(llama):
    """HF's penalty over the prompt and the reply, skipping each row's left padding."""
    ids, mask = _left_padded([_prompt(5, 60), _prompt(9, 61), _prompt(3, 62)])
    free = generate(llama, ids, mask, max_new_tokens=NEW)
    for penalty in (1.5, 0.7):
        got = generate(llama, ids, mask, max_new_tokens=NEW, repetition_penalty=penalty)
        assert torch.equal(got, _hf(llama, ids, mask, repetition_penalty=penalty)), penalty
        assert not torch.equal(got, free), penalty  # the penalty acted
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        generate(llama, ids, mask, max_new_tokens=NEW, repetition_penalty=0.0)


def test_min_p_of_one_is_greedy_and_out_of_range_refused(llama):
    ids = _prompt(6, 63)[None]
    assert torch.equal(generate(llama, ids, max_new_tokens=NEW, do_sample=True, seed=2,
                                min_p=1.0), generate(llama, ids, max_new_tokens=NEW))
    with pytest.raises(ValueError, match="min_p must be in"):
        generate(llama, ids, max_new_tokens=NEW, do_sample=True, min_p=1.5)


def test_logits_processors_run_as_hfs_do(llama):
    """A caller's processor (OpenAI's penalties, serve's) sees the prompt and reply so far, in
    HF's generate and in the loop alike, after the repetition penalty."""
    ids, mask = _left_padded([_prompt(4, 64), _prompt(7, 65)])
    free = generate(llama, ids, mask, max_new_tokens=NEW)
    penalties = FrequencyPresencePenalty(ids.shape[1], frequency=1.5, presence=2.0)
    got = generate(llama, ids, mask, max_new_tokens=NEW, logits_processor=[penalties],
                   repetition_penalty=1.1)
    want = _hf(llama, ids, mask, logits_processor=LogitsProcessorList([penalties]),
               repetition_penalty=1.1)
    assert torch.equal(got, want) and not torch.equal(got, free)
    assert supported(llama, dict(input_ids=ids, logits_processor=[penalties])) is None
    assert torch.equal(generate_hf(llama, ids, attention_mask=mask, max_new_tokens=NEW,
                                   pad_token_id=0, logits_processor=[penalties],
                                   repetition_penalty=1.1), want)


def test_frequency_presence_penalty_counts_the_reply_only():
    """Against a loop over the reply's tokens (OpenAI's definition)."""
    ids = torch.tensor([[5, 5, 7, 1, 1, 1, 2], [3, 4, 5, 6, 6, 0, 9]])  # prompts of 3, replies of 4
    scores = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    got = FrequencyPresencePenalty(3, frequency=0.5, presence=0.25)(ids, scores.clone())
    want = scores.clone()
    for b in range(2):
        reply = ids[b, 3:].tolist()
        for t in set(reply):
            want[b, t] -= 0.5 * reply.count(t) + 0.25
    assert torch.allclose(got, want)
    assert torch.equal(FrequencyPresencePenalty(7, 1.0, 1.0)(ids, scores.clone()), scores)


@pytest.mark.parametrize("kw", [dict(repetition_penalty=0.0), dict(repetition_penalty=2),
                                dict(do_sample=True, top_k=-1), dict(do_sample=True, min_p=1.5),
                                dict(do_sample=True, top_k=1.5), dict(min_new_tokens=2.5),
                                dict(max_new_token=5)])
def test_values_hf_refuses_are_left_to_hfs_error(llama, kw):
    ids = _prompt(5, 67)[None]
    reason = supported(llama, dict(input_ids=ids, max_new_tokens=3, **kw))
    assert reason is not None and reason.startswith("invalid arguments"), reason
    with pytest.raises(ValueError):
        llama.generate(ids, max_new_tokens=3, **kw)


def test_a_top_p_of_one_or_more_is_no_warper_as_in_hf(llama):
    ids = _prompt(5, 68)[None]
    kw = dict(max_new_tokens=NEW, do_sample=True, top_p=1.5, pad_token_id=0)
    assert supported(llama, dict(input_ids=ids, **kw)) is None
    torch.manual_seed(4)
    want = generate_hf(llama, ids, **dict(kw, top_p=1.0))
    torch.manual_seed(4)
    assert torch.equal(generate_hf(llama, ids, **kw), want)


def test_a_models_repetition_penalty_default_runs_the_loop(llama):
    """Qwen2.5's generation_config sets repetition_penalty=1.05: such a model's calls run
    picompile's loop (they fell back to HF's generate), with HF's tokens."""
    model = copy.deepcopy(llama)
    model.generation_config = GenerationConfig(repetition_penalty=1.6, pad_token_id=0)
    ids = _prompt(6, 66)[None]
    assert supported(model, dict(input_ids=ids, max_new_tokens=NEW)) is None
    got = generate_hf(model, ids, max_new_tokens=NEW)
    assert torch.equal(got, model.generate(ids, max_new_tokens=NEW))
    assert not torch.equal(got, generate(llama, ids, max_new_tokens=NEW))


@pytest.mark.filterwarnings("ignore:Using the model-agnostic default")
def test_hf_arguments_and_generation_config_defaults(llama):
    ids, mask = _left_padded([_prompt(5, 50), _prompt(7, 51)])
    eos = int(generate(llama, ids, mask, max_new_tokens=NEW)[1, -5])
    model = copy.deepcopy(llama)
    model.generation_config = GenerationConfig(max_new_tokens=9, eos_token_id=eos, pad_token_id=0)
    for kw in ({}, {"generation_config": GenerationConfig(max_new_tokens=4, pad_token_id=0)},
               {"max_length": 10}, {"min_new_tokens": 3}):
        call = dict(input_ids=ids, attention_mask=mask, **kw)
        assert supported(model, call) is None, kw
        assert torch.equal(generate_hf(model, **call), model.generate(**call)), kw
    # positional input_ids, HF's default of 20 new tokens, a mask inferred from pad tokens
    plain = copy.deepcopy(llama)
    plain.generation_config = GenerationConfig(pad_token_id=0)
    assert supported(plain, {}, (ids,)) is None
    assert torch.equal(generate_hf(plain, ids), plain.generate(ids))


@pytest.mark.parametrize("kw,name", [
    (dict(num_beams=2), "num_beams"), (dict(do_sample=True, typical_p=0.5), "typical_p"),
    (dict(logits_processor=LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.2)])),
     "a logits_processor of a kind generate builds"),
    (dict(output_scores=True, return_dict_in_generate=True), "output_scores"),
    (dict(return_dict_in_generate=True), "return_dict_in_generate"),
    (dict(do_sample=True, num_return_sequences=2), "num_return_sequences"),
    (dict(no_repeat_ngram_size=2), "no_repeat_ngram_size"),
    (dict(stop_strings=["x"]), "stop_strings"),
    (dict(position_ids=torch.arange(4)[None]), "position_ids"),  # (token_type_ids: HF refuses)
])
def test_unsupported_arguments_are_named(llama, kw, name):
    ids = torch.ones(1, 4, dtype=torch.long)
    reason = supported(llama, dict(input_ids=ids, max_new_tokens=3, **kw))
    assert reason is not None and reason.startswith(name), reason


def test_unsupported_models_and_inputs_are_named(llama):
    ids = torch.ones(1, 4, dtype=torch.long)
    tiny = zoo.make("tiny_gated_relu")
    assert "not a Hugging Face generative model" in supported(tiny, {"input_ids": ids})
    assert "inputs_embeds" in supported(llama, {"inputs_embeds": torch.zeros(1, 4, 32)})
    model = copy.deepcopy(llama)
    model.generation_config.no_repeat_ngram_size = 3  # a model default the loop does not apply
    assert supported(model, {"input_ids": ids}).startswith("no_repeat_ngram_size")
    with pytest.raises(TypeError, match="not a Hugging Face"):
        generate(zoo.make("tiny_plain_relu"), ids, max_new_tokens=2)


def test_a_call_hf_refuses_gets_hfs_error_without_a_note_and_an_empty_prompt_is_named(capsys):
    cm = picompile.compile(zoo.make("llama_relu"), quiet=True)
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="max_new_tokens"):
        cm.generate(ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="max_length"):  # <= the prompt
        cm.generate(ids, max_length=3)
    with pytest.raises(ValueError, match="max_new_token"):  # a typo
        cm.generate(ids, max_new_token=3)
    with pytest.raises(RuntimeError, match="Long, Int"):  # ids as floats
        cm.generate(ids.float(), max_new_tokens=3)
    assert "picompile's loop does not handle" not in capsys.readouterr().err
    # what HF takes as well as ints (5.0 new tokens, a float or tensor EOS id) runs as in HF
    ref = cm._orig_mod
    for kw in (dict(max_new_tokens=5.0), dict(max_new_tokens=5, eos_token_id=2.0),
               dict(max_new_tokens=5, eos_token_id=torch.tensor([2]))):
        torch.testing.assert_close(cm.generate(ids, **kw), ref.generate(ids, **kw), rtol=0,
                                   atol=0)
    with pytest.raises(ValueError, match=r"\(1, 0\) has no tokens"):
        cm.generate(torch.ones(1, 0, dtype=torch.long), max_new_tokens=3)


def test_generating_past_the_context_is_noted(llama, capsys):
    limit = llama.config.max_position_embeddings
    ids = _prompt(limit - 2, 5)[None]
    generate_hf(llama, ids, max_new_tokens=4, do_sample=False)
    assert f"more than the model's context of {limit}" in capsys.readouterr().err
    generate_hf(llama, ids, max_new_tokens=2, do_sample=False)
    assert "context" not in capsys.readouterr().err


def test_alibi_falcon_is_generated_by_hf():
    """Falcon with ALiBi sizes its biases by a dynamic cache's length (with a static cache its
    forward fails): HF's generate runs it, with HF's tokens."""
    config = zoo.hf_config("falcon")
    config.alibi = True
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    cm = picompile.compile(copy.deepcopy(model), quiet=True)
    ids = _prompt(9, 3)[None]
    kw = dict(max_new_tokens=12, do_sample=False)
    assert "ALiBi" in supported(cm._orig_mod, kw, (ids,))
    assert torch.equal(cm.generate(ids, **kw), model.generate(ids, **kw))


@pytest.mark.parametrize("arch", ["gpt2", "opt"])
def test_generating_past_learned_positions_is_refused_before_it_starts(arch):
    """A learned position table has no row past its last (HF's generate fails there with an
    IndexError from the embedding): refused up front, saying how many new tokens fit."""
    model = zoo.make(arch)
    limit = model.config.max_position_embeddings
    ids = _prompt(limit - 3, 5)[None]
    with pytest.raises(ValueError, match=f"more than the model's {limit} learned positions.*"
                                         "at most 3 new tokens"):
        generate_hf(model, ids, max_new_tokens=4, do_sample=False)
    assert generate_hf(model, ids, max_new_tokens=3, do_sample=False).shape[1] == limit
    with pytest.raises(ValueError, match=f"the prompt alone has {limit + 1} tokens"):
        generate_hf(model, _prompt(limit + 1, 5)[None], max_new_tokens=1, do_sample=False)


def test_padding_hf_warns_of_is_noted(llama, capsys):
    """As HF's generate warns (its tokens are the same): a batch padded on the right, and a batch
    without attention_mask whose padding cannot be told from text; nothing for one row or a
    left-padded batch."""
    rows = [_prompt(5, 1), _prompt(3, 2)]
    left, mask = _left_padded(rows)
    right = torch.stack([torch.cat([r, r.new_zeros(5 - len(r))]) for r in rows])
    right_mask = (torch.arange(5) < torch.tensor([[5], [3]])).long()
    cases = [(dict(input_ids=right, attention_mask=right_mask, pad_token_id=0), "right padding"),
             (dict(input_ids=left, pad_token_id=2, eos_token_id=2), "pad token is the EOS token"),
             (dict(input_ids=left, attention_mask=mask, pad_token_id=0), None),
             (dict(input_ids=left[:1], eos_token_id=2), None)]
    for kw, said in cases:
        generate_hf(llama, max_new_tokens=2, do_sample=False, **kw)
        err = capsys.readouterr().err
        assert ("padd" in err) == (said is not None) and (said or "") in err, (kw, err)


def test_two_threads_generating_at_once_get_what_each_gets_alone():
    """generate() from two threads: the compiled model's decoder (one KV cache, grown as a
    generation needs) serves one at a time, so each thread gets the tokens it gets alone (a
    growth by one thread under the other's step crashed or garbled the other)."""
    import threading

    model = zoo.make("llama_relu", hidden=64, n_ff=256, layers=2)
    model.config.max_position_embeddings = 4096
    cm = picompile.compile(model, quiet=True)
    prompts = [torch.randint(3, zoo.VOCAB, (1, 4), generator=torch.Generator().manual_seed(k))
               for k in range(2)]
    lengths = [(40, 200, 70), (150, 30, 260)]  # each longer than the cache the other left
    want = [[cm.generate(p, max_new_tokens=n, do_sample=False) for n in ns]
            for p, ns in zip(prompts, lengths)]
    got, errors = [[], []], []

    def run(k):
        try:
            for n in lengths[k]:
                got[k].append(cm.generate(prompts[k], max_new_tokens=n, do_sample=False))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for k in range(2):
        assert all(torch.equal(g, w) for g, w in zip(got[k], want[k], strict=True))


def test_a_longrope_model_crossing_its_original_context_runs_hf_generate():
    """Phi-3 128k's LongRoPE rotates with other factors past original_max_position_embeddings,
    and its generate computes the cache again there: a call that crosses it goes to HF's
    generate (the same tokens; picompile's loop kept the short factors' keys and differed), one
    that starts past it runs picompile's loop."""
    import transformers as T

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
            "long_factor": [float(1 + i) for i in range(8)], "original_max_position_embeddings": 64}
    config = T.Phi3Config(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=160,
                          max_position_embeddings=256, original_max_position_embeddings=64,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2, rope_parameters=rope)
    torch.manual_seed(0)
    dense = T.Phi3ForCausalLM(config).eval()
    with torch.no_grad():  # larger weights: the factors change the greedy tokens
        for p in dense.parameters():
            if p.dim() == 2:
                p.mul_(2.0)
    cm = picompile.compile(copy.deepcopy(dense), quiet=True)
    crossing = torch.randint(3, 256, (1, 60), generator=torch.Generator().manual_seed(60))
    assert "LongRoPE" in supported(cm._orig_mod, dict(max_new_tokens=NEW), (crossing,))
    assert torch.equal(cm.generate(crossing, max_new_tokens=NEW, do_sample=False),
                       _hf(dense, crossing, eos_token_id=None))
    past = torch.randint(3, 256, (1, 70), generator=torch.Generator().manual_seed(70))
    assert supported(cm._orig_mod, dict(max_new_tokens=NEW), (past,)) is None
    assert torch.equal(cm.generate(past, max_new_tokens=NEW, do_sample=False),
                       _hf(dense, past, eos_token_id=None))


def test_a_tiny_temperature_decodes_greedily():
    model = zoo.make("llama_relu")
    ids = torch.randint(3, zoo.VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    greedy = generate(model, ids, max_new_tokens=5)
    for t in (1e-6, 1e-300):  # 1e-300 is 0 in float32: the logits / t would be nan
        assert torch.equal(generate(model, ids, max_new_tokens=5, do_sample=True,
                                    temperature=t, seed=1), greedy)
