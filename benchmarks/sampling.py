"""What sampling, penalties, log-probabilities and grammars cost per decoded token.

    .venv/bin/python benchmarks/sampling.py                    # SmolLM2-135M-Instruct, threshold @50%
    .venv/bin/python benchmarks/sampling.py --new-tokens 128 --rounds 5

The default model compiled as `picompile run` compiles it (the GGUF file's blocks, threshold
sparsity --sparsity), one chat prompt, and cm.generate with each of these, in turn within each
round (the machine's drift spread over all):

  greedy      argmax, nothing else
  sampled     temperature 0.8, top_k 40, top_p 0.95, min_p 0.05
  top_p       temperature 0.8, top_p 0.95 (no top-k: what an OpenAI client's request samples)
  repetition  greedy with repetition_penalty 1.1 (HF's, over prompt and reply)
  openai      greedy with FrequencyPresencePenalty(0.5, 0.5) (serve's frequency/presence)
  logprobs    greedy with serve's log-probability recorder, 5 alternatives a token
  regex       greedy held to the regular expression [a-z ,.]+ (runtime/grammar.py; never ends)
  json        greedy held to any JSON object (ends where the object does)

Each row: decode tokens/s over the tokens after the first (so prefill is not counted), the
median over rounds, and the median of each round's ratio to greedy's. Every configuration but
json decodes exactly --new-tokens tokens (min_new_tokens holds EOS back).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from machine import default_model  # benchmarks/machine.py
from picompile.conversation import chat_prompt, end_tokens
from picompile.runtime.grammar import Grammars
from picompile.runtime.sampling import FrequencyPresencePenalty
from picompile.serve import _Logprobs  # the server's recorder, as it runs there
from picompile.timing import timed_generate

PROMPT = "Write a short story about a lighthouse keeper and a storm."


def configurations(tokenizer, grammars: Grammars, prompt_tokens: int) -> dict:
    """name -> a function giving that run's generate() keyword arguments (fresh processors)."""
    lock = threading.Lock()
    return {
        "greedy": lambda: {},
        "sampled": lambda: dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.95,
                                min_p=0.05),
        "top_p": lambda: dict(do_sample=True, temperature=0.8, top_p=0.95, top_k=0),
        "repetition": lambda: dict(repetition_penalty=1.1),
        "openai": lambda: dict(logits_processor=[
            FrequencyPresencePenalty(prompt_tokens, 0.5, 0.5)]),
        "logprobs": lambda: dict(logits_processor=[_Logprobs(5, tokenizer, lock)]),
        "regex": lambda: dict(logits_processor=[grammars.constraint(
            grammars.compile("regex", "[a-z ,.]+"), prompt_tokens)]),
        "json": lambda: dict(logits_processor=[grammars.constraint(
            grammars.compile("json_schema", '{"type": "object"}'), prompt_tokens)],
            min_new_tokens=0),
    }


def decode_rate(cm, ids, new_tokens: int, ends: list[int], pad: int, kwargs: dict):
    """-> (tokens generated, decode tokens/s after the first)."""
    new, rate = timed_generate(cm, ids, new_tokens, exact_length=True, eos_token_id=ends,
                               pad_token_id=pad, **kwargs)
    return len(new), rate


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sparsity", type=float, default=0.5)
    args = ap.parse_args()

    cm, tokenizer = default_model(args.sparsity)
    ends, pad = end_tokens(cm, tokenizer)
    ends = sorted(ends)
    ids = torch.tensor([chat_prompt(tokenizer, [{"role": "user", "content": PROMPT}])[0]])
    grammars = Grammars(tokenizer, cm.config.vocab_size, ends)
    configs = configurations(tokenizer, grammars, ids.shape[1])
    for make in configs.values():  # warm-up: kernels, the grammar's first mask
        decode_rate(cm, ids, 8, ends, pad, make())
    rates = {name: [] for name in configs}
    counts = {name: 0 for name in configs}
    for _ in range(args.rounds):
        for name, make in configs.items():
            counts[name], rate = decode_rate(cm, ids, args.new_tokens, ends, pad, make())
            rates[name].append(rate)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {torch.get_num_threads()} "
          f"threads, decoder: {cm.decoder() is not None}, {args.rounds} rounds")
    print("| run | tokens | decode tok/s (median) | vs greedy (median of rounds) |")
    print("|---|---:|---:|---:|")
    for name in configs:
        ratio = statistics.median(r / g for r, g in zip(rates[name], rates["greedy"]))
        print(f"| {name} | {counts[name]} | {statistics.median(rates[name]):.1f} | "
              f"{ratio:.3f} |")


if __name__ == "__main__":
    main()
