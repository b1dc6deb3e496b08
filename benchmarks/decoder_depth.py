"""The whole-step decoder's C step at several context depths: this tree's kernels/decoder.c
against the decoder.c of another git revision, alternating in one process on one compiled model.

    .venv/bin/python benchmarks/decoder_depth.py --base 79ac959                  # float32 KV
    .venv/bin/python benchmarks/decoder_depth.py --base 79ac959 --kv-cache float16 --depths 2048

The model is the shipped SmolLM2-135M-Instruct from its Q4_1 file (compile(gguf=...), exact
mode), its decoder built once by this tree's library (the larger scratch of the two), then its
library swapped between the two builds: `--rounds` rounds of `--steps` C decode steps each
(picompile.bench.decoder_tps: steps after `depth` positions, so each reads a cache of that
many positions; the cache's values do not change the step's cost). Printed per depth: each
build's median tokens/s and the median, min and max of the per-round ratio new / base. Only
the decoder library differs: the linear and FFN kernels it calls are this tree's.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import statistics

import torch

from machine import cpu_name, kernel_source_at  # benchmarks/machine.py
import picompile
from picompile import bench, models
from picompile.codegen import c
from picompile.codegen import decoder as native


def base_library(rev: str) -> ctypes.CDLL:
    """decoder.c of revision `rev`, built with this tree's flags, its step function declared."""
    path = c.build_library(kernel_source_at(rev, "decoder.c"), c.build_flags(), f"decoder-{rev}")
    lib = ctypes.CDLL(str(path))
    multi = hasattr(lib, "pi_decoder_step_max")  # its step takes a token count (T)
    lib.pi_decoder_step.argtypes = [ctypes.POINTER(native.Decoder), ctypes.c_int64] + [
        ctypes.c_int64] * multi + [ctypes.c_void_p, ctypes.c_void_p]
    lib.pi_decoder_step.restype = ctypes.c_int
    return lib if multi else _OneToken(lib)


class _OneToken:
    """A revision's library from before multi-token steps, called as this tree's is."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def pi_decoder_step(self, struct, pos, T, x, logits):
        assert T == 1, "a single-token library"
        return self.lib.pi_decoder_step(struct, pos, x, logits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision of the base decoder.c")
    ap.add_argument("--depths", nargs="+", type=int, default=[64, 256, 768, 2048])
    ap.add_argument("--kv-cache", choices=["float32", "float16", "bfloat16"], default=None)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=48)
    args = ap.parse_args()
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_name()}, "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}, KV cache "
          f"{args.kv_cache or 'the model dtype'}, base {args.base}")
    room = max(args.depths) + args.steps + 1  # positions the deepest run reaches
    model, _ = models.load()
    cm = picompile.compile(model, gguf=models.default_gguf(), kv_cache=args.kv_cache, quiet=True,
                           max_context=room)
    dec = cm.decoder()
    assert dec is not None, cm.decoder_reason
    assert dec.reserve(room)  # built by this tree's library
    new, base = dec.lib, base_library(args.base)
    print("| depth | base tok/s | new tok/s | new / base (median, min-max of rounds) |")
    print("|---:|---:|---:|---|")
    for depth in args.depths:
        prompt = torch.zeros(1, depth, dtype=torch.long)
        tps = {"base": [], "new": []}
        for _ in range(args.rounds):
            for name, lib in (("base", base), ("new", new)):
                dec.lib = lib
                tps[name].append(bench.decoder_tps(dec, prompt, args.steps))
        ratios = [n / b for n, b in zip(tps["new"], tps["base"])]
        print(f"| {depth} | {statistics.median(tps['base']):.1f} | {statistics.median(tps['new']):.1f} "
              f"| {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |", flush=True)
    dec.lib = new


if __name__ == "__main__":
    main()
