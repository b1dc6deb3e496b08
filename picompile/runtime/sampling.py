"""The next token from a step's logits, as Hugging Face's generate picks it.

`Picker` applies, in the order HF's `_get_logits_processor` builds them: the repetition penalty,
EOS held back before min_new_tokens, the caller's logits processors (HF's protocol: a callable
(input_ids [B, n], scores [B, V]) -> scores), then, when sampling, temperature, top-k, top-p and
min-p, and draws; greedy takes the argmax. Each piece is HF's arithmetic, so greedy tokens equal
HF's and sampled ones come from HF's distribution (tests/test_generate.py). The draw is not
HF's: torch.multinomial draws one exponential per vocabulary entry, a sizeable part of a CPU
decode step, where one uniform per row through the cumulative distribution costs little
(BENCHMARKS.md, session 22); so a seed gives its own tokens, not HF's for that seed.

`FrequencyPresencePenalty` (OpenAI's frequency and presence penalties), `LogitBias` (OpenAI's
logit_bias) and `RecentRepetitionPenalty` (llama.cpp's repeat_penalty over its last tokens),
which HF does not have, are such logits processors, for `serve`: being ones, they run in HF's
generate too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

GREEDY_BELOW = 1e-5  # a sampling temperature below this decodes greedily (vLLM's _SAMPLING_EPS)
# Top-p without top-k looks for the nucleus among this many likeliest tokens first, and sorts
# the whole vocabulary only where they hold less than top_p of the probability.
NUCLEUS_PROBE = 128

LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Picker:
    """Next tokens [B] from float32 logits [B, V] at each step of one generate call."""

    def __init__(self, *, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None,
                 min_p: float | None = None, repetition_penalty: float = 1.0,
                 logits_processor: Sequence[LogitsProcessor] = (),
                 eos: torch.Tensor | None = None, min_new_tokens: int = 0,
                 prompt_pad: torch.Tensor | None = None, seed: int | None = None,
                 device: torch.device | str = "cpu"):
        """eos: the EOS ids [E] held back for the first min_new_tokens picks; prompt_pad [B]:
        each row's left padding, whose tokens the repetition penalty skips (as HF does).
        seed: the draws' own generator (torch's global RNG when None)."""
        if do_sample and not temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
        if top_p is not None and not 0 <= top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1], got {top_p}")
        if min_p is not None and not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        if not repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 is off), got "
                             f"{repetition_penalty}")
        if do_sample and temperature < GREEDY_BELOW:  # vLLM's rule: the logits divided by such a
            do_sample = False  # temperature overflow float32, and sampling would be argmax anyway
        self.do_sample, self.temperature, self.top_k, self.top_p, self.min_p = (
            do_sample, temperature, top_k, top_p, min_p)
        self.repetition_penalty, self.prompt_pad = repetition_penalty, prompt_pad
        self.processors = list(logits_processor)
        self.eos, self.min_new_tokens = eos, min_new_tokens
        self.generator = None
        if do_sample and seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor, step: int) -> torch.Tensor:
        """ids [B, n]: the prompt and the tokens picked so far; scores [B, V] float32 (changed
        in place); step: how many tokens this call has picked before."""
        if self.repetition_penalty != 1.0:
            scores = repetition_penalty(ids, scores, self.repetition_penalty, self.prompt_pad)
        if self.eos is not None and step < self.min_new_tokens:  # (ids past the vocabulary:
            eos = self.eos  # none held)
            scores[:, eos[(eos >= 0) & (eos < scores.shape[-1])]] = float("-inf")
        for process in self.processors:
            scores = process(ids, scores)
        if not self.do_sample:
            return scores.argmax(-1)
        candidates, index = self.candidates(scores)
        picked = draw(candidates.softmax(-1), self.generator)  # [B]
        return picked if index is None else index.gather(1, picked[:, None]).squeeze(1)

    def warp(self, scores: torch.Tensor) -> torch.Tensor:
        """HF's warpers' scores [B, V] (what candidates() leaves out: -inf)."""
        candidates, index = self.candidates(scores)
        if index is None:
            return candidates
        return torch.full_like(scores, float("-inf")).scatter_(1, index, candidates)

    def candidates(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """HF's warpers in HF's order: temperature, top-k, top-p (nucleus, keeping at least the
        most likely token), min-p (after temperature, as llama.cpp does) -> (scores [B, n],
        their columns [B, n] or None for all V). After top-k the rest works on its k tokens
        (and ties with the k-th, which HF keeps), not the whole vocabulary."""
        index = None
        if self.temperature != 1.0:
            scores = scores / self.temperature
        if self.top_k is not None and 0 < self.top_k < scores.shape[-1]:
            top, index = scores.topk(self.top_k)  # descending
            kth = top[:, -1:]
            tied = int((scores >= kth).sum(-1).max())
            if tied > self.top_k:
                top, index = scores.topk(tied)
            scores = top.masked_fill(top < kth, float("-inf"))
        nucleus = self.top_p is not None and self.top_p < 1.0
        if nucleus and index is None:
            scores, index = _nucleus_among_likeliest(scores, self.top_p)
            nucleus = index is None  # not found there: sorted below
        if nucleus:
            ascending, order = _ascending(scores)  # [B, n]: the -inf left out where few
            drop = ascending.softmax(-1).cumsum(-1) <= 1 - self.top_p
            drop[:, -1] = False
            scores = scores.masked_fill(torch.zeros_like(scores, dtype=torch.bool).scatter_(
                1, order, drop), float("-inf"))
        if self.min_p is not None:
            probs = scores.softmax(-1)
            drop = probs < self.min_p * probs.amax(-1, keepdim=True)
            drop.scatter_(1, probs.argmax(-1, keepdim=True), False)
            scores = scores.masked_fill(drop, float("-inf"))
        return scores, index


def _nucleus_among_likeliest(scores: torch.Tensor, top_p: float
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Top-p over scores [B, V] through its NUCLEUS_PROBE likeliest tokens, where they hold at
    least top_p of each row's probability (the nucleus is then among them): -> (their scores
    [B, n], the tokens outside the nucleus -inf; their columns [B, n]). Else (scores, None):
    the caller sorts the whole vocabulary. HF keeps a token iff the probability of the tokens
    likelier than it is below top_p (its ascending cumulative sum above 1 - top_p), and so
    does this, with the sums taken in another order (equal but for rounding)."""
    if scores.shape[-1] <= 8 * NUCLEUS_PROBE:
        return scores, None
    probs, index = scores.softmax(-1).topk(NUCLEUS_PROBE)  # [B, n] descending
    if not bool((probs.sum(-1) >= top_p).all()):
        return scores, None
    above = probs.cumsum(-1) - probs  # [B, n]: the probability of the likelier tokens
    drop = above >= top_p
    drop[:, 0] = False  # the likeliest token stays, as HF keeps at least one
    return scores.gather(1, index).masked_fill(drop, float("-inf")), index


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of probs [B, V] (rows summing to 1, zeros never drawn): a uniform
    through the row's cumulative distribution (float64)."""
    cdf = probs.double().cumsum(-1)  # [B, V]
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device,
                   generator=generator)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_(
        max=probs.shape[-1] - 1)


def _ascending(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, indices) [B, n] of each row of scores [B, V] in ascending order, less the
    leading -inf where top-k left only n << V (HF sorts them all: the same cumulative sums).
    On the CPU numpy sorts (several times faster than torch's CPU sort: BENCHMARKS.md)."""
    n = int(torch.isfinite(scores).sum(-1).max())
    if n < scores.shape[-1] // 8:
        values, order = scores.topk(n)  # descending
        return values.flip(-1), order.flip(-1)
    if scores.device.type == "cpu":
        order = torch.from_numpy(np.argsort(scores.numpy(), axis=-1))
    else:
        order = scores.argsort(-1)
    return scores.gather(1, order), order


def repetition_penalty(ids: torch.Tensor, scores: torch.Tensor, penalty: float,
                       prompt_pad: torch.Tensor | None = None) -> torch.Tensor:
    """HF's RepetitionPenaltyLogitsProcessor: the score of every token in ids [B, n] (but a
    row's first prompt_pad[b] positions) divided by `penalty` where positive, multiplied where
    negative. scores [B, V]."""
    vocab = scores.shape[-1]
    ids = ids.clamp(max=vocab)  # column `vocab`: a dummy for skipped and unknown ids
    if prompt_pad is not None:
        positions = torch.arange(ids.shape[1], device=ids.device)
        ids = ids.masked_fill(positions < prompt_pad[:, None], vocab)
    padded = torch.nn.functional.pad(scores, (0, 1))
    seen = padded.gather(1, ids)
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return padded.scatter(1, ids, seen)[:, :vocab]


class FrequencyPresencePenalty:
    """OpenAI's penalties as an HF logits processor: each token's score minus
    frequency * (times it was generated) + presence * (1 if it was), counting the tokens after
    the first `prompt_tokens` (the reply so far, as OpenAI and vLLM count them)."""

    def __init__(self, prompt_tokens: int, frequency: float = 0.0, presence: float = 0.0):
        self.prompt_tokens, self.frequency, self.presence = prompt_tokens, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """scores [B, V] changed in place at the reply's tokens only (a reply is short beside
        the vocabulary: no [B, V] pass)."""
        reply = input_ids[:, self.prompt_tokens:]  # [B, generated]
        if reply.shape[1] == 0:
            return scores
        for b in range(reply.shape[0]):
            tokens, counts = reply[b].unique(return_counts=True)  # [u] each
            inside = tokens < scores.shape[1]
            tokens, counts = tokens[inside], counts[inside].to(scores.dtype)
            scores[b, tokens] -= self.frequency * counts + self.presence
        return scores


class LogitBias:
    """OpenAI's logit_bias as an HF logits processor: each listed token's score plus its bias
    ({token id: bias}; -100 bans a token in practice, 100 all but forces it)."""

    def __init__(self, bias: dict[int, float]):
        self.tokens = torch.tensor(list(bias), dtype=torch.long)  # [n]
        self.bias = torch.tensor(list(bias.values()), dtype=torch.float32)  # [n]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores[:, self.tokens] += self.bias.to(scores.dtype)
        return scores


class RecentRepetitionPenalty:
    """llama.cpp's repeat_penalty as an HF logits processor: HF's repetition penalty over the
    last `last_n` tokens of the prompt and reply only (llama.cpp's repeat_last_n, 64 by
    default; -1: all of them)."""

    def __init__(self, penalty: float, last_n: int = 64):
        if not penalty > 0:
            raise ValueError(f"repeat_penalty must be > 0 (1 is off), got {penalty}")
        self.penalty, self.last_n = penalty, last_n

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.last_n == 0 or self.penalty == 1.0:
            return scores
        recent = input_ids if self.last_n < 0 else input_ids[:, -self.last_n:]
        return repetition_penalty(recent, scores, self.penalty)
