"""Decode tokens/s, compiled vs dense, in one run.

    .venv/bin/python benchmarks/decode.py                        # SmolLM2-135M (default model)
    .venv/bin/python benchmarks/decode.py --random --density 0.1  # random-weight OPT-style ReLU
    .venv/bin/python benchmarks/decode.py --random --arch gemma3  # random Gemma 3 (qwen3, phi3)
    .venv/bin/python benchmarks/decode.py --random --arch gpt2 --hidden 768 --ffn 3072 \
        --layers 12 --vocab 50257                                  # GPT-2 small's shape

The random OPT is an OPT-style decoder (ReLU FFN with biases) whose fc1 biases are shifted per
neuron so each fires on about `--density` of tokens, as trained ReLU LLMs do (OPT-6.7B: about
10%). The other architectures are random models of their Hugging Face class (head_dim 64, a
quarter as many key/value heads, GPT-2 and GPT-NeoX as many, Phi as many of 80; Gemma 3: five sliding-window layers of 512 per
global one);
their SiLU / GELU blocks run dense and at `--sparsity` (threshold calibrated on random ids).
Sizes are options; they fit in this machine's memory at the defaults.

The last compiled variant runs twice: through picompile's whole-step decoder where it runs the
model, and per module (PICOMPILE_DECODER=0), so the table shows what the decoder adds. Rows are
timed in interleaved rounds (the medians of --repeats), as the machine's speed drifts.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time

import torch

import picompile
from picompile import config, corpus, models
from picompile.timing import timed_generate

# beside this script (python puts its folder first on sys.path)
from machine import stream_probe
from planted_cpu import picompile_bytes_per_token


@torch.no_grad()
def plant_density(model, density: float, ids: torch.Tensor) -> None:
    """Shift each fc1 bias so neuron j is positive on `density` of the tokens in `ids`."""
    for layer in model.model.decoder.layers:
        pre = []
        handle = layer.fc1.register_forward_hook(lambda m, a, out: pre.append(out.reshape(-1, out.shape[-1])))
        model(ids)
        handle.remove()
        q = torch.cat(pre).float().quantile(1 - density, dim=0)  # [n_ff]
        layer.fc1.bias -= q.to(layer.fc1.bias.dtype)


def random_opt(hidden: int, ffn: int, layers: int, density: float, dtype) -> torch.nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=8192, hidden_size=hidden, ffn_dim=ffn, num_hidden_layers=layers,
                    num_attention_heads=max(1, hidden // 64), word_embed_proj_dim=hidden,
                    max_position_embeddings=2048)
    model = OPTForCausalLM(cfg).eval()
    plant_density(model, density, torch.randint(0, 8192, (4, 64)))
    return model.to(dtype)


def random_model(arch: str, hidden: int, ffn: int, layers: int, vocab: int,
                 dtype) -> torch.nn.Module:
    """A random Qwen3 / Phi-3 / Gemma 3 / GPT-2 / Phi-2 / GPT-NeoX of the given sizes."""
    import transformers as T

    torch.manual_seed(0)
    heads = max(1, hidden // 64)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                  num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=max(1, heads // 4), max_position_embeddings=4096,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "gpt_neox":  # Pythia's layout: parallel attention and FFN, RoPE over a quarter
        config = T.GPTNeoXConfig(**{k: v for k, v in common.items() if k != "num_key_value_heads"})
    elif arch == "phi":  # Phi-2's layout: parallel attention and FFN, RoPE over 40% of a head
        config = T.PhiConfig(**{**{k: v for k, v in common.items() if k != "num_key_value_heads"},
                                "num_attention_heads": max(1, hidden // 80)},  # heads of 80
                             partial_rotary_factor=0.4)
    elif arch == "gpt2":
        config = T.GPT2Config(vocab_size=vocab, n_embd=hidden, n_inner=ffn, n_layer=layers,
                              n_head=heads, n_positions=1024, bos_token_id=1, eos_token_id=2)
    elif arch == "qwen3":
        config = T.Qwen3Config(**common, head_dim=64)
    elif arch == "phi3":
        config = T.Phi3Config(**common)
    else:
        types = [("full_attention" if i % 6 == 5 else "sliding_attention") for i in range(layers)]
        config = T.Gemma3TextConfig(**common, head_dim=64, sliding_window=512, layer_types=types)
    return T.AutoModelForCausalLM.from_config(config).eval().to(dtype)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--random", action="store_true", help="a random-weight model (--arch)")
    ap.add_argument("--arch", default="opt", choices=["opt", "qwen3", "phi3", "gemma3", "gpt2", "phi", "gpt_neox"])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary (not the random OPT)")
    ap.add_argument("--density", type=float, default=0.1, help="planted firing rate per neuron")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--sparsity", type=float, default=0.5, help="threshold sparsity (SiLU models)")
    ap.add_argument("--predicted", action="store_true", help="also predicted mode")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)

    if args.random and args.arch != "opt":
        dense = random_model(args.arch, args.hidden, args.ffn, args.layers, args.vocab, dtype)
        prompt = torch.randint(0, 8192, (1, 16), generator=torch.Generator().manual_seed(1))
        name = (f"random {type(dense).__name__}, d={args.hidden}, n_ff={args.ffn}, "
                f"{args.layers} layers, vocabulary {args.vocab}, {args.dtype}")
        calib = torch.randint(0, 8192, (16, 128), generator=torch.Generator().manual_seed(2))
        variants = {"dense": {}, f"threshold @{args.sparsity:.0%}": dict(sparsity=args.sparsity,
                                                                          calibration=calib)}
    elif args.random:
        dense = random_opt(args.hidden, args.ffn, args.layers, args.density, dtype)
        prompt = torch.randint(0, 8192, (1, 16), generator=torch.Generator().manual_seed(1))
        name = (f"random OPT-style ReLU, d={args.hidden}, n_ff={args.ffn}, {args.layers} layers, "
                f"planted density {args.density:.0%}, {args.dtype}")
        variants = {"exact": {}}
        if args.predicted:  # predictors trained on random token ids (the model's own text)
            calib = torch.randint(0, 8192, (8, 128), generator=torch.Generator().manual_seed(2))
            variants["predicted"] = dict(mode="predicted", calibration=calib)
    else:
        dense, tok = models.load(None, dtype=dtype)
        prompt = corpus.token_batches(tok, "heldout", 32, seq_len=32)
        calib = corpus.token_batches(tok, "calibration", 16384)
        name = f"SmolLM2-135M-Instruct, {args.dtype}"
        variants = {f"exact @{args.sparsity:.0%}": dict(sparsity=args.sparsity, calibration=calib)}
        if args.predicted:  # minutes more: profiling and predictor training
            variants[f"predicted @{args.sparsity:.0%}"] = dict(mode="predicted", sparsity=args.sparsity,
                                                               calibration=calib)
    runs = {"HF eager": dense}
    for label, kw in variants.items():
        runs[label] = picompile.compile(copy.deepcopy(dense), quiet=True, **kw)
    per_module = f"{label}, per module"  # the last variant with its whole-step decoder off
    runs[per_module] = runs[label]

    print(f"{name}; {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d', time.gmtime())}")
    print(f"streaming read before: {stream_probe(5):.1f} GB/s")
    print("| run | decode tok/s (median of %d) | vs HF eager | FFN sparsity | weight MB / token | "
          "GB/s | decode step |" % args.repeats)
    print("|---|---|---|---|---|---|---|")

    def switch(label: str) -> None:  # the per-module row runs its model with the decoders off
        os.environ[config.DECODER_ENV] = "0" if label == per_module else "1"

    for label, model in runs.items():  # warm-up: kernel builds, allocator, the decoders
        switch(label)
        timed_generate(model, prompt, 4)
    speeds, sparsity = {label: [] for label in runs}, {}
    for _ in range(args.repeats):  # interleaved rounds: this VM's memory speed drifts
        for label, model in runs.items():
            switch(label)
            if hasattr(model, "reset_stats"):
                model.reset_stats()
            speeds[label].append(timed_generate(model, prompt, args.new_tokens,
                                                exact_length=True)[1])
            sparsity[label] = model.sparsity() if hasattr(model, "sparsity") else None
    base = statistics.median(speeds["HF eager"])
    for label, model in runs.items():
        switch(label)
        tps, sp = statistics.median(speeds[label]), sparsity[label]
        path, read = "HF eager", "- | -"
        if hasattr(model, "decoder"):
            step = model.decoder()
            path = step.describe() if step is not None else "per module"
            mb = picompile_bytes_per_token(model) / 1e6
            read = f"{mb:.0f} | {mb * tps / 1e3:.1f}"
        print(f"| {label} | {tps:.2f} | {tps / base:.2f}x | {'-' if sp is None else f'{sp:.1%}'} "
              f"| {read} | {path} |")
    print(f"streaming read after: {stream_probe(5):.1f} GB/s")


if __name__ == "__main__":
    main()
