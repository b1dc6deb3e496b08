"""Prompt lookup decoding against decoding a token a step, on tasks whose replies repeat their
prompt and on open-ended ones.

    .venv/bin/python benchmarks/lookup.py                  # SmolLM2-135M-Instruct, as `picompile chat`
    .venv/bin/python benchmarks/lookup.py --rounds 5 --new-tokens 128 --lookup 7
    .venv/bin/python benchmarks/lookup.py --mode predicted  # trained predictors (4096 tokens)

The default model compiled as `picompile chat` compiles it (the GGUF file's blocks, threshold
sparsity --sparsity; with --mode predicted, predictors trained on the built-in corpus and run
in every block at that sparsity); each task is a chat prompt answered greedily, once a token a
step and once with prompt lookup (cm.prompt_lookup = --lookup), in turn within each round (the order swapped
every other round, so the machine's drift falls on both). Per task: decode tokens/s after the
first token (timing.timed_generate), the median over rounds, the median of the per-round ratios,
decoder steps per new token with lookup, and whether both replies were the same tokens (each
call prefills the whole prompt: the prompt cache, which would serve the second of a pair, is
emptied first, so that both decode from the same keys and values). With
llama.cpp built (benchmarks/peers.py), its plain decode of the same file (llama-bench -n
--new-tokens, best of the rounds) is printed beside, for scale.
"""

from __future__ import annotations

import argparse
import datetime
import statistics

import torch

from machine import cpu_name, default_model  # benchmarks/machine.py
from picompile import bench, corpus, models
from picompile.conversation import chat_prompt, end_tokens
from picompile.timing import timed_generate

CODE = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = sum(values[:window])
    out.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out
'''


def tasks() -> dict[str, str]:
    text = corpus.default_texts("heldout")[0][:1400]  # Python's reference docs
    return {
        "summarize": "Summarize this text in a few sentences:\n\n" + text,
        "extract": "List the names and numbers that appear in this text, one per line:\n\n" + text,
        "rewrite": "Rewrite this text in simpler words, keeping its sentences:\n\n" + text[:700],
        "code": "Add type hints to this function and show the whole function:\n\n" + CODE,
        "story": "Write a short story about a robot who learns to paint.",
        "explain": "Explain how a rainbow forms.",
    }


class StepCounter:
    """Counts the decoder's steps (wraps the bound decoder's step for one generate)."""

    def __init__(self, dec):
        self.dec, self.step, self.steps = dec, dec.step, 0
        dec.step = self

    def __call__(self, tokens, pos):
        self.steps += 1
        return self.step(tokens, pos)

    def close(self):
        del self.dec.step


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--lookup", type=int, default=7)
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--mode", choices=["threshold", "predicted"], default="threshold")
    ap.add_argument("--calibration-tokens", type=int, default=4096,
                    help="predicted mode: tokens the predictors are trained on")
    args = ap.parse_args()

    predicted = dict(mode="predicted", predictors="all",
                     calibration_tokens=args.calibration_tokens) if args.mode == "predicted" else {}
    cm, tokenizer = default_model(args.sparsity, **predicted)
    ends, pad = end_tokens(cm, tokenizer)
    prompts = {name: torch.tensor([chat_prompt(tokenizer, [{"role": "user", "content": t}])[0]])
               for name, t in tasks().items()}
    kw = dict(eos_token_id=sorted(ends), pad_token_id=pad)
    timed_generate(cm, prompts["story"], 8, **kw)  # warm-up: kernels, decoder, its cache

    rates = {(name, k): [] for name in prompts for k in (0, args.lookup)}
    steps, new, same = {}, {}, {}
    for r in range(args.rounds):
        for name, ids in prompts.items():
            replies = {}
            for k in ((0, args.lookup) if r % 2 == 0 else (args.lookup, 0)):
                cm.prompt_lookup = k
                cm.decoder().forget()  # both prefill the whole prompt: the same keys and values
                counter = StepCounter(cm.decoder())
                try:
                    replies[k], tps = timed_generate(cm, ids, args.new_tokens, **kw)
                finally:
                    counter.close()
                rates[name, k].append(tps)
                if k:
                    steps[name], new[name] = counter.steps, len(replies[k])
            same[name] = same.get(name, True) and torch.equal(replies[0], replies[args.lookup])
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    bins, llama = bench.llama_cpp_bins(), None
    if bins is not None:
        llama = max(bench.llama_bench(bins, models.default_gguf(), torch.get_num_threads(),
                                      args.new_tokens, repetitions=1) for _ in range(args.rounds))
    print(f"\n{cpu_name()}, {torch.get_num_threads()} threads; "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    print(f"SmolLM2-135M-Instruct, the Q4_1 file's blocks, {args.mode} @{args.sparsity:.0%}, "
          f"greedy, up to {args.new_tokens} new tokens, {args.rounds} rounds, lookup {args.lookup}"
          + ("" if llama is None else f"; llama.cpp decode (llama-bench, same file) {llama:.1f} "
             "tok/s"))
    print("\n| task | new tokens | a token a step tok/s | lookup tok/s | ratio (median of rounds) "
          "| steps per token | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in prompts:
        plain, fast = rates[name, 0], rates[name, args.lookup]
        ratio = statistics.median(f / p for f, p in zip(fast, plain))
        print(f"| {name} | {new[name]} | {statistics.median(plain):.1f} | "
              f"{statistics.median(fast):.1f} | **{ratio:.2f}x** | "
              f"{steps[name] / max(new[name] - 1, 1):.2f} | {'yes' if same[name] else 'no'} |")


if __name__ == "__main__":
    main()
