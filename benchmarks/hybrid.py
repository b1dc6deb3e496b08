"""Hybrid decode: hot neurons on the GPU, cold on the CPU, against the other ways to run a model
that does not fit: Hugging Face accelerate offloading at the same budget, all on the CPU, and
all on the GPU where it fits.

Models are OPT-shaped with random weights, float16, whose fc1 biases plant a power-law firing
distribution (about 90% of neurons inactive per token, a small hot set firing most of the time,
as the PowerInfer paper measures on real OPT models).

    python benchmarks/hybrid.py --shape opt-6.7b            # needs a CUDA GPU and cupy
    python benchmarks/hybrid.py --cpu-standin --shape tiny  # CPU stands in for the GPU: overlap

Reports decode tokens/s per run, the share of the budget used (peak of PyTorch's and CuPy's
pools), the sparse kernels' bandwidth on the bytes they read, and per-block overlap: wall time
per block against max(hot part, cold part).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import picompile
from picompile.timing import timed_generate

SHAPES = {  # hidden, ffn, layers, heads, vocab
    "tiny": (512, 2048, 4, 8, 4096),
    "opt-1.3b": (2048, 8192, 24, 32, 50272),
    "opt-6.7b": (4096, 16384, 32, 32, 50272),
    "opt-13b": (5120, 20480, 40, 40, 50272),
}


def power_law_rates(n: int, mean: float, alpha: float = 1.2, gen=None) -> torch.Tensor:
    """Per-neuron firing rates [n]: rate ~ rank^-alpha, scaled to `mean`, capped at 0.99."""
    ranks = torch.randperm(n, generator=gen).float() + 1
    rates = ranks.pow(-alpha)
    for _ in range(50):  # scale so the mean is right after capping
        rates = (rates * mean / rates.mean()).clamp(1e-4, 0.99)
    return rates


@torch.no_grad()
def build(shape: str, dtype, device) -> torch.nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    hidden, ffn, layers, heads, vocab = SHAPES[shape]
    cfg = OPTConfig(vocab_size=vocab, hidden_size=hidden, ffn_dim=ffn, num_hidden_layers=layers,
                    num_attention_heads=heads, word_embed_proj_dim=hidden,
                    max_position_embeddings=2048, torch_dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        model = OPTForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.normal_(0, 0.02)
        elif "bias" in name:
            p.zero_()
        else:
            p.fill_(1.0)  # layer norm weights
    normal = torch.distributions.Normal(0.0, 1.0)
    for layer in model.model.decoder.layers:
        # fc1 pre-activation of neuron j ~ N(0, ||w_j||) on layer-normed input: bias for rate p_j
        rates = power_law_rates(ffn, 0.1, gen=gen)
        std = layer.fc1.weight.float().norm(dim=1).cpu()
        layer.fc1.bias.copy_((std * normal.icdf(rates)).to(dtype))
    return model.eval()


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_tps(model, ids, new_tokens: int) -> float:
    timed_generate(model, ids, 4)
    return timed_generate(model, ids, new_tokens, exact_length=True)[1]


def overlap_report(cm) -> str:
    steps = [s for f in cm.ffns().values() if f.hybrid and f.hybrid.timeline for s in f.hybrid.timeline
             if s["tokens"] == 1]
    if not steps:
        return "no decode steps recorded"
    ratio = statistics.median(s["wall_s"] / max(s["hot_s"], s["cold_s"], 1e-9) for s in steps)
    hot = statistics.median(s["hot_s"] for s in steps) * 1e6
    cold = statistics.median(s["cold_s"] for s in steps) * 1e6
    wall = statistics.median(s["wall_s"] for s in steps) * 1e6
    return (f"per block and decode step (median of {len(steps)}): hot {hot:.0f} us, cold {cold:.0f} us, "
            f"wall {wall:.0f} us, wall / max(hot, cold) = {ratio:.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="opt-6.7b")
    ap.add_argument("--budget-share", type=float, default=0.4, help="gpu_budget / weight bytes")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-context", type=int, default=1024, help="KV cache the budget holds")
    ap.add_argument("--cpu-standin", action="store_true", help="the CPU stands in for the GPU")
    ap.add_argument("--skip", nargs="*", default=[], choices=["accelerate", "cpu", "gpu"])
    args = ap.parse_args()
    gpu = torch.cuda.is_available() and not args.cpu_standin
    if not gpu and not args.cpu_standin:
        raise SystemExit("no CUDA GPU: run with --cpu-standin to measure the overlap on the CPU")
    dtype = torch.float16 if gpu else torch.float32
    device = "cuda" if gpu else "cpu"
    name = torch.cuda.get_device_name() if gpu else "CPU stand-in"
    print(f"{args.shape}, {dtype}, {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")

    model = build(args.shape, dtype, device)  # profiled where it runs fastest
    total = weight_bytes(model)
    budget = int(total * args.budget_share)
    vocab = SHAPES[args.shape][4]
    ids = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(1))
    calib = torch.randint(0, vocab, (8, 128), generator=torch.Generator().manual_seed(2))
    results = {}

    if gpu and "gpu" not in args.skip and torch.cuda.mem_get_info()[1] > total * 1.3:
        results["all on the GPU (dense)"] = decode_tps(model, ids.cuda(), args.new_tokens)

    dense_cpu = copy.deepcopy(model).to("cpu") if "cpu" not in args.skip else None
    cm = picompile.compile(model, gpu_budget=budget, calibration=calib.to(device),
                           max_context=args.max_context, quiet=False)
    if not gpu:
        cm.distribute("cpu")
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    for f in cm.ffns().values():
        f.hybrid.timeline = []
    results[f"picompile hybrid, budget {budget / 1e9:.2f} GB"] = decode_tps(cm, ids, args.new_tokens)
    peak = None
    if gpu:
        peak = torch.cuda.max_memory_allocated()
        try:
            import cupy

            peak += cupy.get_default_memory_pool().total_bytes()
        except ImportError:
            pass
    overlap = overlap_report(cm)
    sparsity = cm.sparsity()
    hot_share = cm.plan.placement.expected_gpu_share
    del cm, model

    if dense_cpu is not None:
        results["all on the CPU (dense)"] = decode_tps(dense_cpu, ids, args.new_tokens)
    if gpu and "accelerate" not in args.skip and dense_cpu is not None:
        from accelerate import dispatch_model, infer_auto_device_map

        dmap = infer_auto_device_map(dense_cpu, max_memory={0: budget, "cpu": 10**12},
                                     no_split_module_classes=["OPTDecoderLayer"])
        offloaded = dispatch_model(dense_cpu, device_map=dmap)
        results["accelerate offloading, same budget"] = decode_tps(offloaded, ids.cuda(), args.new_tokens)

    print("| run | decode tok/s |")
    print("|---|---|")
    for label, tps in results.items():
        print(f"| {label} | {tps:.2f} |")
    print(f"FFN sparsity while decoding {sparsity:.1%}; expected share of firing neurons on the GPU "
          f"{hot_share:.1%}; weights {total / 1e9:.2f} GB")
    if peak is not None:
        print(f"peak GPU memory (torch + cupy pools) {peak / 1e9:.2f} GB of budget {budget / 1e9:.2f} GB")
    print(overlap)


if __name__ == "__main__":
    main()
