"""Prompt lookup decoding (runtime/lookup.py, the loop in runtime/generate.py): drafts from the
text so far, checked by the C decoder's steps of several tokens. The tokens are those of
decoding one at a time: greedy, sampled with a seed, with penalties and an end token in the
middle of a draft; each greedy token is the model's own argmax for its prefix."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import picompile
from picompile.runtime.lookup import RETRY_AFTER, PromptLookup
from tests import zoo

# ---- the drafts -------------------------------------------------------------------------------


def test_a_guess_is_what_followed_the_latest_earlier_occurrence_of_the_suffix():
    look = PromptLookup([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2], max_draft=7)
    assert look.guess(10) == [3, 5, 7, 1, 2]  # after the latest "1 2" (not the first's "3 4")
    assert look.guess(2) == [3, 5]  # the caller's limit
    assert PromptLookup([1, 2, 9, 1, 2], max_draft=1).guess(10) == [9]
    look.extend([3])  # "2 3" and "1 2 3": the longest suffix, 3 tokens, wins
    assert look.guess(10) == [5, 7, 1, 2, 3]


def test_no_guess_without_an_earlier_occurrence_of_two_tokens():
    look = PromptLookup([5, 6, 7, 8, 6], max_draft=4)
    assert look.guess(4) == []  # "6" occurred before, but one token is too weak a cue
    assert PromptLookup([], max_draft=4).guess(4) == []


REPEATING = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]  # guess: 3 4 5 6 7 8 9


def test_cheap_steps_of_several_tokens_draft_the_whole_guess():
    look = PromptLookup(REPEATING, max_draft=7)
    flat = {t: 0.010 for t in range(1, 9)}  # memory-bound: T tokens cost one
    assert look.draft(10, flat) == [3, 4, 5, 6, 7, 8, 9]
    assert look.draft(3, flat) == [3, 4, 5]


def test_costly_steps_draft_only_what_pays():
    look = PromptLookup(REPEATING, max_draft=7)
    linear = {t: 0.010 * t for t in range(1, 9)}  # compute-bound: no gain from a step of T
    assert look.draft(10, linear) == []
    look.accepted(6, 6)  # a reply that repeats: drafts are taken
    look.accepted(6, 6)
    curve = {t: 0.010 * (1 + 0.45 * (t - 1)) for t in range(1, 9)}  # this VM's SmolLM2 steps
    long = look.draft(10, curve)
    assert len(long) >= 4
    for _ in range(6):  # drafts not taken: shorter ones, then none
        look.accepted(4, 0)
    assert len(look.draft(10, curve)) < len(long)
    for _ in range(20):
        look.accepted(2, 0)
    tries = [look.draft(10, curve) for _ in range(2 * RETRY_AFTER)]
    assert tries.count([]) == 2 * RETRY_AFTER - 2  # every RETRY_AFTER-th: one token, its
    assert tries[RETRY_AFTER - 1] == tries[-1] == [3]  # step timed again


def test_nothing_is_drafted_before_a_step_was_timed():
    look = PromptLookup(REPEATING, max_draft=7)
    assert look.draft(10, {}) == []
    assert len(look.draft(10, {1: 0.01})) > 0  # untimed sizes: a hopeful guess, tried once


def test_only_checked_drafted_tokens_count():
    look = PromptLookup([], max_draft=7)
    look.accepted(7, 2)  # the third was not taken: the four after it were never checked
    assert look.checked == 2 + 3 and look.taken == 1 + 2


def test_max_draft_must_be_positive():
    with pytest.raises(ValueError, match="at least one"):
        PromptLookup([1, 2], max_draft=0)


# ---- generation -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_pair():
    """A tiny Llama whose greedy replies repeat themselves (so drafts are taken), compiled, and
    its uncompiled twin."""
    model = zoo.make("llama_silu", layers=2)
    ref = copy.deepcopy(model)
    cm = picompile.compile(model, quiet=True)
    assert cm.decoder() is not None, cm.decoder_reason
    return cm, ref


def _prompt(seed: int, n: int = 40) -> torch.Tensor:
    half = torch.randint(3, zoo.VOCAB, (1, n // 2), generator=torch.Generator().manual_seed(seed))
    return torch.cat([half, half], 1)  # a repeated half: something to look up from the start


class _Counting:
    """Counts the tokens each decoder step runs (wraps the bound decoder's step), and keeps its
    step costs flat (as a memory-bound model's), so that what is drafted does not depend on the
    machine's timing."""

    def __init__(self, dec):
        self.dec, self.step, self.sizes = dec, dec.step, []
        dec.step = self
        dec.step_seconds.update({t: 1e-3 for t in range(1, dec.step_max + 1)})

    def __call__(self, tokens, pos):
        self.sizes.append(tokens.shape[0])
        logits = self.step(tokens, pos)
        self.dec.step_seconds.update({t: 1e-3 for t in range(1, self.dec.step_max + 1)})
        return logits

    def close(self):
        del self.dec.step  # the class's method again


def _run(cm, ids, lookup: int, **kw):
    counting = _Counting(cm.decoder())
    try:
        out = cm.generate(ids, max_new_tokens=40, pad_token_id=0, prompt_lookup_num_tokens=lookup
                          or None, **kw)
    finally:
        counting.close()
    return out, counting.sizes


@pytest.mark.parametrize("kw", [
    dict(do_sample=False),
    dict(do_sample=True, temperature=0.2, top_k=2, seed=3),
    dict(do_sample=False, repetition_penalty=1.02),
    dict(do_sample=False, min_new_tokens=30, eos_token_id=[5, 7]),
], ids=["greedy", "sampled", "repetition_penalty", "min_new_tokens"])
def test_the_tokens_are_those_of_one_at_a_time(model_pair, kw):
    cm, _ = model_pair
    seed = kw.pop("seed", None)
    ids = _prompt(1)
    if seed is not None:
        torch.manual_seed(seed)
    want, sizes = _run(cm, ids, 0, **kw)
    assert set(sizes) == {1}
    if seed is not None:
        torch.manual_seed(seed)
    got, sizes = _run(cm, ids, 7, **kw)
    assert torch.equal(got, want)
    assert max(sizes) > 1  # drafts were run
    assert len(sizes) < want.shape[1] - ids.shape[1] - 1  # in fewer steps


def test_an_end_token_inside_a_draft_ends_the_reply_there(model_pair):
    cm, _ = model_pair
    ids = _prompt(1)
    plain, _ = _run(cm, ids, 0, do_sample=False)
    reply = plain[0, ids.shape[1]:].tolist()
    end = reply[len(reply) // 2]  # a token the reply repeats: drafts run over it
    want, _ = _run(cm, ids, 0, do_sample=False, eos_token_id=end)
    got, sizes = _run(cm, ids, 7, do_sample=False, eos_token_id=end)
    assert torch.equal(got, want)
    assert got[0, -1] == end


def test_neuron_counts_cover_every_token_a_step_ran(model_pair):
    cm, _ = model_pair
    cm.reset_stats()
    _, sizes = _run(cm, _prompt(2), 7, do_sample=False)
    prompt = _prompt(2).shape[1]
    for ffn in cm.ffns().values():
        assert ffn.total_pairs == (prompt + sum(sizes)) * ffn.n_ff


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), n=st.integers(2, 20), lookup=st.integers(1, 9))
def test_each_greedy_token_is_the_models_argmax_for_its_prefix(model_pair, seed, n, lookup):
    """Checked against the uncompiled model's forward over the whole reply (ties within
    float rounding allowed): what the drafts let through is the model's own choice."""
    cm, ref = model_pair
    ids = _prompt(seed, 2 * n)
    out = cm.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0,
                      prompt_lookup_num_tokens=lookup)
    with torch.no_grad():
        logits = ref(out).logits[0, ids.shape[1] - 1:-1].float()  # [new tokens, vocab]
    picked = logits.gather(1, out[0, ids.shape[1]:, None])[:, 0]
    tol = 1e-4 * float(logits.abs().max())
    assert bool((picked >= logits.max(1).values - tol).all())


def test_prompt_lookup_is_ignored_where_steps_run_one_token(model_pair):
    """The per-module path (PICOMPILE_DECODER off) decodes one token a step: same tokens."""
    cm, _ = model_pair
    ids = _prompt(3)
    want = cm.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
    from picompile.runtime.generate import generate

    got = generate(cm._orig_mod, ids, max_new_tokens=16, prompt_lookup=5)  # no decoder given
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="prompt_lookup"):
        generate(cm._orig_mod, ids, max_new_tokens=4, prompt_lookup=-1)


def test_predicted_mode_drafts_and_gives_the_same_tokens():
    """A step of several tokens reads the rows of the union of their predicted neurons once,
    and each token uses its own predicted ones: the tokens of a step of its own."""
    from tests.test_decoder import _compile_kw

    cm = picompile.compile(zoo.make("llama_silu", layers=2), **_compile_kw("predicted"))
    assert cm.decoder() is not None
    assert all(ffn.predictor.enabled for ffn in cm.ffns().values())
    want, _ = _run(cm, _prompt(1), 0, do_sample=False)
    out, sizes = _run(cm, _prompt(1), 7, do_sample=False)
    assert max(sizes) > 1 and torch.equal(out, want)


def test_a_call_that_says_0_turns_the_models_default_off(model_pair):
    cm, _ = model_pair
    cm.prompt_lookup = 7
    try:
        _, sizes = _run(cm, _prompt(1), 0)  # prompt_lookup_num_tokens=None: the default, 7
        assert max(sizes) > 1
        counting = _Counting(cm.decoder())
        try:
            cm.generate(_prompt(1), max_new_tokens=40, pad_token_id=0, prompt_lookup_num_tokens=0)
        finally:
            counting.close()
        assert set(counting.sizes) == {1}
    finally:
        cm.prompt_lookup = 0


class _Stop(Exception):
    pass


class _StopAfter:
    """A streamer that ends the reply (as a stop string does) after n new tokens."""

    def __init__(self, n):
        self.n, self.calls = n, -1  # the first call carries the prompt

    def put(self, value):
        self.calls += 1
        if self.calls == self.n:
            raise _Stop

    def end(self):
        pass


def test_a_reply_ended_early_counts_its_own_neurons(model_pair):
    cm, _ = model_pair
    ids = _prompt(4)
    cm.decoder().forget()  # no prompt cache: every prompt token counted by this call
    cm.reset_stats()
    counting = _Counting(cm.decoder())
    try:
        with pytest.raises(_Stop):
            cm.generate(ids, max_new_tokens=40, pad_token_id=0, streamer=_StopAfter(20),
                        prompt_lookup_num_tokens=7)
    finally:
        counting.close()
    for ffn in cm.ffns().values():
        assert ffn.total_pairs == (ids.shape[1] + sum(counting.sizes)) * ffn.n_ff
