"""A multi-turn chat with the prompt cache and without it: time to the first token per turn.

    .venv/bin/python benchmarks/prompt_cache.py                  # SmolLM2-135M-Instruct, 6 turns
    .venv/bin/python benchmarks/prompt_cache.py --turns 8 --new-tokens 32 --rounds 2
    .venv/bin/python benchmarks/prompt_cache.py --message-chars 200 --new-tokens 64  # short turns
    .venv/bin/python benchmarks/prompt_cache.py --interrupt     # a title request after each turn

Each turn sends the whole conversation so far through the model's chat template, as
`picompile chat` and a client of `picompile serve` do: the user's message (a paragraph of the
built-in corpus's held-out split), then a greedy reply of --new-tokens tokens that is kept in
the conversation (--message-chars: how much of the paragraph). With the prompt cache (runtime/decoder.py, Stack.cached_prefix) a turn
prefills only the tokens after those the C decoder's KV cache holds from the turn before; with
PICOMPILE_PROMPT_CACHE=0 it prefills the whole conversation. The two conversations run one after
the other, --rounds times (cache on first, then off), over the same prompts: the first run's
replies make every run's history. How many replies equal the first run's is printed (exact mode:
all; in threshold mode a neuron within rounding of its threshold can tip a near-tie, since the
cached keys and values of a reply come from its decode steps, a prefill's from a batch), then per
turn: prompt tokens, positions reused, medians of the time from
the generate() call to the first new token (prefill + first pick), and their ratio.
--interrupt sends another prompt after each turn (untimed), as chat UIs ask the model for a
title of the conversation: the next turn then finds the conversation in the C decoder's
snapshots (config.PROMPT_SNAPSHOTS), not in the KV cache.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from machine import default_model  # benchmarks/machine.py
from picompile import corpus
from picompile.config import PROMPT_CACHE_ENV
from picompile.conversation import chat_prompt, end_tokens
from picompile.timing import FirstTokenClock


def conversation(cm, tokenizer, messages: list[str], new_tokens: int, cache: bool,
                 history: list[str] | None = None, interrupt: bool = False):
    """-> [(prompt tokens, positions reused, seconds to the first token)], the replies. With
    `history`, those replies join the conversation instead of the ones generated (so that two
    runs send the very same prompts)."""
    os.environ[PROMPT_CACHE_ENV] = "1" if cache else "0"
    ends, pad = end_tokens(cm, tokenizer)
    chat, rows, replies = [], [], []
    cm.decoder().forget()  # a new conversation: nothing of it cached
    for i, text in enumerate(messages):
        chat.append({"role": "user", "content": text})
        ids = torch.tensor([chat_prompt(tokenizer, chat)[0]])
        clock = FirstTokenClock()
        start = time.perf_counter()
        out = cm.generate(ids, max_new_tokens=new_tokens, do_sample=False, streamer=clock,
                          eos_token_id=sorted(ends), pad_token_id=pad)
        rows.append((ids.shape[1], cm.decoder().prompt_reused, clock.first - start))
        reply = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        replies.append(reply)
        chat.append({"role": "assistant", "content": reply if history is None else history[i]})
        if interrupt:  # a title request of the conversation's first message (untimed)
            title = [{"role": "user", "content": "Write a five-word title for this text: "
                                                 + messages[0][:300]}]
            cm.generate(torch.tensor([chat_prompt(tokenizer, title)[0]]), max_new_tokens=8,
                        do_sample=False, eos_token_id=sorted(ends), pad_token_id=pad)
    return rows, replies


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--message-chars", type=int, default=1500,
                    help="each user message: the first this many characters of its paragraph")
    ap.add_argument("--interrupt", action="store_true",
                    help="another prompt after each turn (a chat UI's title request)")
    args = ap.parse_args()

    cm, tokenizer = default_model(args.sparsity)
    if cm.decoder() is None:
        raise SystemExit(f"no C decoder runs this model ({cm.decoder_reason}): no prompt cache")
    texts = [t for t in corpus.default_texts("heldout") if 600 < len(t) < 2400]
    messages = [t[: args.message_chars] for t in texts[: args.turns]]
    conversation(cm, tokenizer, texts[-1:], 4, cache=True)  # warm-up
    runs, history, same = {True: [], False: []}, None, []
    for _ in range(args.rounds):
        for cache in (True, False):
            rows, replies = conversation(cm, tokenizer, messages, args.new_tokens, cache, history,
                                         args.interrupt)
            runs[cache].append(rows)
            history = history or replies
            same.append(sum(a == b for a, b in zip(replies, history)))
    print(f"{torch.get_num_threads()} threads, {args.turns} turns, {args.new_tokens} new tokens "
          f"a turn, medians of {args.rounds} rounds; replies equal to the first run's: "
          f"{min(same)} to {max(same)} of {args.turns} per run"
          + ("; a title request after each turn" if args.interrupt else ""))
    print("| turn | prompt tokens | reused | first token, cache (ms) | without (ms) | ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for t in range(args.turns):
        on = statistics.median(r[t][2] for r in runs[True])
        off = statistics.median(r[t][2] for r in runs[False])
        n, reused = runs[True][0][t][:2]
        print(f"| {t + 1} | {n} | {reused} | {on * 1e3:.0f} | {off * 1e3:.0f} | {off / on:.2f}x |")


if __name__ == "__main__":
    main()
