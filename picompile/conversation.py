"""What a chat needs besides the model, shared by the server (serve.py) and `picompile chat`
(chat.py): a conversation's prompt tokens, the tokens that end a reply, the reply's text as it
grows token by token, and generate()'s streamer that feeds it."""

from __future__ import annotations

import contextlib
import threading

DEFAULT_FORMAT_STOP = "\nuser:"


def default_chat_format(messages: list[dict]) -> str:
    """The prompt for a tokenizer without a chat template: "role: content" lines, then
    "assistant:" for the model to continue (its reply ends at DEFAULT_FORMAT_STOP)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class NoToolSupport(ValueError):
    """Tools were given for a model whose chat template cannot show them to it."""


def chat_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None
                ) -> tuple[list[int], list[str]]:
    """-> (the prompt's token ids, stop strings the format needs). The tokenizer's chat
    template where it has one (ValueError if the template refuses the messages), else
    default_chat_format with DEFAULT_FORMAT_STOP, so that the model does not write the user's
    next turn. tools: OpenAI's tool objects, for the template to describe (NoToolSupport where
    it has none, or it leaves them out: a template without tool support ignores them)."""
    if not getattr(tokenizer, "chat_template", None):
        if tools:
            raise NoToolSupport("the model has no chat template, and tools need one that "
                                "describes them to the model")
        return list(tokenizer(default_chat_format(messages))["input_ids"]), [DEFAULT_FORMAT_STOP]
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools or None,
                                             add_generation_prompt=True, tokenize=False)
    except Exception as e:  # a template may refuse a conversation (roles, order)
        raise ValueError(f"the model's chat template refused these messages: "
                         f"{type(e).__name__}: {e}") from None
    if tools and not all(t["function"]["name"] in text for t in tools):
        raise NoToolSupport("the model's chat template does not describe the tools to the "
                            "model (their names are not in its prompt): this model takes no "
                            "tools")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]), []


def end_tokens(model, tokenizer) -> tuple[set[int], int | None]:
    """-> (the token ids that end a reply: the model's generation config's and the tokenizer's
    EOS, the pad id for generate(): the tokenizer's, else the smallest of those)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ends = set([eos] if isinstance(eos, int) else eos or [])
    if tokenizer.eos_token_id is not None:
        ends.add(tokenizer.eos_token_id)
    pad = tokenizer.pad_token_id
    return ends, pad if pad is not None else min(ends, default=None)


class TextDeltas:
    """Token ids -> text deltas. Decodes incrementally with a few tokens of context (as vLLM
    does), so a step costs the same however long the reply; holds back an incomplete UTF-8
    character and any tail that may be the start of a stop string, and cuts at a stop string.
    `lock`: held around each decode (a fast tokenizer shared across threads is not safe)."""

    def __init__(self, tokenizer, stops=(), lock: threading.Lock | None = None):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read] decoded already, kept as context
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of it handed out

    def _decode(self, ids) -> str:
        with self.lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> tuple[str, bool]:
        """-> (new text to send, whether a stop string ended the reply)."""
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
        return self._release(final=False)

    def flush(self) -> tuple[str, bool]:
        """The rest at the end of the reply, less a last character the reply left incomplete
        (the bytes of half an emoji: vLLM drops them too, rather than end on U+FFFD)."""
        before = self._decode(self.ids[self.prefix:self.read])
        self.text += self._decode(self.ids[self.prefix:])[len(before):].removesuffix("\ufffd")
        self.prefix = self.read = len(self.ids)
        return self._release(final=True)

    def reply(self) -> str:
        """The reply's text so far, up to a stop string (what was handed out)."""
        return self.text[:self.sent]

    def _release(self, final: bool) -> tuple[str, bool]:
        # No stop string starts before `sent`: a tail that could begin one is never sent.
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        end = min(hits) if hits else len(self.text) if final else len(self.text) - self._held()
        delta, self.sent = self.text[self.sent:end], end
        return delta, bool(hits)

    def _held(self) -> int:
        """Length of the longest unsent tail of text that is a proper prefix of a stop string."""
        longest = max((len(s) for s in self.stops), default=1) - 1
        for k in range(min(longest, len(self.text) - self.sent), 0, -1):
            if any(s.startswith(self.text[-k:]) for s in self.stops):
                return k
        return 0


class StopString(Exception):
    """Raised from a ReplyStreamer: a stop string came out, the reply ends there."""


class ReplyStreamer:
    """generate()'s streamer (Hugging Face's protocol: put(prompt), put(each token), end()) for
    one reply: counts its tokens, hands its text to `on_text` as it grows, and raises
    StopString at a stop string; `finish` is "stop" (an end token or a stop string) or
    "length". The reply's text is `text` (TextDeltas: flush() it after generate)."""

    def __init__(self, text: TextDeltas, ends: set[int]):
        self.text, self.ends = text, ends
        self.prompt_seen = False
        self.count = 0  # tokens generated
        self.finish = "length"

    def on_text(self, delta: str) -> None:
        raise NotImplementedError

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.count += 1
        token = int(value.reshape(-1)[0])
        if token in self.ends:  # generate() ends here itself (one row)
            self.finish = "stop"
            return
        delta, stopped = self.text.add(token)
        if delta:
            self.on_text(delta)
        if stopped:
            self.finish = "stop"
            raise StopString

    def end(self) -> None:
        pass
