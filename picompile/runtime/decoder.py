"""Decoder: picompile's decode step for pre-norm decoder stacks, the whole stack in one C call.

    dec = Decoder(model)              # raises Unsupported(why) for a model it does not run
    dec.reserve(max_len)              # KV cache and RoPE tables for max_len positions
    dec.load_cache(static_cache, n)   # positions 0..n-1 from Hugging Face's prefill
    logits = dec.step(tokens, pos)    # tokens [T] long (T <= STEP_MAX) -> [T, vocab] float32
    dec.flush_stats()                 # active neurons computed -> each SparseFFN's statistics

Why: in Hugging Face eager, a decode step of a 30-layer model is some 400 PyTorch calls
between picompile's kernels; here it is one ctypes call (kernels/decoder.c), which runs the
norms, RoPE, the KV cache and attention itself and calls the very kernels the modules hold
(DenseLinear's or QuantLinear's for q/k/v/o and the LM head, SparseFFN's and its Predictor's)
through function pointers. Prefill stays batched in PyTorch, through the same modules.

Which models (`Family`): decoder stacks shaped like HF's LlamaForCausalLM (Llama, SmolLM,
Mistral, Qwen2, ...): pre-norm layers of exactly {input_layernorm, self_attn,
post_attention_layernorm, mlp}, RMSNorm, attention of exactly q/k/v/o projections (biases
allowed, GQA) with rotate-half RoPE (over all or the first part of each head), and an mlp that
is one rewritten SparseFFN (with or without predictor), with Qwen3's per-head q / k norms,
Phi-3's fused qkv_proj or Granite's multipliers; Gemma's (norms by 1 + weight, scaled
embeddings; Gemma 2 and 3: post-norms of each sublayer's output, tanh caps of scores and
logits, a RoPE table per layer type); and OPT's (pre-norm OPT: LayerNorm with biases, learned
positions, the rewritten fc1 / fc2 block in the layer itself); Nemotron's (Llama's layout,
LayerNorms scaling by 1 + weight, RoPE over half of each head); GPT-2's (LayerNorm, learned
positions, q, k and v in one c_attn, its Conv1D layers read as nn.Linear since
passes/linearize.py); Phi-1/2's (attention and FFN in parallel on one LayerNorm of the layer's
input, partial RoPE, an LM head with a bias); GPT-NeoX / Pythia's (in parallel or not, a
LayerNorm each, q, k and v of each head in turn in one query_key_value); Falcon-7B's
(multi-query [q; k; v], or each head's in turn; parallel on one LayerNorm or not). Sliding
windows per layer. Falcon's new decoder architecture (40B, 180B: grouped query_key_value),
ALiBi, dynamic NTK RoPE and GPT-J (RoPE over interleaved pairs) are refused. `Decoder(model)`
checks the structure; `verify(model)` then checks the numbers, one decode step against the
model's own forward, since a look-alike (a model that scales its residuals or logits in its
own forward) has the same modules. The compiler uses the decoder only when both pass, and says why not
otherwise.

The structure checks (`Stack`) are shared with runtime/device_decoder.py, the decode step of a
model split across a GPU and the CPU; `build(model)` picks the one that runs the model.

Binding: the struct holds raw pointers into the kernels' tensors. `key(model)` names what they
were taken from (each kernel object, predictor switch, threshold); the owner (CompiledModel)
keeps the key it built with and rebuilds the decoder when it changes (a dtype change re-selects every kernel, `use_predictors` flips a switch).
"""

from __future__ import annotations

import ctypes
import dataclasses
import inspect
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn

from picompile import quant
from picompile.config import (DECODER_ENV, PROMPT_SNAPSHOT_BYTES, PROMPT_SNAPSHOT_MIN_TOKENS,
                              PROMPT_SNAPSHOTS, cuda_graphs_enabled, decoder_enabled,
                              prompt_cache_enabled, step_prefill_max_tokens)
from picompile.codegen import c as c_codegen
from picompile.codegen import decoder as native
from picompile.runtime.kernel_module import KernelModule
from picompile.runtime.dense_linear import DenseLinear, QuantLinear
from picompile.runtime.generate import cache_kwarg, rope_scaling
from picompile.runtime.sparse_ffn import SparseFFN

VERIFY_TOKENS = 8  # the probe sequence of verify()
# Largest logit difference allowed, relative to the largest logit. The model's forward rounds
# activations to the weight dtype (the decoder keeps them in float32), and a neuron near a
# threshold may fall either way; an architecture the decoder does not reproduce differs by
# about 1 (an offset norm, scaled embeddings).
VERIFY_RTOL = {torch.float32: 1e-3, torch.float16: 0.1, torch.bfloat16: 0.15}
# Where quantized layers round their input to integer blocks (quant.round_activations), a last-bit
# difference in an activation (the decoder's fused norms against the model's) can move it by a
# whole step of its block's 8-bit grid, and the forward's prefill (BLAS over dequantized q8_0
# weights) sums what the decode kernels sum in integers, which tips a neuron near a threshold
# (SmolLM2 q8_0 at 50%: 0.021 of the largest logit, dense 6e-5): the tolerance of float16
# activations applies.
VERIFY_RTOL_INT8 = 0.1


def rotated(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Heads t [..., hd] rotated over their first rot dimensions (cos, sin [T, rot]) as
    Llama's apply_rotary_pos_emb: each half against the other (the decoders' RoPE, in C and
    on the device), in t's dtype."""
    rot = cos.shape[-1]
    r, rest = t[..., :rot], t[..., rot:]
    half = rot // 2
    r = r * cos + torch.cat((-r[..., half:], r[..., :half]), dim=-1) * sin
    return r if rest.shape[-1] == 0 else torch.cat((r, rest), dim=-1)


class Unsupported(Exception):
    """The model is not one the decoder runs; the message says why (for explain())."""


@dataclass(frozen=True)
class Norm:
    """A norm of a layer (or of the final hidden state): the module the model runs (the device
    decoder calls it) and the float32 copies the C step reads."""
    module: nn.Module
    weight: torch.Tensor  # [d] float32
    bias: torch.Tensor | None  # [d] float32: a LayerNorm's; None for RMSNorm
    eps: float


def _norm(mod: nn.Module, where: str, layer_norm: bool, offset: bool = False) -> Norm:
    """An RMSNorm with a weight, or (layer_norm) a LayerNorm over the last dimension; offset:
    scaling by 1 + weight (Gemma's RMSNorm, Nemotron's LayerNorm1P)."""
    if layer_norm:
        kind = "LayerNorm1P" if offset else "LayerNorm"  # the class, or one of that name
        if (not isinstance(mod, nn.LayerNorm) or len(mod.normalized_shape) != 1
                or type(mod) is not nn.LayerNorm and not type(mod).__name__.endswith(kind)
                or offset and mod.weight is None):
            raise Unsupported(f"{where} is a {type(mod).__name__}, not a {kind}")
        d = mod.normalized_shape[0]
        w = torch.ones(d) if mod.weight is None else mod.weight.detach().float() + float(offset)
        b = None if mod.bias is None else mod.bias.detach().float().contiguous()
        return Norm(mod, w.float().contiguous(), b, float(mod.eps))
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    w = getattr(mod, "weight", None)
    if not type(mod).__name__.endswith("RMSNorm") or eps is None or not isinstance(w, torch.Tensor):
        raise Unsupported(f"{where} is a {type(mod).__name__}, not an RMSNorm with a weight")
    if mod._modules or len(list(mod.parameters())) != 1:
        raise Unsupported(f"{where} ({type(mod).__name__}) has more than a weight")
    w = w.detach().float() + 1.0 if offset else w.detach().float().contiguous()
    return Norm(mod, w, None, float(eps))


@dataclass(frozen=True)
class Layer:
    """One decoder layer as the decode steps read it."""
    attn_norm: Norm
    ffn_norm: Norm
    linears: dict  # {"q_proj", "k_proj", "v_proj" (or "qkv_proj": fused), "o_proj": modules}
    head_norms: tuple[Norm, Norm] | None  # RMSNorms of each query and key head (Qwen3), or None
    post_norms: tuple[Norm | None, Norm | None]  # of the attention's and the FFN's output (Gemma 2)
    rope: str | None  # which of the model's RoPE tables the layer reads (Gemma 3: local / global)
    window: int | None  # a sliding-window layer's window: it attends to the last `window` positions
    ffn: SparseFFN
    mlp: nn.Module  # what the layer calls on its normed FFN input: the block, or a wrapper of it


@dataclass(frozen=True)
class Family:
    """Where a family of Hugging Face causal LMs keeps the parts of its pre-norm decoder stack."""
    name: str
    stack: str  # the module holding embed_tokens and layers, under the causal LM
    final_norm: str
    attn_norm: str  # a layer's norm before self_attn
    ffn_norm: str  # and before its FFN, the layer's one other part
    out_proj: str  # the attention's output projection
    layer_norm: bool  # LayerNorm (bias, mean removed) rather than RMSNorm
    positions: str  # "rotary_emb" (RoPE, a module of the stack) or a learned positions embedding
    post_attn_norm: str | None = None  # a norm of the attention's output, before the residual
    post_ffn_norm: str | None = None  # and of the FFN's
    gemma: bool = False  # embeddings times sqrt(d) (in the model's dtype)
    norm_offset: bool = False  # norms scale by 1 + weight (Gemma's RMSNorm, Nemotron's LayerNorm)
    parallel: bool = False  # x + attn(norm(x)) + ffn(ffn_norm(x)): both sublayers read x (Phi)
    granite: bool = False  # the config's multipliers of embeddings, residuals and logits
    layers: str = "layers"  # the stack's list of decoder layers
    embed: str = "embed_tokens"  # the stack's token embedding
    attn: str = "self_attn"  # a layer's attention
    qkv: str = "qkv_proj"  # an attention's q, k and v in one linear, where it has that
    qkv_per_head: bool = False  # that linear gives each head's q, k and v in turn (GPT-NeoX)


LLAMA = Family("Llama", "model", "norm", "input_layernorm", "post_attention_layernorm", "o_proj",
               layer_norm=False, positions="rotary_emb")
PHI = Family("Phi", "model", "final_layernorm", "input_layernorm", "input_layernorm", "dense",
             layer_norm=True, positions="rotary_emb", parallel=True)  # one norm for both
FALCON = Family("Falcon", "transformer", "ln_f", "input_layernorm", "input_layernorm", "dense",
                layer_norm=True, positions="rotary_emb", parallel=True, layers="h",
                embed="word_embeddings", attn="self_attention", qkv="query_key_value")
GPT_NEOX = Family("GPT-NeoX", "gpt_neox", "final_layer_norm", "input_layernorm",
                  "post_attention_layernorm", "dense", layer_norm=True, positions="rotary_emb",
                  parallel=True, embed="embed_in", attn="attention", qkv="query_key_value",
                  qkv_per_head=True)
NEMOTRON = Family("Nemotron", "model", "norm", "input_layernorm", "post_attention_layernorm",
                  "o_proj", layer_norm=True, positions="rotary_emb", norm_offset=True)
OPT = Family("OPT", "model.decoder", "final_layer_norm", "self_attn_layer_norm",
             "final_layer_norm", "out_proj", layer_norm=True, positions="embed_positions")
GRANITE = Family("Granite", "model", "norm", "input_layernorm", "post_attention_layernorm",
                 "o_proj", layer_norm=False, positions="rotary_emb", granite=True)
GEMMA = Family("Gemma", "model", "norm", "input_layernorm", "post_attention_layernorm", "o_proj",
               layer_norm=False, positions="rotary_emb", gemma=True, norm_offset=True)
GPT2 = Family("GPT-2", "transformer", "ln_f", "ln_1", "ln_2", "c_proj", layer_norm=True,
              positions="wpe", layers="h", embed="wte", attn="attn", qkv="c_attn")
GEMMA2 = Family("Gemma 2", "model", "norm", "input_layernorm", "pre_feedforward_layernorm",
                "o_proj", layer_norm=False, positions="rotary_emb",
                post_attn_norm="post_attention_layernorm",
                post_ffn_norm="post_feedforward_layernorm", gemma=True, norm_offset=True)


def family(model: nn.Module) -> Family:
    """The family whose layout `model` claims (Unsupported for one the decoders do not run)."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind == "opt":
        if not config.do_layer_norm_before:
            raise Unsupported("OPT with post-norm layers (do_layer_norm_before=False)")
        base = getattr(getattr(model, "model", None), "decoder", None)
        if getattr(base, "project_in", None) is not None or getattr(base, "project_out", None):
            raise Unsupported("OPT projects its embeddings in and out (word_embed_proj_dim)")
        return OPT
    if kind == "gpt2":
        if config.add_cross_attention or config.scale_attn_by_inverse_layer_idx:
            raise Unsupported("GPT-2 with cross-attention or scores scaled by 1 / layer number")
        return GPT2
    if kind == "gemma":
        return GEMMA
    if kind == "nemotron":
        return NEMOTRON
    if kind == "granite":
        return GRANITE
    if kind in ("gemma2", "gemma3_text"):  # Gemma 3: Gemma 2's layout, its own q / k norms
        return GEMMA2
    if kind == "phi":
        if config.qk_layernorm:
            raise Unsupported("Phi with LayerNorms of each query and key head (qk_layernorm)")
        return PHI
    if kind == "gpt_neox":  # Pythia; its FFN reads the layer's input or the attention's output
        return dataclasses.replace(GPT_NEOX, parallel=bool(config.use_parallel_residual))
    if kind == "falcon":  # Falcon-7B: multi-query, [q; k; v]; else each head's q, k, v in turn
        if config.alibi or config.new_decoder_architecture:
            raise Unsupported("Falcon with ALiBi or the new decoder architecture (grouped "
                              "query_key_value, a norm for each sublayer)")
        if config.parallel_attn:
            return dataclasses.replace(FALCON, qkv_per_head=not config.multi_query)
        return dataclasses.replace(FALCON, qkv_per_head=not config.multi_query, parallel=False,
                                   ffn_norm="post_attention_layernorm")
    if kind == "gptj":
        raise Unsupported(f"{type(model).__name__}: its RoPE over interleaved pairs, which the "
                          "decoders do not run")
    return LLAMA


def _head_dim(attn: nn.Module) -> int:
    """An attention's head size (GPT-NeoX names it head_size), 0 where it says none."""
    return int(getattr(attn, "head_dim", None) or getattr(attn, "head_size", None) or 0)


def _scaling(attn: nn.Module) -> float | None:
    """An attention's score scale (Falcon names it inv_norm_factor), None where it says none."""
    scale = getattr(attn, "scaling", None)
    return getattr(attn, "inv_norm_factor", None) if scale is None else scale


_LINEARS = (DenseLinear, QuantLinear)  # the dense kernel's modules: float or quantized weights


def _dense(mod: nn.Module, where: str) -> DenseLinear | QuantLinear:
    if not isinstance(mod, _LINEARS):
        raise Unsupported(f"{where} is a {type(mod).__name__}, not a lowered linear layer")
    if mod.kernel is None:
        raise Unsupported(f"{where} runs {mod.path}")
    return mod


def ffn_block(mlp: nn.Module, where: str) -> SparseFFN:
    """The one rewritten SparseFFN that `mlp` consists of (Unsupported otherwise)."""
    ffns = [m for m in mlp.modules() if isinstance(m, SparseFFN)]
    if len(ffns) != 1:
        raise Unsupported(f"{where} is not one rewritten sparse FFN block")
    ffn = ffns[0]
    own = {id(p) for p in ffn.parameters()}
    if any(id(p) not in own for p in mlp.parameters()):
        raise Unsupported(f"{where} holds weights outside its sparse FFN block")
    return ffn


def _sparse_ffn_of(mlp: nn.Module, where: str) -> SparseFFN:
    ffn = ffn_block(mlp, where)
    if ffn.hybrid is not None:
        raise Unsupported(f"{where} runs split across the GPU and the CPU")
    if ffn.kernel is None:
        raise Unsupported(f"{where} runs its reference path (no C kernel)")
    return ffn


def _window(attn: nn.Module, config) -> int | None:
    """The sliding window of a layer's attention, or None: its own `sliding_window` where it
    has one (Qwen2, Gemma 2 and 3: per layer type), else the model's (Mistral, Phi-3: every
    layer)."""
    if hasattr(attn, "sliding_window"):
        return int(attn.sliding_window) if attn.sliding_window else None
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None and all(t == "full_attention" for t in types):
        return None
    if types is None and getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


class Stack:
    """A pre-norm decoder stack (Family), its structure checked (Unsupported otherwise): what
    the decode steps read from the model, this file's C one and runtime/device_decoder.py's.
    `linear_of(module, where)` and `ffn_of(mlp, where)` check (and return) a layer's linear
    modules and its FFN block as the step that runs them needs them. `prefills(n)`: the decoder
    runs a prompt's n uncached tokens into its cache itself (`prefill`), else it copies the
    model's prefill (`load_cache`)."""

    def prefills(self, n: int) -> bool:
        return False

    def __init__(self, model: nn.Module, linear_of, ffn_of):
        self.model = model
        config = getattr(model, "config", None)
        if config is None:
            raise Unsupported(f"{type(model).__name__} has no config")
        self.family = fam = family(model)
        try:
            base = model.get_submodule(fam.stack)
        except AttributeError:
            base = None
        layers = getattr(base, fam.layers, None)
        if not isinstance(layers, nn.ModuleList) or not len(layers):
            raise Unsupported(f"{type(model).__name__} has no {fam.stack}.{fam.layers} decoder "
                              "stack")
        for name in (fam.embed, fam.final_norm, fam.positions):
            if getattr(base, name, None) is None:
                raise Unsupported(f"{type(model).__name__}.{fam.stack} has no {name}")
        if not isinstance(getattr(base, fam.embed), nn.Embedding):
            raise Unsupported(f"{fam.stack}.{fam.embed} is not an nn.Embedding")
        self.base, self.decoder_layers = base, layers
        self.lm_head = linear_of(getattr(model, "lm_head", None), "lm_head")
        self.final_norm = _norm(getattr(base, fam.final_norm), f"{fam.stack}.{fam.final_norm}",
                                fam.layer_norm, fam.norm_offset)
        self.embedding = getattr(base, fam.embed).weight  # [vocab, d]
        self.vocab, self.d = self.embedding.shape
        # Gemma scales the embeddings by sqrt(d) rounded to the model's dtype; Granite scales
        # embeddings, each sublayer's output and (dividing) the logits by its config's numbers.
        self.embed_scale, self.residual_scale, self.logit_divisor = 1.0, 1.0, 1.0
        if fam.gemma:
            self.embed_scale = float(torch.tensor(self.d ** 0.5, dtype=self.embedding.dtype))
        if fam.granite:
            self.embed_scale = float(config.embedding_multiplier)
            self.residual_scale = float(config.residual_multiplier)
            self.logit_divisor = float(config.logits_scaling)
        # tanh caps (Gemma 2) of the attention scores and the logits: cap * tanh(s / cap)
        self.attn_softcap = float(getattr(config, "attn_logit_softcapping", None) or 0.0)
        self.logit_softcap = float(getattr(config, "final_logit_softcapping", None) or 0.0)
        # Positions: RoPE (rope_tables), or a learned table [n, d] in the model's dtype, which
        # bounds the positions a step can run.
        self.learned_positions, self.max_positions = None, None
        if rope_scaling(config)[0] == "dynamic":
            raise Unsupported("dynamic NTK RoPE (its frequencies follow the sequence's length; "
                              "the decoder's tables are made once)")
        if fam.positions != "rotary_emb":
            table = getattr(base, fam.positions)
            if not isinstance(table, nn.Embedding):
                raise Unsupported(f"{fam.stack}.{fam.positions} is not an nn.Embedding")
            self.learned_positions = table.weight.detach()[getattr(table, "offset", 0):]
            self.max_positions = len(self.learned_positions)

        attn0 = getattr(layers[0], fam.attn, None)
        if attn0 is None:  # e.g. Qwen3-Next's first layers: linear attention
            raise Unsupported(f"{fam.stack}.{fam.layers}.0 ({type(layers[0]).__name__}) has no "
                              f"{fam.attn}")
        self.head_dim = _head_dim(attn0)
        self.scale = _scaling(attn0)
        self.n_heads = int(getattr(config, "num_attention_heads", 0))
        self.n_kv_heads = int(getattr(attn0, "num_kv_heads", None)  # Falcon's (multi-query: 1)
                              or getattr(config, "num_key_value_heads", None) or self.n_heads)
        if not self.head_dim or self.scale is None or not self.n_heads:
            raise Unsupported("attention without head_dim / scaling / num_attention_heads")
        if self.n_heads % self.n_kv_heads or self.head_dim % 2 or (
                fam.qkv_per_head and self.n_kv_heads != self.n_heads):
            raise Unsupported(f"{self.n_heads} heads over {self.n_kv_heads} key/value heads of "
                              f"dim {self.head_dim}")
        self.eps = self.final_norm.eps
        rotary = getattr(base, "rotary_emb", None)
        self.per_type_rope = (rotary is not None  # a table per layer type (Gemma 3)
                              and "layer_type" in inspect.signature(rotary.forward).parameters)
        self.layers: list[Layer] = [
            self._layer(layer, f"{fam.stack}.{fam.layers}.{i}", linear_of, ffn_of)
            for i, layer in enumerate(layers)]
        self.rot_dim = 0  # dimensions of each head RoPE rotates (head_dim, or fewer)
        if self.learned_positions is None:  # from one position of its tables
            widths = {cos.shape[-1] for cos, _ in self._rope(1).values()}
            self.rot_dim = widths.pop()
            if widths or self.rot_dim % 2 or self.rot_dim > self.head_dim:
                raise Unsupported(f"RoPE tables of widths {sorted(widths | {self.rot_dim})} "
                                  f"over heads of {self.head_dim}")
            self._check_rope_style(attn0, f"{fam.stack}.{fam.layers}.0.{fam.attn}")

    def _check_rope_style(self, attn: nn.Module, where: str) -> None:
        """Unsupported unless the model's own apply_rotary_pos_emb (its modeling module's) turns
        heads as `rotated` does: GLM and Helium rotate interleaved pairs (GPT-J style), which a
        16-bit model's looser numeric check (verify) can let through. A model whose function
        cannot be called so is left to that check."""
        apply = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)
        if apply is None:
            return
        cos, sin = next(iter(self.rope_tables(5).values()))  # [5, rot_dim] float32
        cos, sin = cos.cpu(), sin.cpu()
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 2, 5, self.head_dim, generator=g)
        try:
            theirs, _ = apply(q, q, cos[None], sin[None])
        except (TypeError, ValueError, RuntimeError, IndexError):
            return
        if not torch.allclose(theirs, rotated(q, cos, sin), atol=1e-5, rtol=1e-4):
            raise Unsupported(f"{where}: its RoPE ({type(attn).__module__}."
                              "apply_rotary_pos_emb) does not rotate each half of a head against "
                              "the other (e.g. interleaved pairs, GPT-J style)")

    def _layer(self, layer: nn.Module, where: str, linear_of, ffn_of) -> Layer:
        """One decoder layer's parts, checked: its norms, attention and one FFN block."""
        fam = self.family
        parts = {n for n, m in layer._modules.items() if not isinstance(m, nn.Dropout)}
        post = (fam.post_attn_norm, fam.post_ffn_norm)
        frame = {fam.attn_norm, fam.attn, fam.ffn_norm} | {n for n in post if n}
        if not frame < parts or len(parts) != len(frame) + 1:
            raise Unsupported(f"{where} ({type(layer).__name__}) has the parts "
                              f"{sorted(parts)}, not {sorted(frame)} and one FFN")
        (mlp_name,) = parts - frame
        attn = getattr(layer, fam.attn)
        linears, head_norms = self._attention_parts(attn, f"{where}.{fam.attn}", linear_of)
        norms = [_norm(getattr(layer, n), f"{where}.{n}", fam.layer_norm, fam.norm_offset)
                 for n in (fam.attn_norm, fam.ffn_norm)]
        post_norms = tuple(n and _norm(getattr(layer, n), f"{where}.{n}", fam.layer_norm,
                                       fam.norm_offset) for n in post)
        if any(n.eps != self.eps for n in (*norms, *post_norms) if n is not None):
            raise Unsupported("norm epsilons differ between layers")
        rope = None
        if self.per_type_rope:
            rope = getattr(attn, "layer_type", None)
            if rope is None:
                raise Unsupported(f"{where}.{fam.attn} has no layer_type for its RoPE table")
        mlp = getattr(layer, mlp_name)
        ffn = ffn_of(mlp, f"{where}.{mlp_name}")
        if ffn.d_model != self.d:
            raise Unsupported(f"{where}.{mlp_name} has d={ffn.d_model}, the model {self.d}")
        return Layer(*norms, linears, head_norms, post_norms, rope,
                     _window(attn, self.model.config), ffn, mlp)

    def _attention_parts(self, attn: nn.Module, where: str, linear_of) -> tuple[dict, tuple]:
        """An attention's linears ({our name: module}) and per-head q / k norms (or None)."""
        fam = self.family
        qd, kvd = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        shapes = {"q_proj": (qd, self.d), "k_proj": (kvd, self.d), "v_proj": (kvd, self.d),
                  "qkv_proj": (qd + 2 * kvd, self.d), "o_proj": (self.d, qd)}
        names = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj",
                 "o_proj": fam.out_proj}  # ours: the family's
        if fam.qkv in attn._modules:  # q, k and v in one linear (Phi-3, GPT-2)
            names = {"qkv_proj": fam.qkv, "o_proj": fam.out_proj}
        parts = {n for n, m in attn._modules.items() if not isinstance(m, nn.Dropout)}
        if parts - {"q_norm", "k_norm"} != set(names.values()):
            raise Unsupported(f"{where} has the parts {sorted(parts)}")
        if _head_dim(attn) != self.head_dim or _scaling(attn) != self.scale:
            raise Unsupported(f"{where}: head_dim / scaling differ between layers")
        head_norms = None
        if {"q_norm", "k_norm"} & set(attn._modules):
            head_norms = tuple(_norm(getattr(attn, n, None), f"{where}.{n}", False,
                                     fam.norm_offset) for n in ("q_norm", "k_norm"))
            if any(n.weight.shape != (self.head_dim,) or n.eps != self.eps for n in head_norms):
                raise Unsupported(f"{where}: q_norm / k_norm are not RMSNorms over a head of "
                                  f"{self.head_dim} with epsilon {self.eps}")
        linears = {}
        for name, theirs in names.items():
            lin = linear_of(getattr(attn, theirs), f"{where}.{theirs}")
            if (lin.out_features, lin.in_features) != shapes[name]:
                raise Unsupported(f"{where}.{theirs} is {(lin.out_features, lin.in_features)}, "
                                  f"not {shapes[name]}")
            linears[name] = lin
        return linears, head_norms

    def fits(self, max_len: int) -> bool:
        """Whether a step can run positions 0..max_len-1 (past a table of learned positions it
        cannot)."""
        return self.max_positions is None or max_len <= self.max_positions

    def room(self, max_len: int) -> int:
        """`max_len` within the positions a step can run."""
        return max_len if self.max_positions is None else min(max_len, self.max_positions)

    @staticmethod
    def key(model: nn.Module) -> tuple:
        """What the bound pointers were taken from: every kernel (its generation), the predictor
        switches and thresholds, how each block is split across a GPU (and whether it times
        its hand-offs: the per-module path does), the norms' and embedding's storage, other
        modules' buffers (storage and in-place version), the decoder and CUDA graphs switches.
        A kernel whose tensors' storage was swapped since it was bound (`.data = ...`) is bound
        again first, so the key names the new one."""
        parts = [decoder_enabled(), cuda_graphs_enabled()]
        for mod in model.modules():
            if isinstance(mod, KernelModule):
                mod.rebind_if_moved()
            if isinstance(mod, (*_LINEARS, SparseFFN)):
                parts.append(mod.kernel_generation)
            if isinstance(mod, SparseFFN):
                pred = mod.predictor
                hybrid = mod.hybrid
                split = None if hybrid is None else (id(hybrid), hybrid.timeline is None)
                parts += [mod.threshold, split, pred is not None and pred.enabled,
                          None if pred is None else (pred.kernel_generation, pred.tau)]
            elif not isinstance(mod, _LINEARS):
                parts += [(p.data_ptr(), p.dtype) for p in mod.parameters(recurse=False)]
                # buffers (the rotary inv_freq the RoPE tables come from) edited in place too
                parts += [(b.data_ptr(), b.dtype, b._version) for b in mod.buffers(recurse=False)]
        return tuple(parts)

    @torch.no_grad()
    def rope_tables(self, n: int) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """{Layer.rope: cos, sin [n, rot_dim] float32} from the model's own rotary embedding
        (any scaling; per layer type where it has several), on the embedding's device. RoPE
        rotates each head's first rot_dim dimensions (head_dim, or fewer: Phi-4-mini)."""
        return {kind: (cos.reshape(n, -1).float().contiguous(),
                       sin.reshape(n, -1).float().contiguous())
                for kind, (cos, sin) in self._rope(n).items()}

    def _rope(self, n: int) -> dict:
        device = self.embedding.device
        pos = torch.arange(n, device=device).unsqueeze(0)  # [1, n]
        probe = torch.zeros(1, n, self.head_dim, device=device)
        try:
            return {kind: self.base.rotary_emb(probe, pos, *(() if kind is None else (kind,)))
                    for kind in {layer.rope for layer in self.layers}}
        except (TypeError, ValueError, RuntimeError) as e:  # a rotary module of another shape
            raise Unsupported(f"its rotary embedding cannot be tabled ({type(e).__name__}: "
                              f"{str(e)[:120]})") from e

    def rounds_activations(self) -> bool:
        """Some layer's kernel reads its input rounded to integer blocks (quant.round_activations)."""
        formats = {getattr(self.lm_head, "qformat", None)}
        for layer in self.layers:
            formats |= {getattr(lin, "qformat", None) for lin in layer.linears.values()}
            formats.add(layer.ffn.qformat)
        return bool(formats & quant.FORMATS.keys())

    def release(self) -> None:
        """Let go of what the decoder holds beyond its model (the device decoder: graphs, KV
        cache) when it is replaced; the C decoder's memory is the host's, freed with it."""

    def settle(self) -> None:
        """Finish the steps run so far and raise what they found (the device decoder's work
        runs behind the host); the C decoder's steps are done when they return."""

    # ---- the prompt cache, as llama.cpp's server keeps one ---------------------------------
    # After a generate the KV cache holds the keys and values of the prompt and the reply: the
    # token ids they belong to (`held`, [n] long on the CPU) and the weights they were computed
    # from. A prompt that starts with them (a chat's next turn) prefills only the rest. Where
    # the decoder keeps snapshots (snapshot_slots > 0: the C decoder, in host memory), a prompt
    # that would overwrite what is held first saves a copy of it, and a prompt that starts with
    # a saved one's tokens gets its keys and values back (llama.cpp's slots, one at a time).
    held: torch.Tensor | None = None
    _held_weights: tuple | None = None  # _weights_state when they were computed
    _call_weights: tuple | None = None  # _weights_state when the running call began
    prompt_reused = 0  # positions the last generate took from the prompt cache
    snapshot_slots = 0  # earlier prompts kept beside the held one (config.PROMPT_SNAPSHOTS)
    _snapshots: list | None = None  # [(tokens [n], weights, keys, values)], oldest first

    def cached_prefix(self, tokens: torch.Tensor, total: int) -> int:
        """How many leading positions of the prompt tokens [S] (of a call that runs `total`
        positions) the KV cache holds for these very tokens, computed from the weights as they
        are now (at most S - 1: the last position is prefilled for its logits), where needed
        brought back from a snapshot; 0 where none. The caller writes the cache next, so the
        decoder forgets what it held until hold()."""
        held, weights = self.held, self._held_weights
        self.held = self._held_weights = None
        self.prompt_reused = 0
        self._call_weights = now = _weights_state(self.model)
        if not prompt_cache_enabled() or not self._cacheable(total):
            return 0
        tokens = tokens.cpu()
        fresh = held is not None and _same_weights(weights, now)
        reuse = _common_prefix(held, tokens) if fresh else 0
        snapshots = self._snapshots = [s for s in self._snapshots or []
                                       if _same_weights(s[1], now)]
        shared = [_common_prefix(s[0], tokens) for s in snapshots]
        best = max(range(len(snapshots)), key=shared.__getitem__, default=None)
        # taken out before the held prompt is saved (saving may drop the oldest snapshot)
        restore = snapshots.pop(best) if best is not None and shared[best] > reuse else None
        if fresh and reuse < len(held) and self.snapshot_slots:  # about to be overwritten
            self._save(held, weights)
        if restore is not None:
            self._restore_kv(*restore[2:])
            reuse = shared[best]
        self.prompt_reused = reuse
        return reuse

    def _save(self, held: torch.Tensor, weights: tuple) -> None:
        """A snapshot of the held prompt's keys and values (long enough to be worth it), the
        oldest dropped past PROMPT_SNAPSHOTS or PROMPT_SNAPSHOT_BYTES."""
        if len(held) < PROMPT_SNAPSHOT_MIN_TOKENS:
            return
        keys, values = self._copy_kv(len(held))
        self._snapshots.append((held, weights, keys, values))
        size = lambda s: s[2].nbytes + s[3].nbytes  # noqa: E731
        while (len(self._snapshots) > self.snapshot_slots
               or sum(size(s) for s in self._snapshots) > PROMPT_SNAPSHOT_BYTES):
            self._snapshots.pop(0)

    def _copy_kv(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the KV cache's positions 0..n-1 (decoders with snapshot_slots)."""
        raise NotImplementedError

    def _restore_kv(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Put copies from _copy_kv back at their positions."""
        raise NotImplementedError

    def hold(self, tokens: torch.Tensor, total: int) -> None:
        """Note that the KV cache now holds the positions of tokens [n], computed by the call
        cached_prefix began (that ran `total` positions), unless the weights changed in place
        since it began."""
        began, self._call_weights = self._call_weights, None
        if (self._cacheable(total) and began is not None
                and _weights_state(self.model, sampled=False)[0] == began[0]):
            self.held, self._held_weights = tokens.cpu().clone(), began

    def forget(self) -> None:
        """Drop what the prompt cache holds, snapshots too: the next generate prefills from
        position 0."""
        self.held = self._held_weights = None
        self._snapshots = None
        self.prompt_reused = 0

    def _cacheable(self, total: int) -> bool:
        """Whether a call of `total` positions leaves every cached position whole (Decoder's
        sliding windows may not)."""
        return True

    def reset_counts(self) -> None:
        """Forget the active pairs counted since the last flush_stats (each decoder keeps them
        in `n_active`, one count per layer)."""
        self.n_active.zero_()


_KV_DTYPES = {torch.float16: 1, torch.bfloat16: 2}  # kernels/decoder.c's kv_dtype (0: float32)


def _weights_state(model: nn.Module, sampled: bool = True) -> tuple[tuple, list]:
    """What cached keys and values were computed from: each parameter's and buffer's storage and
    in-place version (a swapped storage or an edit in place changes them), and 16 of its values
    spread over it (an edit through `.data`, as LoRA merges are made, keeps both)."""
    tensors = [*model.parameters(), *model.buffers()]
    versions = tuple((t.data_ptr(), t._version) for t in tensors)
    if not sampled:
        return versions, []
    return versions, [t.detach().reshape(-1)[:: max(1, t.numel() // 16)].clone() for t in tensors]


def _common_prefix(held: torch.Tensor, tokens: torch.Tensor) -> int:
    """Leading positions of tokens [S] that held [n] has (at most S - 1: the last position is
    prefilled for its logits)."""
    n = min(len(held), len(tokens) - 1)
    differs = (held[:n] != tokens[:n]).nonzero()
    return int(differs[0]) if len(differs) else max(n, 0)


def _same_weights(a: tuple | None, b: tuple) -> bool:
    return a is not None and a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def _pointers(norm: Norm | None) -> tuple[int | None, int | None]:
    """A norm's weight and bias (None: it has none) for the C structs."""
    if norm is None:
        return None, None
    return norm.weight.data_ptr(), None if norm.bias is None else norm.bias.data_ptr()


class Decoder(Stack):
    """A bound decode step over `model` (a compiled HF causal LM on the CPU)."""

    snapshot_slots = PROMPT_SNAPSHOTS  # its KV cache is host memory: copies are cheap there

    def __init__(self, model: nn.Module, kv_dtype: torch.dtype | None = None):
        if any(p.device.type != "cpu" for p in model.parameters()):
            raise Unsupported("the model's weights are not all on the CPU")
        super().__init__(model, _dense, _sparse_ffn_of)
        self.lib = native.load()
        # The KV cache: in kv_dtype, by default the model's, as Hugging Face's holds it; a
        # 16-bit one (half the bytes attention reads at depth) where the library has its
        # AVX2 + F16C path, else float32.
        want = kv_dtype or self.embedding.dtype
        self.kv_dtype = torch.float32
        if want in _KV_DTYPES and self.head_dim % 8 == 0 and self.lib.pi_decoder_kv_16bit():
            self.kv_dtype = want
        self.max_len = 0
        self.n_active = torch.zeros(len(self.layers), dtype=torch.int64)  # [n_layers]
        self.step_max = int(self.lib.pi_decoder_step_max())  # tokens per step, at most
        self.x = torch.empty(self.step_max, self.d)  # [step_max, d] float32: the embeddings in
        self.logits = torch.empty(self.step_max, self.vocab)  # [step_max, vocab] float32
        # T -> seconds a step of T tokens takes, a running mean (prompt lookup's cost model)
        self.step_seconds: dict[int, float] = {}
        self._struct = None

    def _copy_kv(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache[:, :, :n].clone(), self.v_cache[:, :, :n].clone()

    def _restore_kv(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        n = keys.shape[2]
        self.k_cache[:, :, :n], self.v_cache[:, :, :n] = keys, values

    def describe(self) -> str:
        kv = str(self.kv_dtype).removeprefix("torch.")
        return (f"picompile decoder (kernels/decoder.c, one C call a step of 1 to "
                f"{self.step_max} tokens, {kv} KV cache)")

    def flush_stats(self, steps: int) -> None:
        """Add what `steps` decode steps computed to each block's statistics, as the per-module
        path counts them per call: active (token, neuron) pairs, and n_ff pairs per token."""
        for layer, n in zip(self.layers, self.n_active.tolist()):
            layer.ffn.active_pairs += n
            layer.ffn.total_pairs += steps * layer.ffn.n_ff
        self.reset_counts()

    # ---- binding ------------------------------------------------------------------------
    def reserve(self, max_len: int) -> bool:
        """Make room for positions 0..max_len-1 (KV cache, RoPE tables); False where the decoder
        cannot run that many (Stack.fits)."""
        if not self.fits(max_len):
            return False
        if max_len <= self.max_len:
            return True
        max_len = self.room(max(max_len, 2 * self.max_len, 64))  # grow geometrically
        L, hd, old = len(self.layers), self.head_dim, self.max_len
        k, v = (torch.zeros(L, self.n_kv_heads, max_len, hd, dtype=self.kv_dtype) for _ in "kv")
        if old:  # the positions cached so far stay (the prompt cache reads them)
            k[:, :, :old], v[:, :, :old] = self.k_cache, self.v_cache
        self.k_cache, self.v_cache = k, v  # [L, kv_heads, max_len, head_dim]
        if self.learned_positions is None:
            self.rope = self.rope_tables(max_len)  # {kind: cos, sin [max_len, rot_dim]}
        else:  # [n, d] float32 (the table itself where the model is float32)
            self.pos_embed = self.learned_positions.float().contiguous()
        self.max_len = max_len
        self._bind()
        return True

    def _bind(self) -> None:
        layers, max_ff = _c_layers(self, range(len(self.layers)), self.k_cache, self.v_cache,
                                   self.rope if self.learned_positions is None else None)
        self._mask = torch.empty(self.step_max, max_ff, dtype=torch.uint8)
        s = native.Decoder(
            len(self.layers), self.d, self.n_heads, self.n_kv_heads, self.head_dim, self.max_len,
            self.vocab, self.family.layer_norm, self.family.parallel, self.family.qkv_per_head,
            self.rot_dim,
            _KV_DTYPES.get(self.kv_dtype, 0),
            self.eps, self.scale, self.embed_scale, self.attn_softcap, self.logit_softcap,
            self.residual_scale, self.logit_divisor,
            None if self.learned_positions is None else self.pos_embed.data_ptr(), layers,
            *_pointers(self.final_norm), _c_linear(self.lm_head), self.n_active.data_ptr(), None,
            self._mask.data_ptr())
        self._work = torch.empty(int(self.lib.pi_decoder_work_floats(ctypes.byref(s))))
        s.work = self._work.data_ptr()
        self._layers, self._struct = layers, s  # kept alive: C reads them by pointer
        self._libs = _threaded_libs(self.lib, [self.lm_head], self.layers)

    def set_threads(self) -> None:
        _set_threads(self._libs)

    # ---- running ------------------------------------------------------------------------
    def load_cache(self, cache, n: int, start: int = 0) -> None:
        """Copy positions start..n-1 of an HF cache (StaticCache / DynamicCache of batch 1, right
        after a prefill up to n tokens) in. A sliding-window layer's cache holds only the last
        positions, in order: they go to their places (its window reads no earlier one)."""
        if n > self.max_len:
            raise ValueError(f"{n} cached positions, room for {self.max_len} (reserve first)")
        if len(cache.layers) != len(self.layers):
            raise ValueError(f"the cache has {len(cache.layers)} layers, the model "
                             f"{len(self.layers)}")
        for i, (layer, ours) in enumerate(zip(cache.layers, self.layers)):
            held = min(n, layer.keys.shape[-2])
            if held < n and not (ours.window and held >= ours.window - 1 and not start):
                raise ValueError(f"layer {i}'s cache holds {held} of {n} positions")
            first = max(n - held, start)
            self.k_cache[i, :, first:n] = layer.keys[0, :, first - n + held : held]
            self.v_cache[i, :, first:n] = layer.values[0, :, first - n + held : held]

    def prefix_into(self, cache, n: int) -> None:
        """Write positions 0..n-1 of the KV cache into an empty HF cache (a StaticCache of batch
        1), as the model's own prefill of those tokens would have, in the model's dtype."""
        where = {"cache_position": torch.arange(n)}  # transformers 4.x's StaticCache reads it
        dtype = self.embedding.dtype
        for i in range(len(self.layers)):
            cache.update(self.k_cache[i, :, :n].unsqueeze(0).to(dtype),
                         self.v_cache[i, :, :n].unsqueeze(0).to(dtype), i, where)

    def _cacheable(self, total: int) -> bool:
        """No sliding window shorter than the call's `total` positions: where one is, Hugging
        Face's cache for that layer keeps only the window's last positions, so neither does its
        prefill fill every position of ours nor can it take ours back whole."""
        return all(not ly.window or ly.window >= total for ly in self.layers)

    def step(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        """tokens [T] (long, 1 <= T <= step_max) at positions pos..pos+T-1 -> logits [T, vocab]
        float32 (a buffer reused by the next step; values of the model's dtype), row t the next
        token's after tokens[:t+1]. The KV cache holds positions 0..pos-1; the step writes
        pos..pos+T-1 (a later step at an earlier position overwrites those it rejected).
        FloatingPointError where they are not finite (a 16-bit KV cache overflowed)."""
        T = tokens.shape[0]
        if not 1 <= T <= self.step_max:
            raise ValueError(f"a decoder step takes 1 to {self.step_max} tokens, got {T}")
        start = time.perf_counter()
        x, logits = self.x[:T], self.logits[:T]
        x.copy_(self.embedding[tokens])
        rc = self.lib.pi_decoder_step(ctypes.byref(self._struct), pos, T, x.data_ptr(),
                                      logits.data_ptr())
        if rc:
            raise (IndexError(f"positions {pos}..{pos + T - 1} outside the reserved "
                              f"{self.max_len}") if rc == -1
                   else MemoryError("picompile decoder step: an FFN kernel ran out of memory"))
        if self.embedding.dtype != torch.float32:  # rounded as the model's own LM head rounds
            logits.copy_(logits.to(self.embedding.dtype))  # them (its greedy ties)
        if not bool(torch.isfinite(logits).all()):  # never a token picked from NaN
            raise FloatingPointError(f"picompile decoder step: the logits at position {pos} "
                                     f"are not finite{self._overflow_hint()}")
        took = time.perf_counter() - start
        mean = self.step_seconds.get(T)
        self.step_seconds[T] = took if mean is None else 0.8 * mean + 0.2 * took
        return logits

    def prefills(self, n: int) -> bool:
        """A few tokens (config.STEP_PREFILL_MAX_TOKENS or fewer: a chat's short next message,
        a prompt sent again) run faster through its own steps, a few at a time, than through
        the model's modules, and need no copy of the cache into the model's and back."""
        return n <= step_prefill_max_tokens()

    def prefill(self, input_ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        """input_ids [1, S] at positions start..S-1 into the KV cache (reserved for S positions
        and more; 0..start-1 already there: the prompt cache) -> logits [1, vocab] float32 of
        the last (step's buffer), through steps of up to step_max tokens; their neurons counted
        in each block's statistics, as a prefill through the modules counts them."""
        ids = input_ids.reshape(-1)
        if not 0 <= start < ids.shape[0]:
            raise ValueError(f"prefill from position {start} of a {ids.shape[0]}-token prompt")
        for pos in range(start, ids.shape[0], self.step_max):
            logits = self.step(ids[pos:pos + self.step_max], pos)
        self.flush_stats(ids.shape[0] - start)
        return logits[-1:]

    def _overflow_hint(self) -> str:
        if self.kv_dtype == torch.float16 and self.embedding.dtype != torch.float16:
            return (": keys or values past float16's range (65504) overflow the float16 KV "
                    "cache (kv_cache='float16'); compile without it to keep the model's dtype")
        return ""


# ---- binding layers to kernels/decoder.c (the Decoder's, and a DeviceDecoder's host layers) --
def _c_linear(lin: DenseLinear | QuantLinear) -> native.Linear:
    lib = lin.kernel.library_for(1)
    bias = lin.kernel.bias
    return native.Linear(native.function_pointer(lib.pi_dense), lin.kernel.weight.data_ptr(),
                         None if bias is None else bias.data_ptr(), lin.out_features)


def _c_ffn(ffn: SparseFFN) -> native.FFN:
    # ffn_stable: a token's sums as in a step of its own, whatever else the step holds
    s = native.FFN(native.function_pointer(ffn.kernel.library.ffn_stable),
                   *ffn.kernel.pointers(), ffn.n_ff, ffn.threshold)
    pred = ffn.predictor
    if pred is not None and pred.enabled:
        if pred.kernel is None:
            raise Unsupported(f"the predictor of {ffn.block.name} runs its reference path")
        s.predict = native.function_pointer(pred.kernel.library.predict)
        s.p1, s.pb1, s.p2t, s.pb2 = pred.kernel.pointers
        s.rank, s.tau = pred.kernel.rank, pred.tau
    return s


def _c_layers(stack: Stack, indices, k_caches, v_caches, rope: dict | None):
    """The C structs of stack's layers at `indices`, over the KV caches k_caches[i] /
    v_caches[i] ([.., kv_heads, max_len, head_dim] each, contiguous, on the CPU) and the RoPE
    tables rope {kind: cos, sin [max_len, rot_dim] float32} (None: learned positions).
    -> (native.Layer array, the largest n_ff among them)."""
    indices = list(indices)
    layers = (native.Layer * len(indices))()
    max_ff = 1
    for j, i in enumerate(indices):
        layer = stack.layers[i]
        lin = layer.linears
        multi = None  # pi_dense_multi for q, k and v in one call
        if "qkv_proj" in lin:  # fused: q's linear writes [q; k; v], k's is empty
            q, k, v = _c_linear(lin["qkv_proj"]), native.Linear(), native.Linear()
        else:
            q, k, v = (_c_linear(lin[n]) for n in ("q_proj", "k_proj", "v_proj"))
            libs = {lin[n].kernel.library_for(1) for n in ("q_proj", "k_proj", "v_proj")}
            if len(libs) == 1:  # where they share a library
                multi = native.function_pointer(libs.pop().pi_dense_multi)
        cos, sin = (None, None) if rope is None else rope[layer.rope]
        layers[j] = native.Layer(
            *_pointers(layer.attn_norm), *_pointers(layer.ffn_norm),
            *(_pointers(n)[0] for n in layer.head_norms or (None, None)),
            *(_pointers(n)[0] for n in layer.post_norms),
            *(None if t is None else t.data_ptr() for t in (cos, sin)), layer.window or 0,
            q, k, v, _c_linear(lin["o_proj"]), _c_ffn(layer.ffn),
            k_caches[i].data_ptr(), v_caches[i].data_ptr(), multi)
        max_ff = max(max_ff, layer.ffn.n_ff)
    return layers, max_ff


def _threaded_libs(lib: ctypes.CDLL, linears: list, layers: list) -> list:
    """(library, its set-threads function, attribute remembering the count) of each C library
    a step over `layers` (and the extra `linears`) runs, so that all use as many OpenMP threads
    as torch."""
    libs = {id(lib): (lib, lib.pi_decoder_set_num_threads, "_pi_dec_threads")}
    for lin in linears + [lin for layer in layers for lin in layer.linears.values()]:
        dense = lin.kernel.library_for(1)
        libs[id(dense)] = (dense, dense.pi_set_num_threads, "_pi_threads")
    for ffn in (layer.ffn for layer in layers):
        kernels = [ffn.kernel]
        if ffn.predictor is not None and ffn.predictor.enabled:
            kernels.append(ffn.predictor.kernel)
        for k in kernels:
            libs[id(k.library)] = (k.library, k.library.pic_set_num_threads, "_pic_threads")
    return list(libs.values())


def _set_threads(libs: list) -> None:
    nt = torch.get_num_threads()
    for lib, setter, attr in libs:
        if getattr(lib, attr, None) != nt:
            setter(nt)
            setattr(lib, attr, nt)


class HostLayers:
    """A run of a stack's decoder layers through kernels/decoder.c, without embedding or LM
    head: the layers a device decoder leaves on the CPU (runtime/device_decoder.py), one C call
    a step over the residual stream, as the whole-model Decoder runs every layer; their KV
    caches are the caller's (in the model's dtype: float32, or 16-bit where the library has its
    AVX2 + F16C path). Unsupported where a layer has no C kernel for some part."""

    def __init__(self, stack: Stack, indices: list[int], k_caches: list[torch.Tensor],
                 v_caches: list[torch.Tensor], rope: dict | None):
        self.lib = native.load()
        self.indices = list(indices)
        for i in self.indices:
            layer = stack.layers[i]
            for name, lin in layer.linears.items():
                _dense(lin, f"layer {i}'s {name}")
            _sparse_ffn_of(layer.ffn, f"layer {i}'s FFN block")
        dtype = k_caches[self.indices[0]].dtype
        if dtype != torch.float32 and not (dtype in _KV_DTYPES and stack.head_dim % 8 == 0
                                           and self.lib.pi_decoder_kv_16bit()):
            raise Unsupported(f"no C attention over a {dtype} KV cache here")
        caches = [c[i] for c in (k_caches, v_caches) for i in self.indices]
        if any(c.device.type != "cpu" or not c.is_contiguous() for c in caches):
            raise Unsupported("the host layers' KV caches are not contiguous on the CPU")
        max_len = k_caches[self.indices[0]].shape[-2]
        self.n_active = torch.zeros(len(self.indices), dtype=torch.int64)  # [n]
        self._layers, max_ff = _c_layers(stack, self.indices, k_caches, v_caches, rope)
        self._mask = torch.empty(max_ff, dtype=torch.uint8)
        s = native.Decoder(
            len(self.indices), stack.d, stack.n_heads, stack.n_kv_heads, stack.head_dim, max_len,
            stack.vocab, stack.family.layer_norm, stack.family.parallel,
            stack.family.qkv_per_head, stack.rot_dim,
            _KV_DTYPES.get(dtype, 0),
            stack.eps, stack.scale, 1.0, stack.attn_softcap, 0.0, stack.residual_scale, 1.0,
            None, self._layers, None, None, native.Linear(), self.n_active.data_ptr(), None,
            self._mask.data_ptr())  # no embedding scale, positions or head: the caller's
        self._work = torch.empty(int(self.lib.pi_decoder_work_floats(ctypes.byref(s))))
        s.work = self._work.data_ptr()
        self._struct = s
        # what the struct points into, kept alive with it (the caller's tables may be its own
        # temporaries: a float32 copy of a 16-bit model's RoPE tables)
        self._tensors = (rope, [k_caches[i] for i in self.indices],
                         [v_caches[i] for i in self.indices])
        self._libs = _threaded_libs(self.lib, [], [stack.layers[i] for i in self.indices])

    def __call__(self, x: torch.Tensor, pos: int) -> None:
        """x [1, d] float32 (contiguous, on the CPU): the residual stream at position pos, run
        through the layers in place; their keys and values written at pos."""
        _set_threads(self._libs)
        rc = self.lib.pi_decoder_step(ctypes.byref(self._struct), pos, 1, x.data_ptr(), None)
        if rc:
            raise (IndexError(f"position {pos} outside the KV cache") if rc == -1
                   else MemoryError("picompile decoder step: an FFN kernel ran out of memory"))


@torch.no_grad()
def verify(model: nn.Module, decoder: Stack) -> None:
    """One decode step through `decoder` (after its own prefill, where it has one) against the
    model's own forward on the same tokens; raises Unsupported when the logits differ by more than the dtype's tolerance (relative to
    the largest logit)."""
    from transformers import StaticCache

    n = VERIFY_TOKENS
    ids = (torch.arange(1, n + 1) * 7919 % decoder.vocab).unsqueeze(0)  # [1, n]
    ids = ids.to(decoder.embedding.device)
    # The probe is not the user's run: every count it adds (each block's, and each side's of a
    # block split across a GPU) is put back.
    counted = [m for f in (layer.ffn for layer in decoder.layers)
               for m in (f, *((f.hybrid.hot, f.hybrid.cold) if f.hybrid is not None else ()))
               if m is not None]
    stats = [(m.active_pairs, m.total_pairs) for m in counted]
    try:
        want = model(ids, use_cache=False).logits[0, -1].float()  # [vocab]
        if not decoder.reserve(n):
            raise Unsupported(f"room for {decoder.max_positions} positions, fewer than the "
                              "probe's")
        if decoder.prefills(n - 1):  # its own prefill, checked against the forward on the prompt
            prompt_want = model(ids[:, :-1], use_cache=False).logits[0, -1].float()
            err = float((decoder.prefill(ids[:, :-1])[0] - prompt_want).abs().max())
            prefill_err = err / max(float(prompt_want.abs().max()), 1e-6)
        else:
            cache = StaticCache(config=model.config, max_cache_len=n)
            model(ids[:, :-1], **{cache_kwarg(model): cache}, use_cache=True)
            decoder.load_cache(cache, n - 1)
            prefill_err = 0.0
        decoder.set_threads()
        try:
            got = decoder.step(ids[0, -1:], n - 1)[0]
            decoder.settle()
        except FloatingPointError as e:  # the probe overflowed a 16-bit KV cache
            raise Unsupported(str(e)) from None
    finally:
        for m, (active, total) in zip(counted, stats):
            m.active_pairs, m.total_pairs = active, total
        decoder.reset_counts()
    err = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-6)
    err = max(err, prefill_err)
    rtol = max(VERIFY_RTOL.get(dtype, 0.15)
               for dtype in (decoder.embedding.dtype, getattr(decoder, "kv_dtype", torch.float32)))
    if decoder.rounds_activations():
        rtol = max(rtol, VERIFY_RTOL_INT8)
    if not err <= rtol:
        raise Unsupported(f"one decode step differs from the model's forward by {err:.2g} of "
                          f"the largest logit (tolerance {rtol:g}): an architecture the decoder "
                          "does not reproduce")


def build(model: nn.Module, kv_dtype: torch.dtype | None = None) -> tuple[Stack | None, str]:
    """(a verified decoder, "") or (None, why not): the C Decoder for a model on the CPU (its
    KV cache in kv_dtype, None: the model's), the DeviceDecoder (runtime/device_decoder.py; the
    model's dtype) for one split across a GPU and the CPU.

    The probe runs with the predictors off on both sides: it checks that the decoder computes
    the model's architecture, whatever the predictors pick (the GPU's hot rows of a call of
    several tokens are the union of theirs). The decoder returned runs the predictors."""
    from picompile.runtime.device_decoder import DeviceDecoder

    if not decoder_enabled():
        return None, f"switched off ({DECODER_ENV}=0): the modules run each step"
    preds = [m.predictor for m in model.modules()
             if isinstance(m, SparseFFN) and m.predictor is not None and m.predictor.enabled]
    hybrid = any(isinstance(m, SparseFFN) and m.hybrid is not None for m in model.modules())

    def bind() -> Stack:
        return DeviceDecoder(model) if hybrid else Decoder(model, kv_dtype)

    try:
        for p in preds:
            p.enabled = False
        try:
            dec = bind()
            verify(model, dec)
        finally:
            for p in preds:
                p.enabled = True
        if preds:
            dec.release()
            dec = bind()  # bound again, to the predictors
    except Unsupported as e:
        return None, str(e)
    except (c_codegen.CompilerNotFound, c_codegen.BuildFailed, c_codegen.LoadFailed) as e:
        return None, f"decoder library unavailable ({getattr(e, 'summary', None) or e})"
    except Exception as e:  # the device decoder's GPU path: fall back to the tested modules
        if not hybrid:
            raise
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return None, (f"the device decoder failed ({type(e).__name__}: {first}); the modules "
                      "run each step")
    return dec, ""
