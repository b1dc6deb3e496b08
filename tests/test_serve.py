"""picompile's OpenAI-compatible server (picompile/serve.py), run for real: uvicorn on a free
localhost port in a background thread, the fixture model (tests/fixtures/relu_llama, no chat
template) compiled, and the official `openai` client (httpx for requests it would not send)."""

from __future__ import annotations

import contextlib
import copy
import json
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import picompile
from picompile.conversation import DEFAULT_FORMAT_STOP, default_chat_format, end_tokens
from picompile.runtime.sampling import FrequencyPresencePenalty, RecentRepetitionPenalty
from picompile.serve import make_app

uvicorn = pytest.importorskip("uvicorn")

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "relu_llama"
PROMPT = "The built-in function len"
KEY = "sekret-key"


@pytest.fixture(scope="module")
def model():
    dense = AutoModelForCausalLM.from_pretrained(FIXTURE, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(FIXTURE, local_files_only=True)
    return picompile.compile(dense, quiet=True), tok


@contextlib.contextmanager
def running(app):
    """The app served by uvicorn on a free 127.0.0.1 port -> its base URL; stopped after."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY, as uvicorn's own socket
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        sock.close()


class Paced:
    """The compiled model generating at most one token per `delay` seconds: slow enough for a
    test to see a request running, queue others behind it, or leave in the middle of it."""

    def __init__(self, cm, delay: float):
        self.cm, self.delay = cm, delay

    def __getattr__(self, name):  # config, generation_config: the model's
        return getattr(self.cm, name)

    def generate(self, *args, streamer, **kwargs):
        return self.cm.generate(*args, streamer=_SlowStreamer(streamer, self.delay), **kwargs)


class _SlowStreamer:
    def __init__(self, inner, delay):
        self.inner, self.delay = inner, delay

    def put(self, value):
        time.sleep(self.delay)
        self.inner.put(value)

    def end(self):
        self.inner.end()


@pytest.fixture(scope="module")
def url(model):
    with running(make_app(*model)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def reference(model, prompt_ids, n):
    """cm.generate's own greedy continuation, as text, and its token count."""
    cm, tok = model
    out = cm.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)
    new = out[0, len(prompt_ids):].tolist()
    return tok.decode(new, skip_special_tokens=True), len(new)


def wait_for(url, predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{url}/health").json()
        if predicate(health):
            return health
        assert time.monotonic() < deadline, f"timed out waiting; /health says {health}"
        time.sleep(0.02)


def wait_until_serving(proc, url, timeout=90.0):
    """Until the server process `proc` answers on `url`/health (it loads and compiles first)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.communicate()[0]
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health").status_code == 200:
                return
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)


def assert_openai_error(response, status=None):
    assert 400 <= response.status_code < 600, response.status_code
    if status is not None:
        assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in response.text
    return error


# ---- what the client sees ------------------------------------------------------------------


def test_models_and_health(client, url):
    assert [m.id for m in client.models.list().data] == ["relu_llama"]
    assert client.models.retrieve("relu_llama").id == "relu_llama"
    assert httpx.get(f"{url}/v1/models/").json()["data"][0]["id"] == "relu_llama"
    assert assert_openai_error(httpx.get(f"{url}/v1/models/gpt-4"), 404)["code"] == "model_not_found"
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "running": 0, "waiting": 0,
                                                 "max_queue": 16}


def test_completion_greedy_equals_generate(client, model):
    """Through the server (temperature 0) the same text and token count as cm.generate."""
    ids = model[1](PROMPT)["input_ids"]
    want, n = reference(model, ids, 20)
    r = client.completions.create(model="relu_llama", prompt=PROMPT, max_tokens=20, temperature=0)
    assert r.object == "text_completion" and r.model == "relu_llama"
    assert r.choices[0].text == want and want.strip()
    assert r.choices[0].finish_reason == ("length" if n == 20 else "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), n)
    assert r.usage.total_tokens == len(ids) + n
    # token ids as the prompt: the same continuation
    r2 = client.completions.create(model="x", prompt=ids, max_tokens=20, temperature=0)
    assert r2.choices[0].text == want


def test_chat_greedy_uses_default_format_and_equals_generate(client, model):
    """No chat template in the fixture: "role: content" lines, then "assistant:"."""
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "What does len return?"}]
    prompt = "system: Answer briefly.\nuser: What does len return?\nassistant:"
    assert default_chat_format(messages) == prompt
    ids = model[1](prompt)["input_ids"]
    want, _ = reference(model, ids, 24)
    r = client.chat.completions.create(model="relu_llama", messages=messages, max_tokens=24,
                                       temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.split(DEFAULT_FORMAT_STOP)[0]
    assert r.usage.prompt_tokens == len(ids) and 1 <= r.usage.completion_tokens <= 24


def test_a_conversation_sent_again_prefills_only_its_new_message(client, model):
    cm, tok = model
    messages = [{"role": "user", "content": "What does len return?"}]
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=8,
                                           temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And sorted?"}]
    second = client.chat.completions.create(model="m", messages=messages, max_tokens=8,
                                            temperature=0)
    assert cm.decoder().prompt_reused >= first.usage.prompt_tokens  # the first prompt at least
    ids = tok(default_chat_format(messages))["input_ids"]
    assert second.choices[0].message.content == reference(model, ids, 8)[0].split(
        DEFAULT_FORMAT_STOP)[0]


def test_chat_streaming_matches_non_streaming(client):
    kw = dict(model="relu_llama", messages=[{"role": "user", "content": "Tell me about lists"}],
              max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_completion_streaming_sse_format(url, client):
    """The raw events: data lines of text_completion chunks, then `data: [DONE]`."""
    body = {"model": "relu_llama", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    whole = client.completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=0)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole.choices[0].text
    assert chunks[-1]["choices"][0]["finish_reason"] == whole.choices[0].finish_reason


def test_stop_strings_cut_the_reply(client):
    full = client.completions.create(model="m", prompt=PROMPT, max_tokens=20,
                                     temperature=0).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert len(stop) == 3
    want = full[: full.index(stop)]
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=20, temperature=0,
                                  stop=[stop, "never appears"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    streamed = client.completions.create(model="m", prompt=PROMPT, max_tokens=20, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want


def test_vllms_stop_token_ids_min_tokens_and_ignore_eos(client, model):
    cm, tok = model
    prompt_ids = tok(PROMPT)["input_ids"]
    greedy = cm.generate(torch.tensor([prompt_ids]), max_new_tokens=8,
                         do_sample=False)[0, len(prompt_ids):].tolist()
    stop = greedy[2]
    first = greedy.index(stop)  # where it first comes
    kw = dict(model="m", prompt=PROMPT, max_tokens=8, temperature=0)
    r = client.completions.create(**kw, extra_body={"stop_token_ids": [stop]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == first + 1
    assert r.choices[0].text == tok.decode(greedy[:first], skip_special_tokens=True)
    r = client.completions.create(**kw, extra_body={"stop_token_ids": [stop],
                                                     "min_tokens": first + 2})
    assert r.usage.completion_tokens >= first + 2  # held back until then
    end = {str(tok.eos_token_id): 100}  # the end token forced at every step
    r = client.completions.create(**kw, logit_bias=end)
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", 1)
    r = client.completions.create(**kw, logit_bias=end, extra_body={"min_tokens": 3})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens >= 3
    r = client.completions.create(**kw, logit_bias=end, extra_body={"ignore_eos": True})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 8)
    for bad in ({"stop_token_ids": [-1]}, {"stop_token_ids": "2"}, {"min_tokens": -1},
                {"min_tokens": 9}, {"ignore_eos": "yes"},
                {"min_tokens": 2, "guided_choice": ["ab"]},  # a complete grammar allows only
                {"ignore_eos": True, "guided_regex": "a+"}):  # the end token
        with pytest.raises(openai.BadRequestError, match=next(iter(bad))):
            client.completions.create(**kw, extra_body=bad)


def test_logit_bias_bans_and_forces_tokens(client, model):
    cm, tok = model
    prompt_ids = tok(PROMPT)["input_ids"]
    first = int(cm.generate(torch.tensor([prompt_ids]), max_new_tokens=1,
                            do_sample=False)[0, -1])
    kw = dict(model="m", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    r = client.completions.create(**kw, logit_bias={str(first): -100})
    banned = r.choices[0].logprobs.tokens[0]
    assert banned != tok.decode([first])
    forced = (first + 7) % len(tok)
    r = client.completions.create(**kw, logit_bias={str(forced): 100})
    assert r.choices[0].logprobs.tokens[0] == tok.decode([forced])
    for bad in ({"x": 1}, {str(cm.config.vocab_size): 1}, {"3": 101}, {"3": True}, [3],
                {"\u00b2": 1}, {"\u0663": 1}):  # digits, but not ASCII ones
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            client.completions.create(**kw, logit_bias=bad)


def test_sampling_with_a_seed_repeats(client):
    kw = dict(model="m", prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.9, seed=7,
              extra_body={"top_k": 40, "min_p": 0.02})
    first = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw).choices[0].text == first
    greedy = client.completions.create(model="m", prompt=PROMPT, max_tokens=16,
                                       temperature=0).choices[0].text
    others = {client.completions.create(**dict(kw, seed=s)).choices[0].text for s in range(4)}
    assert others - {greedy}, "sampling gave the greedy text for every seed"


def test_n_replies_are_n_choices_each_seeded_in_turn(client, model):
    """n > 1: choice i is what a request with seed + i gives alone (choice 0: the seed's own),
    usage counts the prompt once and every choice's tokens; greedy choices are all the greedy
    reply."""
    kw = dict(model="m", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=11)
    r = client.completions.create(**kw, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    alone = [client.completions.create(**dict(kw, seed=11 + i)) for i in range(3)]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert [c.finish_reason for c in r.choices] == [a.choices[0].finish_reason for a in alone]
    assert len({c.text for c in r.choices}) > 1, "three samples, one text"
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    greedy = client.chat.completions.create(model="m", messages=USER, max_tokens=8,
                                            temperature=0, n=2)
    want = client.chat.completions.create(model="m", messages=USER, max_tokens=8, temperature=0)
    assert [c.message.content for c in greedy.choices] == [want.choices[0].message.content] * 2
    echoed = client.completions.create(**kw, n=2, echo=True, logprobs=1)
    n_prompt = len(model[1](PROMPT)["input_ids"])
    for c, alone in zip(echoed.choices, alone):  # the prompt echoed in each, with its logprobs
        assert c.text == PROMPT + alone.choices[0].text
        lp = c.logprobs
        assert lp.token_logprobs[0] is None and len(lp.tokens) > n_prompt
        assert lp.tokens[:n_prompt] == echoed.choices[0].logprobs.tokens[:n_prompt]
        assert lp.text_offset[n_prompt] == len(PROMPT)  # each choice counts its own text


def test_several_prompts_each_reply_as_alone_in_order(client, model):
    """A completion with a list of prompts (strings or token ids; what batched evaluation
    harnesses send): prompt k's n replies are choices k * n .. k * n + n - 1, each what that
    prompt alone gives; usage counts each prompt once; streamed alike."""
    tok = model[1]
    prompts = [PROMPT, "Once upon a time", tok("def main():")["input_ids"]]
    kw = dict(model="m", max_tokens=6, temperature=0.8, seed=5, n=2, logprobs=1)
    r = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in r.choices] == list(range(6))
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    assert [c.text for c in r.choices] == [c.text for a in alone for c in a.choices]
    assert [c.logprobs.tokens for c in r.choices] == [c.logprobs.tokens for a in alone
                                                      for c in a.choices]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    texts = [""] * 6
    for chunk in client.completions.create(prompt=prompts, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in r.choices]
    # the context is each prompt's own: the one too long is named
    with pytest.raises(openai.BadRequestError, match="prompt 1 has"):
        client.completions.create(model="m", prompt=["a", [1] * 600], max_tokens=4)


def test_n_choices_stream_by_index_as_they_reply_whole(client):
    """Streamed, each chunk carries its choice's index (each choice opened by a role delta),
    and the chunks of each index make that choice of the same request unstreamed; logprobs
    come per choice; one usage chunk at the end."""
    kw = dict(model="m", messages=USER, max_tokens=10, temperature=0.9, seed=3, n=2,
              logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw)
    text, roles, tokens, usage = {0: "", 1: ""}, [], {0: [], 1: []}, None
    for chunk in client.chat.completions.create(**kw, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.index)
            text[c.index] += c.delta.content or ""
            if c.logprobs is not None:
                tokens[c.index] += [t.token for t in c.logprobs.content]
    assert roles == [0, 1]
    assert [text[i] for i in (0, 1)] == [c.message.content for c in whole.choices]
    assert [tokens[i] for i in (0, 1)] == [[t.token for t in c.logprobs.content]
                                          for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("extra,kw", [
    ({"frequency_penalty": 1.5, "presence_penalty": 0.5},
     lambda n: dict(logits_processor=[FrequencyPresencePenalty(n, 1.5, 0.5)])),
    ({"repetition_penalty": 1.8}, lambda n: dict(repetition_penalty=1.8)),  # vLLM's
    ({"repeat_penalty": 1.8, "repeat_last_n": 6},  # llama.cpp's
     lambda n: dict(logits_processor=[RecentRepetitionPenalty(1.8, 6)])),
])
def test_penalties_equal_generate_with_them(client, model, extra, kw):
    """Greedy with each API's penalty: cm.generate's text with the same penalty, which is not
    the text without it."""
    cm, tok = model
    ids = tok(PROMPT)["input_ids"]
    out = cm.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, **kw(len(ids)))
    want = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0,
                                  extra_body=extra)
    assert r.choices[0].text == want
    assert want != reference(model, ids, 24)[0]


def _model_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log-softmax of the compiled model's logits at every position of ids: [len(ids), V]."""
    with torch.no_grad():
        return model[0](torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_chat_logprobs_are_the_models_and_stream_alike(client, model):
    tok = model[1]
    kw = dict(model="m", messages=[{"role": "user", "content": "Tell me about lists"}],
              max_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content
    prompt = tok(default_chat_format(kw["messages"]))["input_ids"]
    reply = tok(r.choices[0].message.content, add_special_tokens=False)["input_ids"]
    assert [tok.decode([t]) for t in reply] == [e.token for e in content]
    want = _model_logprobs(model, prompt + reply)
    for i, (entry, token) in enumerate(zip(content, reply)):
        row = want[len(prompt) + i - 1]
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        top = [(t.token, t.logprob) for t in entry.top_logprobs]
        values, ids = row.topk(3)
        assert [t for t, _ in top] == [tok.decode([i]) for i in ids.tolist()]
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
        assert top[0] == (entry.token, entry.logprob)  # greedy: the likeliest
    streamed = [e for c in client.chat.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]  # (the prompt cache's
    assert [e.logprob for e in streamed] == pytest.approx(  # keys and values: within rounding)
        [e.logprob for e in content], abs=1e-5)
    plain = client.chat.completions.create(**dict(kw, logprobs=False, top_logprobs=None))
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == r.choices[0].message.content


def test_logprobs_without_alternatives_and_despite_a_models_penalty(client, model):
    """logprobs true alone (chat) and logprobs 0 (a completion) give the chosen tokens' only;
    a repetition penalty in the model's generation_config changes neither the reply nor the
    log-probabilities: the request's sampling fields are the whole of it (OpenAI's)."""
    cm, tok = model
    r = client.chat.completions.create(model="m", messages=USER, max_tokens=6, temperature=0,
                                       logprobs=True)
    assert r.choices[0].logprobs.content and all(
        e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    kw = dict(model="m", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0)
    plain = client.completions.create(**kw).choices[0]
    assert all(top == {t: lp} for t, lp, top in zip(
        plain.logprobs.tokens, plain.logprobs.token_logprobs, plain.logprobs.top_logprobs))
    config = cm._orig_mod.generation_config
    config.repetition_penalty = 3.0
    try:
        penalized = client.completions.create(**kw).choices[0]
    finally:
        config.repetition_penalty = 1.0
    assert penalized.text == plain.text
    assert penalized.logprobs.token_logprobs == pytest.approx(plain.logprobs.token_logprobs,
                                                              abs=1e-5)


def test_completion_logprobs_with_echo_cover_the_prompt(client, model):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, one new token."""
    tok = model[1]
    ids = tok(PROMPT)["input_ids"]
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=3, temperature=0,
                                  logprobs=2, echo=True)
    c = r.choices[0]
    assert c.text.startswith(PROMPT) and len(c.text) > len(PROMPT)
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    new = ids + tok(c.text[len(PROMPT):], add_special_tokens=False)["input_ids"]
    want = _model_logprobs(model, new)
    for i in range(1, len(lp.tokens)):
        assert lp.token_logprobs[i] == pytest.approx(float(want[i - 1, new[i]]), abs=1e-4)
        assert lp.tokens[i] in lp.top_logprobs[i] and 2 <= len(lp.top_logprobs[i]) <= 3
    # streamed: the same tokens, offsets running on across chunks
    chunks = list(client.completions.create(model="m", prompt=PROMPT, max_tokens=3,
                                            temperature=0, logprobs=2, echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    streamed = [ch.choices[0].logprobs for ch in chunks if ch.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset


def test_max_tokens_0_with_echo_scores_prompts_without_generating(client, model):
    """The legacy scoring request (evaluation harnesses' loglikelihood): echo, logprobs and
    max_tokens 0, for a batch of prompts: each prompt's tokens with the model's
    log-probabilities, nothing generated; without echo, max_tokens 0 is a 400."""
    tok = model[1]
    prompts = [PROMPT, "Once upon a time"]
    r = client.completions.create(model="m", prompt=prompts, max_tokens=0, echo=True,
                                  logprobs=1, temperature=0)
    assert r.usage.completion_tokens == 0
    for c, text in zip(r.choices, prompts):
        ids = tok(text)["input_ids"]
        want = _model_logprobs(model, ids)
        assert c.text == text and c.finish_reason == "length"
        assert c.logprobs.tokens == [tok.decode([t]) for t in ids]
        assert c.logprobs.token_logprobs[0] is None
        for j, t in enumerate(ids[1:]):
            assert c.logprobs.token_logprobs[j + 1] == pytest.approx(float(want[j, t]), abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="m", prompt=PROMPT, max_tokens=0)
    # the harness's loglikelihood request (one token generated): the last entry is that token,
    # even an end token (forced here by logit_bias)
    end = sorted(end_tokens(model[0], tok)[0])[0]
    ids = tok(PROMPT)["input_ids"]
    r = client.completions.create(model="m", prompt=[ids], max_tokens=1, echo=True, logprobs=1,
                                  temperature=0, logit_bias={str(end): 100})
    lp = r.choices[0].logprobs
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"
    assert len(lp.tokens) == len(ids) + 1 and lp.tokens[-1] == tok.decode([end])


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                          "maximum": 9}}}


def test_structured_output_fields_hold_the_reply(client):
    """OpenAI's response_format, llama.cpp's grammar and json_schema, vLLM's guided_*: the
    fixture's random weights write what the grammar lets them."""
    kw = dict(model="m", messages=USER, max_tokens=200, temperature=0)
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    r = client.chat.completions.create(response_format=schema, **kw)
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"ok", "n"} and 0 <= value["n"] <= 9, value
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        response_format=schema, stream=True, **kw))
    assert streamed == r.choices[0].message.content
    r = client.chat.completions.create(response_format={"type": "json_object"}, **kw)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    for extra, check in [
            ({"json_schema": SCHEMA}, lambda t: set(json.loads(t)) == {"ok", "n"}),
            ({"guided_json": json.dumps(SCHEMA)}, lambda t: set(json.loads(t)) == {"ok", "n"}),
            ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
            ({"guided_regex": "[0-9]{3}-[a-z]{2}"},
             lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
            ({"grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),  # GBNF
            ({"guided_grammar": 'start: "ab" | "cd"'}, lambda t: t in ("ab", "cd")),  # Lark
            ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
            ({"structured_outputs": {"json_object": True}},
             lambda t: isinstance(json.loads(t), dict)),
            ({"response_format": {"type": "json_object", "schema": SCHEMA}},  # llama.cpp's
             lambda t: set(json.loads(t)) == {"ok", "n"}),
            ({"response_format": {"type": "json_schema", "schema": SCHEMA}},
             lambda t: set(json.loads(t)) == {"ok", "n"})]:
        text = client.chat.completions.create(extra_body=extra, **kw).choices[0].message.content
        assert check(text), (extra, text)
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=20, temperature=0.9,
                                  seed=3, extra_body={"guided_choice": ["alpha", "beta"]})
    assert r.choices[0].text in ("alpha", "beta")


class _NoEndToken:
    """The compiled model as one with no end token (some base models have none)."""

    def __init__(self, cm):
        self.cm, self.generation_config = cm, copy.deepcopy(cm.generation_config)
        self.generation_config.eos_token_id = None

    def __getattr__(self, name):
        return getattr(self.cm, name)


def test_a_complete_grammar_ends_the_reply_of_a_model_with_no_end_token(model):
    """Without an end token to pick, a reply whose grammar is complete ends there ("stop"),
    rather than going on to max_tokens."""
    cm, tok = model
    tok = copy.deepcopy(tok)
    tok.eos_token = None
    app = make_app(_NoEndToken(cm), tok)
    with running(app) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        for stream in (False, True):
            kw = dict(model="m", prompt=PROMPT, max_tokens=40, temperature=0,
                      extra_body={"guided_choice": ["red", "green"]})
            if stream:
                chunks = list(client.completions.create(stream=True, **kw))
                text = "".join(c.choices[0].text for c in chunks if c.choices)
                finish = chunks[-1].choices[0].finish_reason
            else:
                r = client.completions.create(**kw)
                text, finish = r.choices[0].text, r.choices[0].finish_reason
                assert r.usage.completion_tokens == len(tok(text, add_special_tokens=False)
                                                        ["input_ids"]), r.usage
            assert text in ("red", "green") and finish == "stop", (text, finish)


def test_a_grammar_past_its_parsers_limits_is_a_400_not_a_short_reply(client):
    """After 29 "a"s llguidance's lexer gives up on this regex; negative penalties keep the
    model writing "a"s. The reply fails with a 400 rather than ending early as if complete."""
    with pytest.raises(openai.BadRequestError, match="cannot be held to the grammar"):
        client.completions.create(model="m", prompt=PROMPT, max_tokens=80, temperature=0,
                                  frequency_penalty=-2, presence_penalty=-2,
                                  extra_body={"guided_regex": "((a{1,50}){1,50}){1,50}b"})


def test_eight_concurrent_clients_all_succeed(url):
    """Queued one at a time, in any order: all greedy replies equal."""
    results, errors = [None] * 8, []

    def ask(i):
        try:
            c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            if i % 2:
                r = c.chat.completions.create(model="m", max_tokens=12, temperature=0,
                                              messages=[{"role": "user", "content": "Hi"}])
                results[i] = r.choices[0].message.content
            else:
                stream = c.chat.completions.create(
                    model="m", max_tokens=12, temperature=0, stream=True,
                    messages=[{"role": "user", "content": "Hi"}])
                results[i] = "".join(ch.choices[0].delta.content or "" for ch in stream)
        except Exception as e:  # reported below with its index
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert len(set(results)) == 1 and results[0]


# ---- bad requests --------------------------------------------------------------------------

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
MALFORMED = [
    ("POST", CHAT, b"{not json", "not valid JSON"),
    ("POST", CHAT, b"", "not valid JSON"),
    ("POST", CHAT, b"\xff\xfe\x00", "not valid JSON"),
    ("POST", CHAT, b"[" * 100000 + b"]" * 100000, "not valid JSON"),
    ("POST", CHAT, [], "JSON object"),
    ("POST", CHAT, {"model": "m"}, "messages"),
    ("POST", CHAT, {"messages": "hello"}, "messages"),
    ("POST", CHAT, {"messages": []}, "messages"),
    ("POST", CHAT, {"messages": [{"content": "hi"}]}, "role"),
    ("POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ("POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, "content"),
    ("POST", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "text"),
    ("POST", CHAT, {"messages": USER, "max_tokens": -1}, "max_tokens"),
    ("POST", CHAT, {"messages": USER, "max_tokens": "ten"}, "max_tokens"),
    ("POST", CHAT, {"messages": USER, "max_tokens": 10**6}, "context"),
    ("POST", CHAT, {"messages": USER, "temperature": 5}, "temperature"),
    ("POST", CHAT, {"messages": USER, "temperature": "hot"}, "temperature"),
    ("POST", CHAT, {"messages": USER, "top_p": 1.5}, "top_p"),
    ("POST", CHAT, {"messages": USER, "stream": "yes"}, "stream"),
    ("POST", CHAT, {"messages": USER, "stop": 7}, "stop"),
    ("POST", CHAT, {"messages": USER, "n": 0}, "n must be an integer in [1, 16]"),
    ("POST", CHAT, {"messages": USER, "n": 17}, "n must be an integer in [1, 16]"),
    ("POST", CHAT, {"messages": USER, "best_of": 3}, "best_of="),
    ("POST", CHAT, {"messages": USER, "top_logprobs": 2}, "needs logprobs: true"),
    ("POST", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("POST", CHAT, {"messages": USER, "echo": True}, "echo"),
    ("POST", CHAT, {"messages": USER, "model": 12}, "model"),
    ("POST", COMPLETIONS, {"model": "m"}, "prompt"),
    ("POST", COMPLETIONS, {"prompt": 42}, "prompt"),
    ("POST", COMPLETIONS, {"prompt": [5, 10**9]}, "token ids"),
    ("POST", COMPLETIONS, {"prompt": ["a"] * 65}, "up to 64 a request"),
    ("POST", COMPLETIONS, {"prompt": ["a", ""], "max_tokens": 2}, "prompt 1 gives no tokens"),
    ("POST", COMPLETIONS, {"prompt": ["a", None], "max_tokens": 2}, "prompt 1 must be"),
    ("POST", COMPLETIONS, {"prompt": [[5], []], "max_tokens": 2}, "prompt 1 must be"),
    ("POST", COMPLETIONS, {"prompt": [1] * 600, "max_tokens": 0, "echo": True}, "context"),
    ("POST", COMPLETIONS, {"prompt": ["a"] * 5, "n": 16}, "up to 64 replies"),
    ("POST", COMPLETIONS, {"prompt": "", "max_tokens": 4}, "no tokens"),
    ("POST", COMPLETIONS, b'{"prompt": "hi \\ud800 there", "max_tokens": 2}', "surrogate"),
    ("POST", CHAT, b'{"messages": [{"role": "user", "content": "caf\\udce9"}]}', "surrogate"),
    ("POST", CHAT, {"messages": USER, "mirostat": 2}, "mirostat"),  # llama.cpp's
    ("POST", CHAT, {"messages": USER, "repeat_penalty": 0}, "repeat_penalty must be > 0"),
    ("POST", CHAT, {"messages": USER, "repetition_penalty": 1.1, "repeat_penalty": 1.2},
     "not both"),
    ("POST", CHAT, {"messages": USER, "frequency_penalty": 2.5}, "frequency_penalty"),
    ("POST", CHAT, {"messages": USER, "min_p": 1.5}, "min_p"),
    ("POST", CHAT, {"messages": USER, "guided_json": {"type": "bogus"}}, "guided_json cannot"),
    ("POST", CHAT, {"messages": USER, "guided_regex": "[a-"}, "unclosed character class"),
    ("POST", CHAT, {"messages": USER, "guided_choice": []}, "non-empty list of strings"),
    ("POST", CHAT, {"messages": USER, "grammar": 'root ::= foo'}, "foo"),
    ("POST", CHAT, {"messages": USER, "response_format": {"type": "xml"}}, "response_format"),
    ("POST", CHAT, {"messages": USER, "response_format": {"type": "json_object"},
                    "guided_regex": "a"}, "one structured-output field"),
    ("POST", CHAT, {"messages": USER, "grammar": 'root ::= "x" root'}, "grammar"),  # no end
    ("POST", CHAT, {"messages": USER, "guided_choice": [str(i) for i in range(2500)]},
     "grammar"),  # past llguidance's 2000 items a row
    ("POST", CHAT, {"messages": USER, "structured_outputs": {"whitespace_pattern": " "}},
     "structured_outputs"),
    ("POST", CHAT, {"messages": USER, "guided_whitespace_pattern": " "},
     "guided_whitespace_pattern"),
    ("POST", CHAT, {"messages": USER, "tool_choice": "auto"}, "tool_choice"),
    ("POST", COMPLETIONS, {"prompt": "a", "top_logprobs": 2}, "logprobs: N"),
    ("POST", COMPLETIONS, {"prompt": "a", "logprobs": True}, "logprobs"),
    ("GET", CHAT, None, "Method Not Allowed"),
    ("POST", "/v1/nothing-here", {}, "Not Found"),
]


def test_malformed_requests_get_openai_errors_and_the_server_goes_on(url, client):
    assert len(MALFORMED) >= 20
    with httpx.Client(base_url=url, timeout=30) as http:
        for method, path, body, words in MALFORMED:
            content = body if isinstance(body, bytes) or body is None else json.dumps(body)
            r = http.request(method, path, content=content,
                             headers={"content-type": "application/json"})
            error = assert_openai_error(r)
            assert r.status_code < 500, (path, body, r.text)
            assert words in error["message"], (words, error)
            assert http.get("/health").json()["status"] == "ok"
    r = client.chat.completions.create(model="m", messages=USER, max_tokens=4, temperature=0)
    assert r.choices[0].message.content is not None and r.usage.completion_tokens >= 1


def test_bad_field_names_its_param(url, model):
    r = httpx.post(f"{url}{CHAT}", json={"messages": [USER[0], {"role": "user"}]})
    assert assert_openai_error(r, 400)["param"] == "messages[1].content"
    # a prompt that fills the context is the prompt's fault, not max_tokens'
    long = [5] * model[0].config.max_position_embeddings
    r = httpx.post(f"{url}{COMPLETIONS}", json={"prompt": long, "max_tokens": 3})
    assert assert_openai_error(r, 400)["param"] == "prompt"


def test_what_means_off_and_a_tiny_temperature_are_answered(client):
    r = client.chat.completions.create(model="m", messages=USER, max_tokens=3, temperature=1e-300,
                                       tool_choice="none", logprobs=False)
    greedy = client.chat.completions.create(model="m", messages=USER, max_tokens=3, temperature=0)
    assert r.choices[0].message.content == greedy.choices[0].message.content


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=USER, temperature=-1)
    assert e.value.status_code == 400 and "temperature" in e.value.message


# ---- API key -------------------------------------------------------------------------------


def test_browsers_may_call_it_only_from_the_allowed_origins(model):
    """CORS: a page on an allowed origin gets the header (and its preflight, which asks to send
    an Authorization header, an answer); a page on another origin, or on any with none allowed,
    is refused (403), even for requests a browser sends without asking first."""
    page, other = "http://localhost:3000", "https://example.com"
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    with running(make_app(*model, api_key=KEY, allowed_origins=[page])) as base:
        r = httpx.options(f"{base}/v1/chat/completions", headers={"Origin": page, **preflight})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = httpx.get(f"{base}/v1/models", headers={"Origin": page,
                                                    "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        r = httpx.get(f"{base}/v1/models", headers={"Origin": other,
                                                    "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        assert r.json()["error"]["code"] == "origin_not_allowed"
        assert httpx.options(f"{base}/v1/models", headers={"Origin": other, **preflight}
                             ).status_code == 400
        r = httpx.options(f"{base}/v1/completions", headers={  # Chrome's private-network ask
            "Origin": page, "Access-Control-Request-Private-Network": "true", **preflight})
        assert r.status_code == 200, r.text
    with running(make_app(*model, allowed_origins=["*"])) as base:
        r = httpx.get(f"{base}/v1/models", headers={"Origin": other})
        assert r.headers["access-control-allow-origin"] == "*"

    class BrokenTokenizer:  # a bug's stand-in: tokenizing a prompt raises
        def __init__(self, tokenizer):
            self.tokenizer = tokenizer

        def __getattr__(self, name):
            return getattr(self.tokenizer, name)

        def __len__(self):
            return len(self.tokenizer)

        def __call__(self, *args, **kwargs):
            raise RuntimeError("a bug")

    with running(make_app(model[0], BrokenTokenizer(model[1]), allowed_origins=[page])) as base:
        r = httpx.post(f"{base}/v1/completions", headers={"Origin": page},
                       json={"model": "m", "prompt": "x", "max_tokens": 1})
        # a page may read the 500 (its CORS header), in OpenAI's shape
        assert r.status_code == 500 and r.headers["access-control-allow-origin"] == page
        assert r.json()["error"] == {"message": "internal error: RuntimeError",
                                     "type": "server_error", "param": None, "code": None}
    with running(make_app(*model)) as base:
        r = httpx.get(f"{base}/v1/models", headers={"Origin": page})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        # a "simple" request (no preflight) from a page elsewhere does not run either
        r = httpx.post(f"{base}/v1/completions", headers={"Origin": other,
                                                          "Content-Type": "text/plain"},
                       content=json.dumps({"model": "m", "prompt": "x", "max_tokens": 1}))
        assert r.status_code == 403
        host = base.removeprefix("http://")  # the server's own pages (FastAPI's /docs) may
        assert httpx.get(f"{base}/v1/models", headers={"Origin": f"http://{host}"}
                         ).status_code == 200
    for bad in ("http://localhost:3000/", "localhost:3000", "http://h/path"):
        with pytest.raises(ValueError, match="not a web origin"):
            make_app(*model, allowed_origins=[bad])


def test_api_key(model):
    with running(make_app(*model, api_key=KEY)) as base:
        good = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
        assert [m.id for m in good.models.list().data] == ["relu_llama"]
        assert good.completions.create(model="m", prompt=PROMPT, max_tokens=2).choices
        bad = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="m", messages=USER, max_tokens=2)
        for headers in ({}, {"Authorization": f"Bearer {KEY}x"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}):
            r = httpx.post(f"{base}{COMPLETIONS}", json={"prompt": "x"}, headers=headers)
            assert assert_openai_error(r, 401)["code"] == "invalid_api_key"
        r = httpx.post(f"{base}{COMPLETIONS}", json={"prompt": "x", "max_tokens": 1},
                       headers={"Authorization": f"bearer {KEY}"})  # the scheme in any case
        assert r.status_code == 200, r.text
        # the key is checked before the body: a malformed body without a key is a 401 too
        assert httpx.post(f"{base}{CHAT}", content=b"{").status_code == 401
        assert httpx.get(f"{base}/health").status_code == 200  # no key needed


# ---- one at a time: the queue, disconnects -------------------------------------------------


def test_full_queue_gets_503_and_leaving_frees_the_slot(model):
    """max_queue=1: one request running, one waiting, a third gets a 503; when the running
    client leaves mid-stream, the waiting one runs and succeeds."""
    cm, tok = model
    with running(make_app(Paced(cm, 0.05), tok, max_queue=1)) as base:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = c.completions.create(model="m", prompt=PROMPT, max_tokens=400, temperature=0,
                                      stream=True)
        next(iter(stream))  # running now: 400 tokens would take 20 s
        waiting = {}
        t = threading.Thread(target=lambda: waiting.setdefault("r", c.completions.create(
            model="m", prompt=PROMPT, max_tokens=3, temperature=0)))
        t.start()
        wait_for(base, lambda h: h["running"] == 1 and h["waiting"] == 1)

        r = httpx.post(f"{base}{COMPLETIONS}", json={"prompt": PROMPT, "max_tokens": 3})
        assert assert_openai_error(r, 503)["code"] == "queue_full"
        with pytest.raises(openai.InternalServerError) as e:
            c.chat.completions.create(model="m", messages=USER, max_tokens=3)
        assert e.value.status_code == 503

        t0 = time.monotonic()
        stream.close()  # the running client leaves: generation stops at its next token
        t.join(timeout=10)
        assert time.monotonic() - t0 < 5 and "r" in waiting
        assert waiting["r"].usage.completion_tokens == 3
        assert waiting["r"].choices[0].finish_reason == "length"
        wait_for(base, lambda h: h["running"] == 0 and h["waiting"] == 0)


def test_client_leaving_mid_stream_frees_the_slot(model):
    cm, tok = model
    with running(make_app(Paced(cm, 0.05), tok)) as base:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = c.chat.completions.create(model="m", messages=USER, max_tokens=400,
                                           temperature=0, stream=True)
        got = [chunk for _, chunk in zip(range(3), stream)]
        assert len(got) == 3
        stream.close()  # 400 tokens would take 20 s; leaving must stop them
        t0 = time.monotonic()
        r = c.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
        assert time.monotonic() - t0 < 5
        assert wait_for(base, lambda h: h["running"] == 0)["waiting"] == 0


def test_non_streaming_client_leaving_while_queued_frees_its_place(model):
    """A client that gives up (timeout) while its request waits: the request leaves the queue."""
    cm, tok = model
    with running(make_app(Paced(cm, 0.05), tok, max_queue=1)) as base:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = c.completions.create(model="m", prompt=PROMPT, max_tokens=400, stream=True)
        next(iter(stream))
        impatient = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                  timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model="m", prompt=PROMPT, max_tokens=3)
        wait_for(base, lambda h: h["waiting"] == 0)  # it left the queue: room for another
        stream.close()
        assert c.completions.create(model="m", prompt=PROMPT, max_tokens=2).choices


def test_non_streaming_client_leaving_while_running_frees_the_slot(model):
    """A client that gives up while its request runs: generation stops, though every token it
    makes is an event (the disconnect is looked for every so often all the same)."""
    cm, tok = model
    with running(make_app(Paced(cm, 0.05), tok)) as base:
        impatient = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                  timeout=1.0)
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model="m", prompt=PROMPT, max_tokens=400, temperature=0)
        # 400 tokens at 0.05 s would take 20 s: leaving stops them
        wait_for(base, lambda h: h["running"] == 0, timeout=5)


def test_ctrl_c_ends_the_running_and_waiting_requests_at_once():
    """serve() interrupted (SIGINT) while one request runs (400 tokens at 0.05 s: 20 s) and
    another waits: both end with an error at once and the process exits cleanly, rather than
    uvicorn waiting for every generation to finish."""
    script = ("import sys, picompile\n"
              "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
              "from tests.test_serve import FIXTURE, Paced\n"
              "dense = AutoModelForCausalLM.from_pretrained(FIXTURE, local_files_only=True)\n"
              "tok = AutoTokenizer.from_pretrained(FIXTURE, local_files_only=True)\n"
              "cm = Paced(picompile.compile(dense.eval(), quiet=True), 0.05)\n"
              "picompile.serve(cm, tok, port=int(sys.argv[1]), log_level='warning')\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-c", script, str(port)],
                            cwd=pathlib.Path(__file__).parent.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    replies = []

    def ask():
        r = httpx.post(f"{base}{COMPLETIONS}", json={"prompt": PROMPT, "max_tokens": 400},
                       timeout=60)
        replies.append(r)

    try:
        wait_until_serving(proc, base)
        clients = [threading.Thread(target=ask) for _ in range(2)]
        for c in clients:
            c.start()
        wait_for(base, lambda h: h["running"] == 1 and h["waiting"] == 1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=30)[0]
        assert time.monotonic() - t0 < 5 and proc.returncode == 0, out
        for c in clients:
            c.join(timeout=10)
    finally:
        proc.kill()
    assert "Traceback" not in out
    assert [r.status_code for r in replies] == [503, 503]
    assert all("shutting down" in r.json()["error"]["message"] for r in replies)


# ---- the command line ----------------------------------------------------------------------


def test_cli_serve_answers_with_the_key():
    """`picompile serve --model DIR --port P --api-key KEY` loads, compiles and serves."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "picompile.cli", "serve", "--model", str(FIXTURE), "--quiet",
         "--port", str(port), "--api-key", KEY],
        cwd=pathlib.Path(__file__).parent.parent, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_serving(proc, f"http://127.0.0.1:{port}")
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        r = c.chat.completions.create(model="relu_llama", messages=USER, max_tokens=5)
        assert r.model == "relu_llama" and r.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="no",
                          max_retries=0).models.list()
        # a second server on the same port says so before it loads anything
        second = subprocess.run(
            [sys.executable, "-m", "picompile.cli", "serve", "--model", str(FIXTURE), "--quiet",
             "--port", str(port)], cwd=pathlib.Path(__file__).parent.parent,
            capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in second.stderr
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert f"serving relu_llama at http://127.0.0.1:{port}/v1" in out
    assert "Traceback" not in out


@pytest.mark.parametrize("kw", [dict(temperature=0), dict(temperature=0.8, seed=5, n=2)],
                         ids=["greedy", "sampled"])
def test_prompt_lookup_replies_as_a_token_a_step(model, client, kw):
    """`serve --prompt-lookup` (cm.prompt_lookup): the same text, tokens, alternatives and
    log-probabilities as without, for a prompt whose words repeat (something to look up)."""
    cm, _ = model
    prompt = "one two three four five one two three four five one two three"
    req = dict(model="m", prompt=prompt, max_tokens=24, logprobs=2, **kw)
    replies = {}
    for lookup in (0, 7):
        cm.prompt_lookup = lookup
        try:
            r = client.completions.create(**req)
        finally:
            cm.prompt_lookup = 0
        replies[lookup] = [(c.text, c.logprobs.tokens, c.logprobs.token_logprobs,
                            [sorted(top) for top in c.logprobs.top_logprobs]) for c in r.choices]
    for (text, tokens, scores, tops), want in zip(replies[7], replies[0], strict=True):
        assert (text, tokens, tops) == (want[0], want[1], want[3])
        assert scores == pytest.approx(want[2], rel=1e-4, abs=1e-5)  # steps of several tokens
        # sum in another order (and the second call reuses the first's prompt from the cache)
