"""`picompile chat`: a conversation with a compiled model on the terminal, as llama.cpp's
llama-cli or `ollama run`.

Each message goes to the model with the conversation before it (the tokenizer's chat template,
or conversation.default_chat_format), and the reply streams as it is generated. A turn prefills
only the tokens after those the decoder's prompt cache holds from the turn before (the
conversation so far, where the template renders it as it was: runtime/decoder.py,
Stack.cached_prefix). When the conversation and the reply's tokens no longer fit the
model's context, the oldest turns are dropped, with a note. Lines:

    /reset          forget the conversation (the system prompt stays)
    /exit, /quit    end (so does Ctrl-D; Ctrl-C at the prompt ends it as it ends any command)
    /help           these lines

Any other word after a slash is refused as an unknown command, not sent to the model (a message
that starts with a slash and has more words is sent). Ctrl-C while the model answers stops the
answer; what it wrote stays in the conversation. Standard input that is not a terminal is read
line by line, each a message, with no prompt shown, so a script can pipe messages in; each answer
ends with a blank line. A message that cannot be answered (longer than the context, refused by
the chat template, an unknown command) gets an error line on stderr even with quiet, and run()
counts them.
"""

from __future__ import annotations

import sys
import time

import torch

from picompile.compiled_model import CompiledModel
from picompile.conversation import ReplyStreamer, StopString, TextDeltas, chat_prompt, end_tokens
from picompile.runtime.sampling import RecentRepetitionPenalty

HELP = ("/reset forgets the conversation, /exit or /quit (or Ctrl-D) ends it, /help shows "
        "this; Ctrl-C stops an answer")
COMMANDS = ("/reset", "/exit", "/quit", "/help")


class _Printer(ReplyStreamer):
    """Writes the reply's text to `out` as it comes and clocks the tokens."""

    def __init__(self, text: TextDeltas, out, ends: set[int], prompt_tokens: int):
        super().__init__(text, ends)
        self.out, self.prompt_tokens = out, prompt_tokens
        self.start = time.perf_counter()  # the prompt handed to generate()
        self.first = self.last = None  # perf_counter at the first and the latest token

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.last = time.perf_counter()
            self.first = self.first or self.last
        super().put(value)

    def on_text(self, delta: str) -> None:
        self.out.write(delta)
        self.out.flush()

    def finish_line(self) -> None:
        """The rest of the reply's text, and its newline."""
        self.on_text(self.text.flush()[0] + "\n")

    def rate(self) -> float | None:
        """Decode tokens/s over the tokens after the first (prefill not counted), or None."""
        if self.count < 2 or self.last <= self.first:
            return None
        return (self.count - 1) / (self.last - self.first)


class Chat:
    """The conversation and how to answer it. `messages` holds the turns (the system prompt
    first, where one is given)."""

    def __init__(self, model, tokenizer, system: str | None = None, max_new_tokens: int = 512,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 min_p: float = 0.0, repeat_penalty: float = 1.0, repeat_last_n: int = 64):
        """Greedy at temperature 0, else sampled with top_p, top_k (0: off) and min_p (0: off);
        repeat_penalty (1: off) as llama.cpp's, over the last repeat_last_n tokens (-1: all)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if (temperature < 0 or not 0 < top_p <= 1 or top_k < 0 or not 0 <= min_p <= 1
                or repeat_last_n < -1):
            raise ValueError(f"temperature must be >= 0, top_p in (0, 1], top_k >= 0, min_p in "
                             f"[0, 1] and repeat_last_n >= -1, got {temperature}, {top_p}, "
                             f"{top_k}, {min_p} and {repeat_last_n}")
        self.model, self.tokenizer = model, tokenizer
        self.system = [{"role": "system", "content": system}] if system else []
        self.messages = list(self.system)
        self.max_new_tokens = max_new_tokens
        # the flags say how to sample, not the model's generation_config (as llama-cli)
        self.sampling = {"do_sample": temperature > 0, "repetition_penalty": 1.0}
        if temperature > 0:
            self.sampling.update(temperature=temperature, top_p=top_p, top_k=top_k or None,
                                 min_p=min_p or None)
        if repeat_penalty != 1.0:
            self.sampling["logits_processor"] = [RecentRepetitionPenalty(repeat_penalty,
                                                                         repeat_last_n)]
        self.context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self.ends, self.pad = end_tokens(model, tokenizer)

    def reset(self) -> None:
        self.messages = list(self.system)

    def prompt_line(self, printer: _Printer) -> str:
        """'; prompt N tokens (K cached), first token after S s' for the last answer: how much
        of the conversation the prompt cache held (a compiled model's decoder, where one ran)."""
        if printer.first is None:
            return ""
        decoder = self.model.decoder() if isinstance(self.model, CompiledModel) else None
        cached = "" if decoder is None else f" ({decoder.prompt_reused:,} cached)"
        return (f"; prompt {printer.prompt_tokens:,} tokens{cached}, first token after "
                f"{printer.first - printer.start:.2f} s")

    def _fit(self, messages: list[dict]) -> tuple[list[int], list[str], int, list[dict]]:
        """-> (prompt ids, stop strings, new tokens allowed, the turns kept): the oldest turns
        dropped until the prompt and max_new_tokens fit the context, or only the last message
        is left. ValueError if that alone leaves no room (or the chat template refuses)."""
        first = len(self.system)
        while True:
            ids, stops = chat_prompt(self.tokenizer, messages)
            room = self.max_new_tokens if self.context is None else self.context - len(ids)
            if room >= self.max_new_tokens or len(messages) - first <= 1:
                break
            # the oldest turn: a user message and the reply to it
            messages = messages[:first] + messages[first + min(2, len(messages) - first - 1):]
        if room < 1:
            raise ValueError(f"the message is {len(ids):,} tokens in the conversation's format, "
                             f"no fewer than the model's context of {self.context:,}: send a "
                             "shorter one")
        return ids, stops, min(room, self.max_new_tokens), messages

    def answer(self, message: str, out, note) -> _Printer:
        """Write the reply to the user's `message` to `out` as it is generated; both join the
        conversation (the reply also when Ctrl-C stops it: KeyboardInterrupt is raised on
        after that). ValueError, the conversation unchanged, where the message cannot be
        answered. `note(text)`: a line about what happened on the way."""
        asked = self.messages + [{"role": "user", "content": message}]
        ids, stops, new_tokens, kept = self._fit(asked)
        dropped = len(asked) - len(kept)
        if dropped:
            note(f"{dropped} of the oldest messages dropped to fit the model's context of "
                 f"{self.context:,} tokens")
        printer = _Printer(TextDeltas(self.tokenizer, stops), out, self.ends, len(ids))
        ids = torch.tensor([ids])
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                      eos_token_id=sorted(self.ends) or None, pad_token_id=self.pad,
                      streamer=printer, **self.sampling)
        try:
            self.model.generate(ids, **kwargs)
        except StopString:
            pass
        finally:  # Ctrl-C too: the answer so far is part of the conversation
            printer.finish_line()
            self.messages = kept + [{"role": "assistant", "content": printer.text.reply()}]
        return printer


def _read(prompt: str, stdin, interactive: bool) -> str:
    """One line without its newline; EOFError at the end of the input."""
    if interactive:
        return input(prompt)  # line editing on a terminal
    line = stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def _as_unicode(line: str) -> str:
    """The line with each byte that was not UTF-8 as U+FFFD (Python reads such bytes from
    standard input as lone surrogates, which no tokenizer takes)."""
    try:
        raw = line.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate that did not come from a byte
        raw = line.encode("utf-8", "replace")
    return raw.decode("utf-8", "replace")


def run(chat: Chat, stdin=None, stdout=None, stderr=None, quiet: bool = False) -> int:
    """The conversation loop until /exit or the end of the input (Ctrl-C at the prompt raises
    KeyboardInterrupt, as in any command). -> how many messages got no answer."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    interactive = stdin is sys.stdin and stdin.isatty()

    def say(text: str) -> None:  # what the user asked for, or an error: even when quiet
        print(f"picompile: {text}", file=stderr, flush=True)

    def note(text: str) -> None:  # status
        if not quiet:
            say(text)

    unanswered = 0
    if interactive:
        note(f"chat ({HELP})")
    while True:
        try:
            line = _read("> ", stdin, interactive)
        except EOFError:
            if interactive:
                print(file=stdout)
            return unanswered
        text = _as_unicode(line)
        if text != line:
            line = text
            say("the message is not valid UTF-8: its other bytes are read as U+FFFD")
        command = line.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            return unanswered
        if command == "/reset":
            chat.reset()
            say("the conversation is forgotten")
            continue
        if command == "/help":
            say(HELP)
            continue
        if command.startswith("/") and " " not in command:
            say(f"unknown command {command} (commands: {', '.join(COMMANDS)}); not sent")
            unanswered += 1
            continue
        try:
            printer = chat.answer(line, stdout, note)
        except ValueError as e:
            say(f"error: {e}")
            unanswered += 1
            continue
        except KeyboardInterrupt:
            note("answer stopped (Ctrl-C)")
            print(file=stdout)
            continue
        rate = printer.rate()
        note(f"{printer.count} tokens" + (f", {rate:.1f} tokens/s" if rate else "")
             + chat.prompt_line(printer))
        print(file=stdout)  # a blank line after each answer
