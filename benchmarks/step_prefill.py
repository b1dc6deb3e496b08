"""A prompt's uncached tokens through the model's prefill or through the C decoder's own steps:
where config.STEP_PREFILL_MAX_TOKENS comes from.

    .venv/bin/python benchmarks/step_prefill.py                      # SmolLM2-135M, after 400 cached
    .venv/bin/python benchmarks/step_prefill.py --cached 0 --tokens 4 16 32 48

The default model compiled as `picompile chat` compiles it (the GGUF file's blocks, threshold
sparsity 50%). After --cached positions already in the decoder's KV cache (the prompt cache's
case: a chat's next message), n new tokens are prefilled both ways, in turn in each round:

  modules  as generate() runs the model's prefill: the cached positions copied into a Hugging
           Face StaticCache (Decoder.prefix_into), the model's forward over the n tokens, the
           new positions copied back (Decoder.load_cache)
  steps    Decoder.prefill: steps of up to 8 tokens through kernels/decoder.c

Printed: the median milliseconds of each over --rounds rounds and their ratio.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
from transformers import StaticCache

from machine import cpu_name, default_model  # benchmarks/machine.py
from picompile.runtime.generate import cache_kwarg


@torch.no_grad()
def through_modules(cm, dec, ids: torch.Tensor, start: int) -> None:
    model, n = cm._orig_mod, ids.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=n)
    if start:
        dec.prefix_into(cache, start)
    model(ids[:, start:], **{cache_kwarg(model): cache}, use_cache=True,
          position_ids=torch.arange(start, n)[None], logits_to_keep=1)
    dec.load_cache(cache, n, start=start)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cached", type=int, default=400)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 24, 32, 48, 64])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    cm, _ = default_model(0.5)
    dec = cm.decoder()
    total = args.cached + max(args.tokens)
    dec.reserve(total)
    dec.set_threads()
    ids = torch.randint(100, 20000, (1, total), generator=torch.Generator().manual_seed(0))
    if args.cached:
        dec.prefill(ids[:, :args.cached])  # any keys and values: the cost does not read them
    ways = {"modules": lambda n: through_modules(cm, dec, ids[:, :args.cached + n], args.cached),
            "steps": lambda n: dec.prefill(ids[:, :args.cached + n], start=args.cached)}
    ms = {(way, n): [] for way in ways for n in args.tokens}
    for _ in range(args.rounds):
        for n in args.tokens:
            for way, run in ways.items():
                t0 = time.perf_counter()
                run(n)
                ms[way, n].append((time.perf_counter() - t0) * 1e3)
    print(f"{cpu_name()}, {torch.get_num_threads()} threads; "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; SmolLM2-135M-Instruct, the "
          f"Q4_1 file's blocks, threshold @50%; after {args.cached} cached positions, medians of "
          f"{args.rounds} rounds")
    print("\n| new tokens | modules (ms) | steps (ms) | modules / steps |\n|---:|---:|---:|---:|")
    for n in args.tokens:
        a, b = statistics.median(ms["modules", n]), statistics.median(ms["steps", n])
        print(f"| {n} | {a:.0f} | {b:.0f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
