"""GPTQ at Llama-7B width: layer by layer, in bounded memory, and better than rounding to nearest.

    .venv/bin/python benchmarks/gptq_scale.py                  # 2 layers, q4_0, 8 x 128 tokens
    .venv/bin/python benchmarks/gptq_scale.py --layers 4 --format q4_1 --sequences 16

The model: benchmarks/hybrid.py's float16 ReLU Llama at Llama-7B's shape (d 4096, n_ff 11008, 32
heads), cut to --layers, its vocabulary cut to --vocab (the LM head is rounded to nearest when
GPTQ runs layer by layer, so its size only adds time). A float16 model on a CPU-only machine
calibrates layer by layer, so compile(quantize=F, calibration=ids) runs GPTQ on each decoder
layer's Hessians as soon as every calibration batch has passed that layer, holding one
layer's at a time (7B: q/k/v and o 4096^2 floats each, gate/up 4096^2, down 11008^2).

Reported: compile time of the GPTQ compile and of a round-to-nearest one (compile without
calibration data) of the same weights, the process's peak resident memory after each, and how
far each quantized model's logits are from the float16 model's on held-out random token ids
(relative Frobenius error of the logits, and of the last layer's FFN output), so GPTQ's gain
over rounding is visible on weights it was not fitted to. Random weights have no meaningful
perplexity; the error ratio is the measure.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import resource
import time

import torch

import picompile
from picompile.passes import hessians

import hybrid  # beside this script: the planted ReLU Llama


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def rss_gb() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, use_cache=False).logits.float()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--format", default="q4_0", choices=["q4_0", "q4_1", "q8_0"])
    ap.add_argument("--sequences", type=int, default=8, help="calibration sequences")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"Llama-7B shape, {args.layers} layers, vocab {args.vocab}, float16, {args.format}, "
          f"{args.sequences} x {args.seq_len} calibration tokens, {args.threads} threads, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
          flush=True)
    t0 = time.perf_counter()
    dense = hybrid.build("llama-7b", torch.float16, "cpu", args.layers, vocab=args.vocab)
    print(f"model built in {time.perf_counter() - t0:.0f} s; RSS {rss_gb():.2f} GB", flush=True)
    gen = torch.Generator().manual_seed(0)
    calib = torch.randint(0, args.vocab, (args.sequences, args.seq_len), generator=gen)
    heldout = torch.randint(0, args.vocab, (2, 64), generator=gen)
    want = logits(dense, heldout)
    # the bound compile checks, for the unrewritten model (each linear's K x K)
    one_layer = hessians.estimate_bytes(dense, {}, layers=hybrid.decoder_layers(dense))

    rows = []
    for label, kw in (("GPTQ (layer by layer)", dict(calibration=calib)),
                      ("round to nearest", {})):
        model = copy.deepcopy(dense)
        gc.collect()
        t = time.perf_counter()
        cm = picompile.compile(model, quantize=args.format, **kw)
        seconds = time.perf_counter() - t
        got = logits(cm, heldout)
        rows.append((label, seconds, peak_rss_gb(), rel_err(got, want), cm.quant_notes))
        print(f"{label}: compile {seconds:.0f} s, peak RSS {peak_rss_gb():.2f} GB, logits error "
              f"{rows[-1][3]:.4f}", flush=True)
        del cm, model
        gc.collect()

    print()
    print("| quantization | compile s | peak RSS GB (process so far) | logits relative error |")
    print("|---|---:|---:|---:|")
    for label, seconds, peak, err, _ in rows:
        print(f"| {label} | {seconds:.0f} | {peak:.2f} | {err:.4f} |")
    print(f"GPTQ / nearest error ratio: {rows[0][3] / rows[1][3]:.3f}")
    for note in rows[0][4]:
        print(f"GPTQ note: {note}")
    print(f"one layer's Hessians (upper bound): {one_layer / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
