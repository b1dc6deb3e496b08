"""`picompile chat`: the conversation loop (picompile/chat.py) on the tiny ReLU-Llama fixture,
its replies checked against the compiled model's own generate() on the same prompts."""

from __future__ import annotations

import io
import pathlib

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import picompile
from picompile import chat
from picompile.conversation import chat_prompt
from picompile.runtime.sampling import RecentRepetitionPenalty

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "relu_llama"
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def model():
    dense = AutoModelForCausalLM.from_pretrained(FIXTURE, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(FIXTURE, local_files_only=True)
    tok.chat_template = TEMPLATE
    return picompile.compile(dense, quiet=True), tok


def talk(conversation: chat.Chat, *lines: str) -> tuple[str, str]:
    """Run the loop over `lines` piped in -> (what it wrote on stdout, on stderr)."""
    out, err = io.StringIO(), io.StringIO()
    chat.run(conversation, stdin=io.StringIO("".join(f"{line}\n" for line in lines)),
             stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def greedy_reply(cm, tok, messages, new_tokens) -> str:
    ids, _ = chat_prompt(tok, messages)
    out = cm.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True)


def test_each_turn_answers_the_whole_conversation_and_reset_forgets_it(model):
    cm, tok = model
    conversation = chat.Chat(cm, tok, system="Be brief.", max_new_tokens=6)
    out, err = talk(conversation, "def add(a, b):", "", "  return", "/reset", "import os")
    first = greedy_reply(cm, tok, [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "def add(a, b):"}], 6)
    history = [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "def add(a, b):"},
               {"role": "assistant", "content": first},
               {"role": "user", "content": "  return"}]
    second = greedy_reply(cm, tok, history, 6)
    third = greedy_reply(cm, tok, [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "import os"}], 6)
    assert out == f"{first}\n\n{second}\n\n{third}\n\n"  # a blank line after each answer
    assert second != greedy_reply(cm, tok, [history[0], history[3]], 6)  # the history mattered
    assert err.count("picompile: 6 tokens, ") == 3 and "forgotten" in err
    assert conversation.messages[-1] == {"role": "assistant", "content": third}
    assert len(conversation.messages) == 3  # system, the last question, its answer


def test_exit_ends_the_loop_and_help_and_unknown_commands_are_not_sent(model):
    cm, tok = model
    conversation = chat.Chat(cm, tok, max_new_tokens=2)
    out, err = talk(conversation, "/help", "/exti", "/exit", "never read")
    assert out == "" and "/reset" in err and "/quit" in err
    assert "unknown command /exti" in err
    assert conversation.messages == []


def test_quiet_still_says_why_a_message_got_no_answer_and_counts_it(model):
    """A script piping messages in must see that one was not answered: the error line stays
    under quiet, the command's exit code says so (run's count)."""
    cm, tok = model
    conversation = chat.Chat(cm, tok, max_new_tokens=4)
    conversation.context = 20
    out, err = io.StringIO(), io.StringIO()
    unanswered = chat.run(conversation, stdin=io.StringIO("word " * 40 + "\nx = 1\n/nope\n"),
                          stdout=out, stderr=err, quiet=True)
    assert unanswered == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 2 and "error:" in lines[0] and "context of 20" in lines[0]
    assert "unknown command /nope" in lines[1]
    assert out.getvalue().endswith("\n\n") and len(conversation.messages) == 2


def test_ctrl_c_at_the_prompt_ends_the_loop_as_any_command(model):
    cm, tok = model

    class Interrupted:
        def readline(self):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        chat.run(chat.Chat(cm, tok), stdin=Interrupted(), stdout=io.StringIO(),
                 stderr=io.StringIO())


def test_old_turns_are_dropped_to_fit_the_context(model):
    cm, tok = model
    conversation = chat.Chat(cm, tok, max_new_tokens=4)
    talk(conversation, "x = 1", "y = 2")
    assert len(conversation.messages) == 4
    second_turn = conversation.messages[2:]
    ids, _ = chat_prompt(tok, second_turn + [{"role": "user", "content": "z = 3"}])
    conversation.context = len(ids) + 4  # room for the last turn, not for the first
    out, err = talk(conversation, "z = 3")
    assert "2 of the oldest messages dropped" in err
    assert conversation.messages[:3] == second_turn + [{"role": "user", "content": "z = 3"}]
    assert len(conversation.messages) == 4


def test_a_message_longer_than_the_context_is_refused_and_forgotten(model):
    cm, tok = model
    conversation = chat.Chat(cm, tok, max_new_tokens=4)
    talk(conversation, "x = 1")
    before = list(conversation.messages)
    conversation.context = 20
    out, err = talk(conversation, "word " * 40)
    assert out == "" and "shorter" in err and "context of 20" in err
    assert conversation.messages == before


class StopsAfter:
    """The compiled model, but Ctrl-C comes after `n` tokens of each answer."""

    def __init__(self, cm, n):
        self.cm, self.n = cm, n

    def __getattr__(self, name):
        return getattr(self.cm, name)

    def generate(self, ids, streamer, **kwargs):
        n = self.n

        class Interrupting:
            calls = 0

            def put(self, value):
                streamer.put(value)
                Interrupting.calls += 1
                if Interrupting.calls > n:  # the prompt, then n tokens
                    raise KeyboardInterrupt

            def end(self):
                streamer.end()

        return self.cm.generate(ids, streamer=Interrupting(), **kwargs)


def test_ctrl_c_stops_the_answer_keeps_it_and_the_loop_goes_on(model):
    cm, tok = model
    conversation = chat.Chat(StopsAfter(cm, 3), tok, max_new_tokens=10)
    out, err = talk(conversation, "for i in range(3):", "print(i)")
    assert err.count("answer stopped") == 2
    full = greedy_reply(cm, tok, [{"role": "user", "content": "for i in range(3):"}], 10)
    partial = conversation.messages[1]["content"]
    assert partial and full.startswith(partial) and len(partial) < len(full)
    assert len(conversation.messages) == 4 and out.startswith(partial + "\n")


def test_without_a_chat_template_the_plain_format_stops_before_the_next_user_turn(model):
    cm, tok = model
    plain = AutoTokenizer.from_pretrained(FIXTURE, local_files_only=True)
    assert not getattr(plain, "chat_template", None)
    conversation = chat.Chat(cm, plain, max_new_tokens=5)
    out, _ = talk(conversation, "hello")
    reply = greedy_reply(cm, plain, [{"role": "user", "content": "hello"}], 5).split("\nuser:")[0]
    assert out == reply + "\n\n"


def test_sampling_arguments_are_checked():
    with pytest.raises(ValueError, match="top_p"):
        chat.Chat(None, None, top_p=0)
    with pytest.raises(ValueError, match="min_p"):
        chat.Chat(None, None, min_p=2.0)
    with pytest.raises(ValueError, match="repeat_penalty must be > 0"):
        chat.Chat(None, None, repeat_penalty=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        chat.Chat(None, None, max_new_tokens=0)


def test_repeat_penalty_answers_as_generate_with_llama_cpps_penalty(model):
    """--repeat-penalty: the reply cm.generate gives with the penalty over the last
    repeat_last_n tokens, which is not the reply without it."""
    cm, tok = model
    message = [{"role": "user", "content": "def add(a, b):"}]
    out, _ = talk(chat.Chat(cm, tok, max_new_tokens=16, repeat_penalty=1.8, repeat_last_n=8),
                  message[0]["content"])
    ids, _ = chat_prompt(tok, message)
    want = cm.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                       logits_processor=[RecentRepetitionPenalty(1.8, 8)])
    reply = tok.decode(want[0, len(ids):], skip_special_tokens=True)
    assert out == f"{reply}\n\n" and reply != greedy_reply(cm, tok, message, 16)


def test_bytes_that_are_not_utf8_are_read_as_replacement_characters(model):
    cm, tok = model  # Python reads such bytes from a pipe as lone surrogates ("\udce9")
    out, err = talk(chat.Chat(cm, tok, max_new_tokens=4), "caf\udce9 au lait?")
    want = greedy_reply(cm, tok, [{"role": "user", "content": "caf\ufffd au lait?"}], 4)
    assert out == f"{want}\n\n" and "not valid UTF-8" in err


class _ByteTokenizer:
    """Token id = one byte of UTF-8."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", "replace")


def test_a_reply_cut_inside_a_character_does_not_end_on_a_replacement_character():
    from picompile.conversation import TextDeltas

    emoji = list("🙂".encode())
    text = TextDeltas(_ByteTokenizer())
    sent = [text.add(t)[0] for t in [*b"ok ", *emoji, *emoji[:2]]]
    assert "".join(sent) + text.flush()[0] == "ok 🙂"
    assert text.reply() == "ok 🙂"


def test_the_status_line_says_how_much_of_the_prompt_was_cached(model):
    import re

    cm, tok = model
    cm.decoder().forget()  # what earlier tests left cached
    _, err = talk(chat.Chat(cm, tok, max_new_tokens=4), "def add(a, b):", "  return")
    turns = [(int(p), int(c)) for p, c in re.findall(r"prompt (\d+) tokens \((\d+) cached\)", err)]
    assert len(turns) == 2 and turns[0][1] == 0
    assert turns[0][0] <= turns[1][1] < turns[1][0]  # the second turn reused the first prompt
    assert err.count("first token after") == 2
