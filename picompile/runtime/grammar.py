"""Structured output: a reply held to a grammar, as OpenAI's, vLLM's and llama.cpp's servers
offer it (JSON for a schema or any JSON object, a regular expression, one of a list of
choices, a GBNF or Lark grammar).

`Grammars(tokenizer, vocab, eos)` wraps a tokenizer once (the first structured request waits);
`grammars.compile(format, text)` checks a grammar (GrammarError says what is wrong with it);
`grammars.constraint(grammar, prompt_tokens)` is a logits processor (Hugging Face's protocol, so
it runs in picompile's generate loop and in HF's) that gives every token the grammar does not
allow next a score of -inf, and allows only the end tokens once the grammar is complete; for a
model with no end token it raises GrammarComplete there instead (the caller ends the reply).

Why llguidance: the Rust matcher behind llama.cpp's and vLLM's guidance backends, a 3 MB wheel
without dependencies, which computes the allowed next tokens over the whole vocabulary in a
small part of a decode step; it reads JSON schemas, regular expressions, GBNF and Lark. It comes
with the `serve` extra and is imported only where a grammar is asked for.
"""

from __future__ import annotations

import importlib
import json

import torch

FORMATS = ("json_schema", "regex", "choice", "grammar")  # grammar: GBNF or Lark
# JSON's whitespace between tokens, as llama.cpp's JSON grammars bound it: none, a space, or a
# newline and up to 20 spaces or tabs of indent. Unbounded, a small model can fill its whole
# reply with newlines inside "{ }"; a schema's own "x-guidance" options replace this.
JSON_WHITESPACE = r"( |\n[ \t]{0,20})?"


class GrammarError(ValueError):
    """A grammar llguidance cannot read or hold a reply to, with what it says (less the dump
    of its parser's state and the grammar that its errors end with)."""

    def __init__(self, message: str):
        super().__init__(message.split("<state>")[0].strip())


class GrammarComplete(Exception):
    """Raised by a constraint whose grammar is complete and allows nothing more, where the model
    has no end token to pick: the reply ends (without it the loop would go on to its length
    limit on whatever the masked scores give)."""


def require():
    """The llguidance module, or ImportError with the install command."""
    try:
        return importlib.import_module("llguidance")
    except ImportError as e:
        raise ImportError(f"structured output needs llguidance ({e}); install it with: "
                          "pip install 'picompile[serve]'") from None


class Grammars:
    """Grammars for one tokenizer: `vocab` is the model's logits width, `eos` its end tokens
    (what a complete grammar allows next)."""

    def __init__(self, tokenizer, vocab: int, eos: list[int]):
        llguidance = require()
        import llguidance.hf
        import llguidance.torch

        self._llg, self._torch = llguidance, llguidance.torch
        self.eos = list(eos)
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab,
                                                          eos_token=list(eos) or None)
        except (AttributeError, TypeError, ValueError) as e:
            raise GrammarError(f"structured output needs a fast (tokenizers) tokenizer; "
                               f"{type(tokenizer).__name__} cannot be read ({e})") from None

    def compile(self, format: str, text: str) -> str:
        """The grammar of `text` in `format` (FORMATS), checked against the tokenizer."""
        if format not in FORMATS:
            raise GrammarError(f"unknown grammar format {format!r}: one of {', '.join(FORMATS)}")
        if format == "json_schema":
            text = _bounded_whitespace(text)
        try:
            grammar = self._llg.grammar_from(format, text)
        except ValueError as e:
            raise GrammarError(str(e)) from None
        error = self._llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GrammarError(error)
        return grammar

    def constraint(self, grammar: str, prompt_tokens: int) -> GrammarConstraint:
        return GrammarConstraint(self, grammar, prompt_tokens)


# [256, 8]: for each byte value, 0 where its bit i is set and -inf where not
_BYTE_SCORES = torch.tensor([[0.0 if byte >> i & 1 else float("-inf") for i in range(8)]
                             for byte in range(256)])


def _bounded_whitespace(schema_text: str) -> str:
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return schema_text  # llguidance says what is wrong with it
    if not isinstance(schema, dict) or "x-guidance" in schema:
        return schema_text
    return json.dumps({**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}})


class GrammarConstraint:
    """A logits processor holding one reply (batch of 1) to a compiled grammar: it feeds the
    matcher the tokens generated since its last call (those after the first `prompt_tokens`),
    then masks the scores [1, V] to the tokens allowed next."""

    def __init__(self, grammars: Grammars, grammar: str, prompt_tokens: int):
        self._torch = grammars._torch
        self.matcher = grammars._llg.LLMatcher(grammars.tokenizer, grammar)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        # bit b of int32 word w: token 32 w + b is allowed
        self.mask = self._torch.allocate_token_bitmask(1, grammars.tokenizer.vocab_size)
        self.prompt_tokens, self.fed = prompt_tokens, 0
        self.ends = bool(grammars.eos)  # the model has an end token, which ends a complete reply
        self._fill()  # the first mask now: a grammar its parser cannot start fails here

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] != 1:
            raise ValueError(f"a grammar holds one reply, got a batch of {input_ids.shape[0]}")
        new = input_ids[0, self.prompt_tokens + self.fed:].tolist()  # since the last call
        if new:
            for token in new:
                if not self.matcher.consume_token(token):
                    raise GrammarError(f"token {token} breaks the grammar: "
                                       f"{self.matcher.get_error()}")
            self.fed += len(new)
            if self.matcher.is_stopped() and not self.ends:
                raise GrammarComplete
            self._fill()
        # 0 or -inf per token, a byte's 8 at a time (llguidance's apply_token_bitmask_inplace
        # is TorchScript, compiled at its first call: a pause of seconds, BENCHMARKS.md)
        add = _BYTE_SCORES[self.mask[0].view(torch.uint8).long()].reshape(-1)  # little-endian
        return scores.add_(add[:scores.shape[-1]].to(scores.device))

    def _fill(self) -> None:
        self._torch.fill_next_token_bitmask(self.matcher, self.mask, 0)
        if self.matcher.is_error():  # a limit of its parser hit (its mask would end the reply)
            raise GrammarError(f"the grammar cannot be followed past {self.fed} tokens of the "
                               f"reply: {self.matcher.get_error()}")
