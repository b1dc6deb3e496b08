"""Decoder layers that placement leaves on the CPU: their time per decode step through the
model's own modules against kernels/decoder.c (runtime/decoder.py's HostLayers), on the CPU
stand-in for the GPU.

    PYTHONPATH=. .venv/bin/python benchmarks/host_layers.py       # hidden 1024, n_ff 4096
    PYTHONPATH=. .venv/bin/python benchmarks/host_layers.py --hidden 256 --n-ff 1024
(PYTHONPATH: the model is tests.zoo's.)

A random ReLU-Llama of 4 layers (tests/zoo.py), compiled in predicted mode with a budget that
holds all but the last layer's parts outside the FFN (so that one runs wholly on the host),
split with the CPU standing in for the GPU. The same device decoder then decodes 32 tokens with
its host layer bound to kernels/decoder.c and with it unbound (the modules), in turn, each round;
the figure is the median over steps of the timeline's host_s. The greedy tokens of both must be
equal (checked).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tests import zoo


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--n-ff", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    torch.manual_seed(0)
    dense = zoo.make("llama_relu", layers=4, hidden=args.hidden, n_ff=args.n_ff)
    cm, _ = zoo.last_layer_on_host(dense, max_context=256, quiet=True, mode="predicted",
                                   calibration=torch.randint(0, zoo.VOCAB, (4, 32)))
    cm.distribute("cpu")
    dec = cm.decoder()
    ids = torch.randint(0, zoo.VOCAB, (1, 16))
    cm.generate(ids, max_new_tokens=2, do_sample=False)  # reserve(): the host run bound
    bound = dict(dec.host_runs)
    if not bound:
        raise SystemExit(f"the host layers were not bound to kernels/decoder.c: {dec.host_reason}")

    def decode(runs) -> tuple[float, torch.Tensor]:
        dec.host_runs = runs
        dec.timeline = []
        out = cm.generate(ids, max_new_tokens=33, do_sample=False)
        steps = [s["host_s"] for s in dec.timings() if s["host_s"]]
        dec.timeline = None
        return statistics.median(steps), out

    times = {"modules": [], "kernels/decoder.c": []}
    for _ in range(args.rounds):
        t_mod, want = decode({})
        t_c, got = decode(bound)
        if not torch.equal(got, want):
            raise SystemExit("the two paths decoded different tokens")
        times["modules"].append(t_mod)
        times["kernels/decoder.c"].append(t_c)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {torch.get_num_threads()} "
          f"threads, hidden {args.hidden}, n_ff {args.n_ff}, host layers {list(bound)}, "
          f"{args.rounds} rounds of 32 steps")
    print("| host layers through | us per step (median of rounds) |")
    print("|---|---:|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts) * 1e6:.0f} |")


if __name__ == "__main__":
    main()
