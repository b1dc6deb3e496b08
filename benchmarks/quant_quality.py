"""Perplexity of quantized weights: picompile against llama.cpp's `llama-perplexity`, same GGUF
weights, same text, same scoring (issue 10's quality targets).

    python benchmarks/quant_quality.py [--chunks 16] [--ctx 512] [--no-llama-cpp] [--rows NAME,...]

--no-llama-cpp measures picompile's rows only (llama.cpp's figures: BENCHMARKS.md). Otherwise
needs llama.cpp built by benchmarks/peers.py (build/peers/cmake/bin), plus its llama-perplexity
target (`cmake --build build/peers/cmake --target llama-perplexity`), and the F32 copy of the
shipped model peers.py makes (build/peers/smollm2-F32.gguf).

Text: the built-in corpus's heldout split (picompile/corpus.py), written to
build/quant-quality/heldout.txt. Scoring, as llama-perplexity does it: the text's tokens cut
into chunks of --ctx tokens (the first replaced by BOS where the file says to add one); per chunk
one forward pass; the negative log-likelihood of each token in the second half given all before
it; exp of the mean over all chunks.

Rows, for SmolLM2-135M-Instruct (shipped as Q4_1):
    F32   the shipped file dequantized (llama-quantize to F32; picompile: the float model
          transformers loads from the shipped file, the same values)
    Q4_1  the shipped file (picompile: compile(gguf=file), its tensors kept as they are)
    Q8_0, Q4_0  of the F32 weights (llama-quantize from F32; picompile: compile(quantize=...))
    Q4_1  of the F32 weights (picompile only)
    Q4_K_M  llama-quantize's Q4_K_M of the F32 weights (its Q4_K, Q5_0 and Q6_K tensors; picompile:
          the float model transformers loads from that file, compile(gguf=that file))
    ... GPTQ  picompile only: compile(quantize=..., tokenizer=...): blocks rounded by GPTQ on the
          Hessians of the built-in corpus's calibration split (never the heldout text scored)
"""

from __future__ import annotations

import argparse
import copy
import math
import pathlib
import platform
import re
import subprocess
import time

import torch
import torch.nn.functional as F

import picompile
from picompile import bench, corpus, models

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "quant-quality"


def add_bos(gguf_path: pathlib.Path) -> bool:
    import gguf

    field = gguf.GGUFReader(gguf_path).fields.get("tokenizer.ggml.add_bos_token")
    return bool(field.contents()) if field is not None else False


@torch.no_grad()
def chunked_perplexity(model, ids: torch.Tensor, ctx: int, chunks: int, bos: int | None) -> float:
    """llama-perplexity's measure over ids [n]: chunks of ctx tokens, second halves scored."""
    total, count = 0.0, 0
    for c in range(chunks):
        x = ids[c * ctx:(c + 1) * ctx].clone()
        if bos is not None:
            x[0] = bos
        logits = model(x[None], use_cache=False).logits[0].float()  # [ctx, vocab]
        first = ctx // 2
        total += float(F.cross_entropy(logits[first:ctx - 1], x[first + 1:], reduction="sum"))
        count += ctx - 1 - first
    return math.exp(total / count)


def llama_perplexity(bins: pathlib.Path, gguf_path: pathlib.Path, text: pathlib.Path, ctx: int,
                     chunks: int, threads: int) -> float:
    cmd = [str(bins / "llama-perplexity"), "-m", str(gguf_path), "-f", str(text), "-c", str(ctx),
           "-b", str(ctx), "--chunks", str(chunks), "-t", str(threads)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", r.stdout + r.stderr)
    if m is None:
        raise RuntimeError(f"no final estimate from {' '.join(cmd)}:\n{(r.stdout + r.stderr)[-2000:]}")
    return float(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama-cpp", action="store_true", help="picompile's rows only")
    ap.add_argument("--rows", default=None, help="comma-separated row names to run (F32 always)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shipped = models.default_gguf()
    bins = None
    if not args.no_llama_cpp:
        bins = bench.llama_cpp_bins()
        if bins is None or not (bins / "llama-perplexity").exists():
            raise SystemExit("llama.cpp is not built: python benchmarks/peers.py builds it, then "
                             "cmake --build build/peers/cmake --target llama-perplexity "
                             "(or pass --no-llama-cpp)")
        f32 = bins.parent.parent / "smollm2-F32.gguf"
        if not f32.exists():
            raise SystemExit(f"{f32} is missing: python benchmarks/peers.py makes it")
    OUT.mkdir(parents=True, exist_ok=True)
    model, tokenizer = models.load()
    text = "\n\n".join(corpus.default_texts("heldout"))
    text_file = OUT / "heldout.txt"
    text_file.write_text(text)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    chunks = min(args.chunks, ids.numel() // args.ctx)
    bos = tokenizer.bos_token_id if add_bos(shipped) else None
    print(f"SmolLM2-135M-Instruct, {ids.numel()} heldout tokens, {chunks} chunks of {args.ctx}, "
          f"{args.threads} threads, {platform.processor() or platform.machine()}, "
          f"{time.strftime('%Y-%m-%d')}", flush=True)

    ours = {"F32": dict(), "Q4_1 (shipped)": dict(gguf=shipped),
            "Q8_0": dict(quantize="q8_0"), "Q4_0": dict(quantize="q4_0"),
            "Q4_1": dict(quantize="q4_1"),
            "Q8_0 GPTQ": dict(quantize="q8_0", tokenizer=tokenizer),
            "Q4_0 GPTQ": dict(quantize="q4_0", tokenizer=tokenizer),
            "Q4_1 GPTQ": dict(quantize="q4_1", tokenizer=tokenizer)}
    llama, loaded_from = {}, {}  # row -> llama.cpp's file; the GGUF file of the row's own model
    if bins is not None:
        llama = {"F32": f32, "Q4_1 (shipped)": shipped,
                 "Q8_0": bench.requantized(bins, f32, "Q8_0", OUT / "smollm2-Q8_0.gguf"),
                 "Q4_0": bench.requantized(bins, f32, "Q4_0", OUT / "smollm2-Q4_0.gguf"),
                 "Q4_K_M": bench.requantized(bins, f32, "Q4_K_M", OUT / "smollm2-Q4_K_M.gguf")}
        ours["Q4_K_M"] = dict(gguf=llama["Q4_K_M"])
        loaded_from["Q4_K_M"] = llama["Q4_K_M"]
    names = list(ours) if args.rows is None else ["F32", *(n for n in args.rows.split(",") if n != "F32")]
    rows = []
    for name in names:
        t = time.perf_counter()
        own = models.load(str(loaded_from[name]), quiet=True)[0] if name in loaded_from \
            else copy.deepcopy(model)
        cm = picompile.compile(own, quiet=True, **ours[name])
        took = time.perf_counter() - t
        ppl_ours = chunked_perplexity(cm, ids, args.ctx, chunks, bos)
        ppl_llama = None
        if name in llama:
            ppl_llama = llama_perplexity(bins, llama[name], text_file, args.ctx, chunks, args.threads)
        rows.append((name, ppl_ours, ppl_llama, took))
        print(f"{name}: picompile {ppl_ours:.4f} (compile {took:.0f} s), llama.cpp {ppl_llama}", flush=True)
        del cm
    base_ours, base_llama = rows[0][1], rows[0][2]
    print()
    print("| weights | picompile PPL | vs its F32 | compile s | llama.cpp PPL | vs its F32 | picompile / llama.cpp |")
    print("|---|---|---|---|---|---|---|")
    for name, o, ll, took in rows:
        theirs = "| - | - | - |" if ll is None else \
            f"| {ll:.4f} | {ll / base_llama - 1:+.2%} | {o / ll - 1:+.2%} |"
        print(f"| {name} | {o:.4f} | {o / base_ours - 1:+.2%} | {took:.0f} {theirs}")


if __name__ == "__main__":
    main()
