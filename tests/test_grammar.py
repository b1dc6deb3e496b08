"""Structured output (picompile/runtime/grammar.py): replies held to a grammar, in picompile's
generate loop and in Hugging Face's, on the tiny ReLU-Llama fixture (random weights: what it
writes is the grammar's doing)."""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

import picompile
from picompile.runtime.generate import generate
from picompile.runtime.grammar import GrammarComplete, GrammarError, Grammars

pytest.importorskip("llguidance")  # the serve extra, installed by the README's set-up

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "relu_llama"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "tag"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                          "maximum": 99},
                         "tag": {"enum": ["a", "bc"]}}}


@pytest.fixture(scope="module")
def setup():
    model = AutoModelForCausalLM.from_pretrained(FIXTURE, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(FIXTURE, local_files_only=True)
    return model, tok, Grammars(tok, model.config.vocab_size, [tok.eos_token_id])


def _reply(model, tok, grammars, format, text, prompt="hello there", new_tokens=48, **kw):
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    constraint = grammars.constraint(grammars.compile(format, text), ids.shape[1])
    out = generate(model, ids, max_new_tokens=new_tokens, eos_token_id=tok.eos_token_id,
                   logits_processor=[constraint], **kw)
    new = out[0, ids.shape[1]:]
    assert int(new[-1]) == tok.eos_token_id, "the grammar completed and ended the reply"
    return tok.decode(new[:-1])


@pytest.mark.parametrize("prompt", ["hello there", "def f(x):", "1, 2, 3"])
def test_each_format_holds_the_reply(setup, prompt):
    model, tok, grammars = setup
    reply = _reply(model, tok, grammars, "json_schema", json.dumps(SCHEMA), prompt)
    value = json.loads(reply)
    assert set(value) == {"ok", "n", "tag"} and isinstance(value["ok"], bool)
    assert 0 <= value["n"] <= 99 and value["tag"] in ("a", "bc")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}",
                        _reply(model, tok, grammars, "regex", "[0-9]{3}-[a-z]{2}", prompt))
    assert _reply(model, tok, grammars, "choice", '["red", "green", "blue"]', prompt) in (
        "red", "green", "blue")
    assert _reply(model, tok, grammars, "grammar", 'root ::= "yes" | "no"', prompt) in (
        "yes", "no")  # GBNF
    assert _reply(model, tok, grammars, "grammar", 'start: "ab" | "cd" "e"', prompt,
                  do_sample=True, seed=1) in ("ab", "cde")  # Lark, sampled


def test_json_whitespace_is_bounded_unless_the_schema_says(setup):
    model, tok, grammars = setup
    for prompt in ("hello there", "a b c d", "{"):
        reply = _reply(model, tok, grammars, "json_schema", json.dumps(SCHEMA), prompt, 256)
        json.loads(reply)
        for run in re.findall(r"\s+", reply):  # (no string value here holds a space)
            assert re.fullmatch(r" |\n[ \t]{0,20}", run), (run, reply)
    compact = dict(SCHEMA, **{"x-guidance": {"whitespace_flexible": False}})
    reply = _reply(model, tok, grammars, "json_schema", json.dumps(compact))
    assert reply == json.dumps(json.loads(reply), separators=(",", ":"))


def test_the_same_constraint_in_hugging_faces_generate_and_a_compiled_model(setup):
    model, tok, grammars = setup
    ids = tok("hello there", return_tensors="pt")["input_ids"]
    grammar = grammars.compile("json_schema", json.dumps(SCHEMA))
    kw = dict(max_new_tokens=48, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
              do_sample=False)
    ours = generate(model, ids, logits_processor=[grammars.constraint(grammar, ids.shape[1])],
                    **{k: v for k, v in kw.items() if k != "pad_token_id"})
    hf = model.generate(ids, logits_processor=LogitsProcessorList(
        [grammars.constraint(grammar, ids.shape[1])]), **kw)
    assert torch.equal(ours, hf)
    cm = picompile.compile(AutoModelForCausalLM.from_pretrained(FIXTURE, local_files_only=True),
                           quiet=True)
    assert cm.decoder() is not None
    got = cm.generate(ids, logits_processor=[grammars.constraint(grammar, ids.shape[1])], **kw)
    assert torch.equal(got, hf)


def test_the_mask_equals_llguidances_own(setup):
    """The scores masked a byte at a time against llguidance's apply_token_bitmask_inplace, at
    each step of a reply (a vocabulary not a multiple of 32 wide too)."""
    import llguidance.torch

    _, tok, grammars = setup
    text = '{"ok": true, "n": 42, "tag": "bc"}'
    reply = tok(text, add_special_tokens=False)["input_ids"]
    constraint = grammars.constraint(grammars.compile("json_schema", json.dumps(SCHEMA)), 1)
    for i in range(len(reply) + 1):
        ids = torch.tensor([[5] + reply[:i]])
        for width in (1024, 1000):
            scores = torch.randn(1, width, generator=torch.Generator().manual_seed(i))
            want = scores.clone()
            got = constraint(ids, scores.clone())
            llguidance.torch.apply_token_bitmask_inplace(want, constraint.mask)
            assert torch.equal(got, want), (i, width)
        assert i == len(reply) or got[0, reply[i]] > float("-inf")  # the text is allowed


def test_a_parser_limit_hit_mid_reply_is_an_error_not_an_early_end(setup):
    """llguidance's lexer gives up on this regex after 29 "a"s; its mask then allows only the
    end token, which would end the reply as if complete."""
    _, tok, grammars = setup
    constraint = grammars.constraint(grammars.compile("regex", "((a{1,50}){1,50}){1,50}b"), 1)
    a = tok.convert_tokens_to_ids("a")
    with pytest.raises(GrammarError, match="cannot be followed past .* too many") as e:
        for n in range(200):
            constraint(torch.tensor([[5] + [a] * n]), torch.zeros(1, 1024))
    assert "<state>" not in str(e.value)


def test_grammars_past_the_parsers_limits_fail_at_once_with_a_short_message(setup):
    """A grammar that never ends, and more choices than a row of llguidance's parser holds:
    GrammarError at the first token, without llguidance's dump of its state."""
    _, tok, grammars = setup
    for format, text in [("grammar", 'root ::= "x" root'),
                         ("choice", json.dumps([f"option {i}" for i in range(2500)]))]:
        with pytest.raises(GrammarError) as e:
            constraint = grammars.constraint(grammars.compile(format, text), 1)
            scores = constraint(torch.tensor([[5]]), torch.zeros(1, 1024))
            first = int(scores.argmax())
            constraint(torch.tensor([[5, first]]), torch.zeros(1, 1024))
        assert "<state>" not in str(e.value) and len(str(e.value)) < 300, str(e.value)


def test_bad_grammars_and_batches_are_refused(setup):
    _, tok, grammars = setup
    for format, text, words in [("regex", "[a-", "unclosed character class"),
                                ("json_schema", '{"type": "bogus"}', "bogus"),
                                ("json_schema", "{not json", "line 1"),
                                ("grammar", "root ::= foo", "foo"),
                                ("yaml", "a: b", "unknown grammar format")]:
        with pytest.raises(GrammarError, match=words):
            grammars.compile(format, text)
    constraint = grammars.constraint(grammars.compile("regex", "a+"), 1)
    with pytest.raises(ValueError, match="one reply"):
        constraint(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 1024))


def test_a_complete_grammar_raises_where_the_model_has_no_end_token(setup):
    """No end token to allow once the grammar is complete: the constraint says so rather than
    leaving the loop to pick from scores the mask left nothing finite in."""
    model, tok, _ = setup
    grammars = Grammars(tok, model.config.vocab_size, [])
    ids = tok("hello", return_tensors="pt")["input_ids"]
    constraint = grammars.constraint(grammars.compile("regex", "[0-9]{3}"), ids.shape[1])
    seen = []

    class Recorder:  # the streamer sees each token before the next step's processors run
        def put(self, value):
            seen.append(value.reshape(-1).tolist())

        def end(self):
            pass

    with pytest.raises(GrammarComplete):
        generate(model, ids, max_new_tokens=12, eos_token_id=None, streamer=Recorder(),
                 logits_processor=[constraint])
    reply = [t for step in seen[1:] for t in step]  # after the prompt
    assert re.fullmatch("[0-9]{3}", tok.decode(reply)), tok.decode(reply)
