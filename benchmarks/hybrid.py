"""Hybrid decode: hot neurons on the GPU, cold on the CPU, against the other ways to run a model
that does not fit: Hugging Face accelerate offloading at the same budget, picompile all on the
CPU, and all on the GPU where it fits (the dense model in Hugging Face eager, and picompile's
device decoder on the same plan with every neuron hot).

Models are OPT- or ReLU-Llama-shaped with random float16 weights, built straight in float16 on
the device. Their first FFN layer (OPT fc1, Llama gate) plants what PowerInfer measures on real
models: a power-law firing distribution (about 10% of neurons active per token, a small hot set
firing most of the time), through the biases, and activity a low-rank predictor can learn: the
rows lie near a rank-64 subspace (random full-rank rows would make every neuron's firing an
independent direction of x, which no low-rank predictor, and no real model, has).

    python benchmarks/hybrid.py --shape opt-13b               # needs a CUDA GPU and cupy
    python benchmarks/hybrid.py --cpu-standin --shape tiny    # CPU stands in for the GPU

Each run starts from a fresh copy of the same weights (same seed). picompile runs predicted
mode (PowerInfer's), calibrated on random token ids; the all-CPU run loads the hybrid run's plan
(no second profile). Reports decode tokens/s per run (picompile's decode step with its CUDA graphs, without them,
and the per-module path that times each block), compile (profile + training) time, peak GPU
memory against the budget (PyTorch's reserved pool + CuPy's pool + the CUDA context); through
the device decoder, per segment that hands a cold part to the CPU: device time (CUDA events),
the cold worker's time, wall time against max(device, cold); and on the per-module path, per
block and decode step: GPU time of the hot part and its bytes read / s (CUDA events), CPU time of
the cold part, wall time against max(hot, cold).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch

import picompile
from picompile.config import COLD_THREADS_ENV, CUDA_GRAPHS_ENV
from picompile.timing import timed_generate

# kind, hidden, ffn, layers, heads, vocab
SHAPES = {
    "tiny": ("opt", 512, 2048, 4, 8, 4096),
    "tiny-llama": ("llama", 512, 1408, 4, 8, 4096),
    "opt-1.3b": ("opt", 2048, 8192, 24, 32, 50272),
    "opt-6.7b": ("opt", 4096, 16384, 32, 32, 50272),
    "opt-13b": ("opt", 5120, 20480, 40, 40, 50272),
    "llama-7b": ("llama", 4096, 11008, 32, 32, 32000),
    "llama-13b": ("llama", 5120, 13824, 40, 40, 32000),
}
PLANTED_RANK = 64


def power_law_rates(n: int, mean: float, alpha: float = 1.2, gen=None) -> torch.Tensor:
    """Per-neuron firing rates [n]: rate ~ rank^-alpha, scaled to `mean`, capped at 0.99."""
    ranks = torch.randperm(n, generator=gen).float() + 1
    rates = ranks.pow(-alpha)
    for _ in range(50):  # scale so the mean is right after capping
        rates = (rates * mean / rates.mean()).clamp(1e-4, 0.99)
    return rates


def config(shape: str, layers: int | None = None, vocab: int | None = None):
    from transformers import LlamaConfig, OPTConfig

    kind, hidden, ffn, shape_layers, heads, shape_vocab = SHAPES[shape]
    layers, vocab = layers or shape_layers, vocab or shape_vocab
    if kind == "opt":
        return OPTConfig(vocab_size=vocab, hidden_size=hidden, ffn_dim=ffn, num_hidden_layers=layers,
                         num_attention_heads=heads, word_embed_proj_dim=hidden,
                         max_position_embeddings=2048)
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                       num_hidden_layers=layers, num_attention_heads=heads, hidden_act="relu",
                       mlp_bias=True, max_position_embeddings=4096)


@torch.no_grad()
def build(shape: str, dtype, device, layers: int | None = None,
          vocab: int | None = None) -> torch.nn.Module:
    """The model in `dtype` on `device`, deterministic in `shape` (seeded on the CPU); `layers`
    cuts the stack short (per-block figures do not depend on the depth); `vocab` replaces the
    shape's vocabulary size (a GGUF file's tokenizer must match it)."""
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(0)
    with torch.device(device):  # built in `dtype` where it runs: never materialised in float32
        model = AutoModelForCausalLM.from_config(config(shape, layers, vocab), dtype=dtype)
    dgen = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.normal_(0, 0.02, generator=dgen)
        elif "bias" in name:
            p.zero_()
        else:
            p.fill_(1.0)  # norm weights
    normal = torch.distributions.Normal(0.0, 1.0)
    kind, hidden, ffn = SHAPES[shape][:3]
    for layer in decoder_layers(model):
        first = layer.fc1 if kind == "opt" else layer.mlp.gate_proj
        # rows near a rank-PLANTED_RANK subspace, norm about 0.02 * sqrt(hidden)
        a = torch.randn(ffn, PLANTED_RANK, generator=dgen, device=device)
        b = torch.randn(PLANTED_RANK, hidden, generator=dgen, device=device)
        w = (a @ b) * (0.02 / PLANTED_RANK**0.5) + first.weight.float() * 0.1
        first.weight.copy_(w.to(dtype))
        # pre-activation of neuron j ~ N(0, ||w_j||) on normed input: bias for rate p_j
        rates = power_law_rates(ffn, 0.1, gen=gen)
        std = first.weight.float().norm(dim=1).cpu()
        first.bias.copy_((std * normal.icdf(rates)).to(dtype))
    return model.eval()


def decoder_layers(model):
    """OPT's and Llama's decoder layers."""
    inner = model.model
    return inner.decoder.layers if hasattr(inner, "decoder") else inner.layers


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_tps(model, ids, new_tokens: int) -> float:
    timed_generate(model, ids, 4)
    return timed_generate(model, ids, new_tokens, exact_length=True)[1]


def decode_step_line(cm) -> str:
    """Which decode step runs: the device decoder (CUDA graphs replayed or why not) or the
    per-module path (why)."""
    dec = cm.decoder()
    if dec is None:
        return f"per-module path ({cm.decoder_reason})"
    graphs = getattr(dec, "graph_reason", None)
    if graphs is None:
        return type(dec).__name__
    return f"{type(dec).__name__}, CUDA graphs {'replayed' if not graphs else 'off: ' + graphs}"


def host_rss_bytes() -> int:
    """This process's resident host memory now (VmRSS), in bytes, after glibc's malloc_trim:
    memory freed but kept by the allocator (e.g. cm.save's buffers) would hide what is held."""
    import ctypes

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def gpu_peak_bytes() -> int:
    """Peak of PyTorch's reserved pool since the last reset, + CuPy's pool, + the memory the
    process holds outside both (the CUDA context and modules)."""
    free, total = torch.cuda.mem_get_info()
    cupy_pool = 0
    try:
        import cupy

        cupy_pool = cupy.get_default_memory_pool().total_bytes()
    except ImportError:
        pass
    outside = total - free - torch.cuda.memory_reserved() - cupy_pool
    return torch.cuda.max_memory_reserved() + cupy_pool + outside


def decoder_overlap(cm, ids) -> list[str]:
    """Per split block, through the decode step that runs (the device decoder; a timed step runs
    its segments eagerly and waits for each segment's device work), 8 tokens timed: the block's
    wall from its input to its merged output and its GPU part (norm, predictor, hot rows), both
    CUDA events; the cold worker's kernel time and its wait for the input; medians."""
    dec = cm.decoder()
    if getattr(dec, "timings", None) is None:
        return []
    dec.timeline = []
    timed_generate(cm, ids, 8)
    timeline = dec.timings()
    dec.timeline = None
    lines = []
    hosted = [s["host_s"] for s in timeline if s["host_s"]]
    if hosted:
        lines.append(f"device decoder: {sum(dec.on_host)} decoder layers on the CPU, "
                     f"{statistics.median(hosted) * 1e6:.0f} us per step (median of {len(hosted)})")
    blocks = [s for s in timeline if s["layer"] is not None]
    if not blocks:
        return lines + ["device decoder: no block hands off to the CPU"]
    med = lambda key: statistics.median(s[key] for s in blocks)  # noqa: E731
    ratios = sorted(s["wall_s"] / max(s["device_s"], s["cold_s"], 1e-9) for s in blocks)
    over = statistics.median(s["wall_s"] - max(s["device_s"], s["cold_s"]) for s in blocks)
    tenth = lambda q: ratios[min(len(ratios) - 1, int(q * len(ratios)))]  # noqa: E731
    return lines + [
        f"device decoder, per split block (median of {len(blocks)}, eager timed steps): GPU part "
        f"{med('device_s') * 1e6:.0f} us (CUDA events: norm, predictor, hot rows), cold "
        f"{med('cold_s') * 1e6:.0f} us (its wait for the input {med('cold_wait_s') * 1e6:.0f}"
        f" us), wall {med('wall_s') * 1e6:.0f} us (input to merged output), "
        f"{over * 1e6:.0f} us beyond the longer side; wall / max(GPU, cold) = "
        f"{statistics.median(ratios):.2f} (10th / 90th percentile {tenth(0.1):.2f} / "
        f"{tenth(0.9):.2f})"]


def overlap_report(cm) -> list[str]:
    """Per block and decode step (one token): hot GPU time, bytes the hot kernels read per
    second, cold CPU time, wall time against max(hot, cold); medians."""
    steps = []
    for f in cm.ffns().values():
        if f.hybrid is None:
            continue
        for s in f.hybrid.timings():
            if s["tokens"] == 1:
                steps.append(s)
    if not steps:
        return ["no decode steps recorded"]
    med = lambda key: statistics.median(s[key] for s in steps)  # noqa: E731
    ratio = statistics.median(s["wall_s"] / max(s["hot_s"], s["cold_s"], 1e-9) for s in steps)
    lines = [f"per block and decode step (median of {len(steps)}): hot {med('hot_s') * 1e6:.0f} us "
             f"(GPU, CUDA events), cold {med('cold_s') * 1e6:.0f} us (CPU; its wait for the input "
             f"{med('cold_wait_s') * 1e6:.0f} us), wall "
             f"{med('wall_s') * 1e6:.0f} us; wall / max(hot, cold) = {ratio:.2f}"]
    with_bytes = [s for s in steps if s.get("hot_bytes") and s["hot_s"] > 0]
    if with_bytes:
        gbs = statistics.median(s["hot_bytes"] / s["hot_s"] / 1e9 for s in with_bytes)
        mb = statistics.median(s["hot_bytes"] for s in with_bytes) / 1e6
        lines.append(f"hot kernels: {mb:.2f} MB read per block and step, {gbs:.0f} GB/s (median)")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="opt-13b")
    ap.add_argument("--budget-share", type=float, default=0.4, help="gpu_budget / weight bytes")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=512, help="KV cache the budget holds")
    ap.add_argument("--calibration-tokens", type=int, default=32768)
    ap.add_argument("--cpu-standin", action="store_true", help="the CPU stands in for the GPU")
    ap.add_argument("--skip", nargs="*", default=[], choices=["accelerate", "cpu", "gpu"],
                    help="gpu: both all-on-the-GPU runs (HF eager and picompile)")
    ap.add_argument("--layers", type=int, help="fewer decoder layers than the shape has")
    ap.add_argument("--cold-threads", type=int, nargs="*", default=[],
                    help="decode again with each of these OpenMP team sizes for the cold parts "
                         "(default: half the CPU threads)")
    ap.add_argument("--quantize", choices=["q8_0", "q4_0", "q4_1"], default=None,
                    help="picompile's runs on block-quantized weights (rounded to nearest: GPTQ "
                         "would take long at these sizes); the budget stays a share of the "
                         "float16 weights")
    ap.add_argument("--profile", action="store_true",
                    help="print where the host's time goes in hybrid decode (cProfile)")
    args = ap.parse_args()
    gpu = torch.cuda.is_available() and not args.cpu_standin
    if not gpu and not args.cpu_standin:
        raise SystemExit("no CUDA GPU: run with --cpu-standin to measure the overlap on the CPU")
    dtype = torch.float16 if gpu else torch.float32
    device = "cuda" if gpu else "cpu"
    name = torch.cuda.get_device_name() if gpu else "CPU stand-in"
    print(f"{args.shape}, {dtype}, {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
          f"{torch.get_num_threads()} CPU threads", flush=True)
    vocab = SHAPES[args.shape][5]
    ids = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(1))
    seq = 256
    calib = torch.randint(0, vocab, (max(1, args.calibration_tokens // seq), seq),
                          generator=torch.Generator().manual_seed(2))
    results = {}
    summary = []  # printed as measured (a run cut by its limit keeps them), again at the end

    def note(line):
        summary.append(line)
        print(line, flush=True)

    plan_dir = tempfile.mkdtemp(prefix="picompile-plan-")

    # 1. picompile hybrid (and the dense model all on the GPU first, where it fits)
    model = build(args.shape, dtype, device, args.layers)
    total = weight_bytes(model)
    budget = int(total * args.budget_share)
    if not gpu:  # what a GPU holds besides tensors is counted as stated constants here
        from picompile.passes import place

        budget = place.budget_holding(budget + place.DEFAULT_CUDA_CONTEXT_BYTES
                                      + place.CUBLAS_WORKSPACE_BYTES)
    print(f"weights {total / 1e9:.2f} GB, budget {budget / 1e9:.2f} GB", flush=True)
    if gpu and "gpu" not in args.skip:
        results["dense, all on the GPU"] = decode_tps(model, ids.cuda(), args.new_tokens)
        print(results, flush=True)
    t0 = time.perf_counter()
    cm = picompile.compile(model, mode="predicted", gpu_budget=budget, calibration=calib,
                           max_context=args.max_context, quantize=args.quantize, gptq=False,
                           quiet=not sys.stderr.isatty())
    note(f"compile (profile {calib.numel()} tokens + predictors + placement): "
         f"{time.perf_counter() - t0:.0f} s")
    cm.save(plan_dir)
    if not gpu:
        cm.distribute("cpu")
    if all(f.hybrid is None for f in cm.ffns().values()):
        print("the fixed parts do not fit the budget: picompile runs all on the CPU", flush=True)
    print(picompile.explain(cm), flush=True)
    note(f"host memory (RSS) after the split: {host_rss_bytes() / 1e9:.2f} GB")
    if gpu:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    label = f"picompile hybrid (predicted), budget {budget / 1e9:.2f} GB"
    host = cm.plan.placement.host_layers
    if host:
        label += f", {len(host)} of {len(decoder_layers(model))} decoder layers on the CPU"
    results[label] = decode_tps(cm, ids, args.new_tokens)
    print(results, flush=True)
    if gpu:
        note(f"peak GPU memory (torch reserved + cupy pool + context) "
             f"{gpu_peak_bytes() / 1e9:.2f} GB of budget {budget / 1e9:.2f} GB")
    dec = cm.decoder()
    print(f"decode step: {decode_step_line(cm)}", flush=True)
    for n in args.cold_threads:  # the same decoder, another team for the cold parts
        os.environ[COLD_THREADS_ENV] = str(n)
        results[f"{label}, {n} cold threads"] = decode_tps(cm, ids, args.new_tokens)
        del os.environ[COLD_THREADS_ENV]
        print(results, flush=True)
    for line in decoder_overlap(cm, ids):
        note(line)
    if getattr(dec, "graphs", None) is not None:  # the same decoder, its segments run eagerly
        os.environ[CUDA_GRAPHS_ENV] = "0"
        results[f"{label}, no CUDA graphs"] = decode_tps(cm, ids, args.new_tokens)
        del os.environ[CUDA_GRAPHS_ENV]
        print(results, flush=True)
    for f in cm.ffns().values():  # a pass timed per block (events cost a little): the
        if f.hybrid is not None:  # per-module path, which records each block's hand-off
            f.hybrid.timeline = []
    _, tps = timed_generate(cm, ids, 8)
    results[f"{label}, per-module path timed per block"] = tps
    for line in overlap_report(cm):
        note(line)
    if args.profile:
        for f in cm.ffns().values():
            if f.hybrid is not None:
                f.hybrid.timeline = None
        profiler = cProfile.Profile()
        profiler.runcall(timed_generate, cm, ids, 8)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    note(f"FFN sparsity while decoding {cm.sparsity():.1%}; expected share of firing neurons on "
         f"the GPU {cm.plan.placement.expected_gpu_share:.1%}; weights {total / 1e9:.2f} GB")
    del cm, model
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()

    # 2. picompile all on the CPU, same plan (loaded, not profiled again): the target's
    # ratio first, so that a run cut by its time limit still has it
    if "cpu" not in args.skip:
        dense = build(args.shape, dtype, device, args.layers).to("cpu")
        if gpu:
            torch.cuda.empty_cache()
        cpu_cm = picompile.load(dense, plan_dir, distribute=False)
        cpu_cm.use_predictors("all")
        results["picompile all on the CPU (predicted)"] = decode_tps(cpu_cm, ids, args.new_tokens)
        print(results, flush=True)
        del cpu_cm, dense
        gc.collect()

    # 3. accelerate offloading at the same budget (dense, layers moved to the GPU per step)
    if gpu and "accelerate" not in args.skip:
        from accelerate import dispatch_model, infer_auto_device_map

        dense = build(args.shape, dtype, device, args.layers).to("cpu")
        torch.cuda.empty_cache()
        layer_cls = type(decoder_layers(dense)[0]).__name__
        dmap = infer_auto_device_map(dense, max_memory={0: budget, "cpu": 10**12},
                                     no_split_module_classes=[layer_cls])
        offloaded = dispatch_model(dense, device_map=dmap)
        results["accelerate offloading, same budget"] = decode_tps(offloaded, ids.cuda(), args.new_tokens)
        print(results, flush=True)
        del offloaded, dense
        gc.collect()
        torch.cuda.empty_cache()

    # 4. picompile all on the GPU: the same plan, every neuron hot (no profile again)
    if gpu and "gpu" not in args.skip:
        model = build(args.shape, dtype, device, args.layers)
        all_gpu = picompile.load(model, plan_dir, distribute=False)
        for f in all_gpu.ffns().values():
            f.block.decided.hot_neurons = f.n_ff
        all_gpu.plan.placement.host_layers, all_gpu.plan.placement.fixed_on_gpu = [], True
        all_gpu.distribute("cuda")
        results["picompile all on the GPU (same plan, every neuron hot)"] = decode_tps(
            all_gpu, ids, args.new_tokens)
        print(f"decode step: {decode_step_line(all_gpu)}", flush=True)
        print(results, flush=True)
        del all_gpu, model
        gc.collect()
        torch.cuda.empty_cache()

    print()
    print("| run | decode tok/s |")
    print("|---|---|")
    for label, tps in results.items():
        print(f"| {label} | {tps:.2f} |")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
