"""Drafts for prompt lookup decoding: speculative decoding whose draft model is the text so far.

A reply often repeats its prompt (a summary quoting it, code edited in place, an extraction)
or itself: where the last few tokens occurred before, the tokens that followed them then are
a good guess for what follows now. The decode loop (runtime/generate.py) runs such a draft
through the model in one step with the token before it (kernels/decoder.c takes up to 8
tokens and reads the weights once for all), keeps the drafted tokens up to the first that the
model's own pick differs from, and adds the pick there: the same tokens as decoding one at a
time (each is picked from the same logits, by the same processors and draws), in fewer steps.

This is Hugging Face's `prompt_lookup_num_tokens` (Saxena, "Prompt Lookup Decoding", 2023),
llama.cpp's lookup decoding and vLLM's n-gram speculator. What a draft costs decides how long it
is: a step of T tokens costs c(T) (the decoder's own running measure, Decoder.step_seconds),
a drafted token is taken with probability a (this reply's rate so far), so a draft of K tokens
brings (1 - a^(K+1)) / (1 - a) tokens for c(K+1), and the K with the most tokens per second is
drafted, none where a token a step is better. Where steps of several tokens cost nearly what one
does (a large model, memory-bound) drafts run long; where they cost several times more (a small
model on two cores, compute-bound) only likely ones run.
"""

from __future__ import annotations

from collections.abc import Mapping

MAX_NGRAM = 3  # the longest suffix looked up
MIN_NGRAM = 2  # the shortest: a single token's earlier successor is too often a poor guess
# Before a step of T tokens has been timed: c(T) = c(1) * (1 + UNTIMED_SLOPE * (T - 1)), a
# hopeful guess (memory-bound steps), so that it is tried once and then known.
UNTIMED_SLOPE = 0.25
# The taken rate's prior: PRIOR_TAKEN of PRIOR_CHECKED checked drafted tokens.
PRIOR_TAKEN, PRIOR_CHECKED = 1.0, 2.0
# After this many guesses in a row not drafted, one token is drafted anyway: the cost of a
# step of two is timed again (a measure taken while the machine was busy would else stand).
RETRY_AFTER = 16


class PromptLookup:
    """The drafts for one sequence: `extend` it with each token the loop emits, ask `draft`
    for the next guess, and tell `accepted` how much of it the model took."""

    def __init__(self, tokens: list[int], max_draft: int):
        if max_draft < 1:
            raise ValueError(f"a draft of at least one token, got max_draft={max_draft}")
        self.max_draft = max_draft
        self.checked, self.taken = PRIOR_CHECKED, PRIOR_TAKEN  # drafted tokens checked, taken
        self.declined = 0  # guesses not drafted since the last draft
        self.tokens: list[int] = []
        # n-gram -> where its latest occurrence's successor is, for occurrences that have one
        self._after: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens) -> None:
        for t in tokens:
            seq = self.tokens
            end = len(seq)  # the n-grams ending here get their successor, t
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end >= n:
                    self._after[tuple(seq[end - n:end])] = end
            seq.append(int(t))

    def guess(self, limit: int) -> list[int]:
        """Up to min(limit, max_draft) tokens that followed the latest earlier occurrence of
        the longest suffix (MAX_NGRAM .. MIN_NGRAM tokens) that occurred before; [] where none
        did."""
        seq, k = self.tokens, min(limit, self.max_draft)
        if k >= 1:
            for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
                if len(seq) > n:
                    at = self._after.get(tuple(seq[-n:]))
                    if at is not None:
                        return seq[at:at + k]
        return []

    def draft(self, limit: int, step_seconds: Mapping[int, float]) -> list[int]:
        """The guess cut to the length with the most expected tokens per second of decoder
        step (step_seconds: T -> seconds a step of T tokens takes); [] where one token a step
        is better (but for every RETRY_AFTER-th such guess: one token), or nothing was timed
        yet."""
        guess = self.guess(limit)
        one = step_seconds.get(1)
        if not guess or not one:
            return []
        a = min(self.taken / self.checked, 0.99)
        best_k, best_rate = 0, 1.0 / one
        for k in range(1, len(guess) + 1):
            cost = step_seconds.get(k + 1) or one * (1 + UNTIMED_SLOPE * k)
            rate = (1 - a ** (k + 1)) / (1 - a) / cost
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0:
            self.declined += 1
            if self.declined < RETRY_AFTER:
                return []
            best_k = 1
        self.declined = 0
        return guess[:best_k]

    def accepted(self, drafted: int, taken: int) -> None:
        """A draft of `drafted` tokens of which the model took the first `taken` (those after
        the first it did not take were not checked)."""
        self.checked += min(taken + 1, drafted)
        self.taken += taken
