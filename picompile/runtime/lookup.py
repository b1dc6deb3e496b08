"""Drafts for prompt lookup decoding: speculative decoding whose draft model is the text so far.

A reply often repeats its prompt (a summary quoting it, code edited in place, an extraction)
or itself: where the last few tokens occurred before, the tokens that followed them then are
a good guess for what follows now. The decode loop (runtime/generate.py) runs such a draft
through the model in one step with the token before it (kernels/decoder.c takes up to 8
tokens and reads the weights once for all), keeps the drafted tokens up to the first that the
model's own pick differs from, and adds the pick there: the same tokens as decoding one at a
time (each is picked from the same logits, by the same processors and draws), in fewer steps.

This is Hugging Face's `prompt_lookup_num_tokens` (Saxena, "Prompt Lookup Decoding", 2023),
llama.cpp's lookup decoding and vLLM's n-gram speculator. The draft length adapts as Hugging
Face's assistant's "heuristic" schedule does: two longer after a draft accepted whole, one
shorter after one that was not, so that text that does not repeat costs little (a step of T
tokens costs more than one of a token where the machine is compute-bound, BENCHMARKS.md).
"""

from __future__ import annotations

MAX_NGRAM = 3  # the longest suffix looked up
MIN_NGRAM = 2  # the shortest: a single token's earlier successor is too often a poor guess


class PromptLookup:
    """The drafts for one sequence: `extend` it with each token the loop emits, ask `draft`
    for the next guess, and tell `accepted` how much of it the model took."""

    def __init__(self, tokens: list[int], max_draft: int):
        if max_draft < 1:
            raise ValueError(f"a draft of at least one token, got max_draft={max_draft}")
        self.max_draft = max_draft
        self.length = min(max_draft, 2)  # the next draft's, adapted by `accepted`
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

    def draft(self, limit: int) -> list[int]:
        """Up to min(limit, the adapted length) tokens that followed the latest earlier
        occurrence of the longest suffix (MAX_NGRAM .. MIN_NGRAM tokens) that occurred before;
        [] where none did."""
        k = min(limit, self.length)
        seq = self.tokens
        if k < 1:
            return []
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if len(seq) > n:
                at = self._after.get(tuple(seq[-n:]))
                if at is not None:
                    return seq[at:at + k]
        return []

    def accepted(self, drafted: int, taken: int) -> None:
        """A draft of `drafted` tokens of which the model took the first `taken`."""
        if drafted:
            self.length = (min(self.length + 2, self.max_draft) if taken == drafted
                           else max(1, self.length - 1))
