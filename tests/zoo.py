"""Tiny random models, one config per architecture picompile must handle (mlx-lm style)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers as T
from torch import nn

VOCAB = 96


def _common(hidden: int, layers: int) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=4, max_position_embeddings=128)


def hf_config(arch: str, hidden: int = 32, n_ff: int = 80, layers: int = 2):
    c = _common(hidden, layers)
    if arch == "llama_relu":
        return T.LlamaConfig(**c, intermediate_size=n_ff, num_key_value_heads=2, hidden_act="relu")
    if arch == "llama_silu":
        return T.LlamaConfig(**c, intermediate_size=n_ff, num_key_value_heads=2)
    if arch == "mistral":
        return T.MistralConfig(**c, intermediate_size=n_ff, num_key_value_heads=2)
    if arch == "qwen2":
        return T.Qwen2Config(**c, intermediate_size=n_ff, num_key_value_heads=2)
    if arch == "phi3":  # q, k, v in one linear, gate and up in one, RoPE over half of a head
        return T.Phi3Config(**c, intermediate_size=n_ff, num_key_value_heads=2, pad_token_id=0,
                            bos_token_id=1, eos_token_id=2, partial_rotary_factor=0.5)
    if arch == "qwen3":  # RMSNorm over each query and key head
        return T.Qwen3Config(**c, intermediate_size=n_ff, num_key_value_heads=2, head_dim=8)
    if arch == "opt":
        return T.OPTConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                           num_attention_heads=4, ffn_dim=n_ff, word_embed_proj_dim=hidden,
                           max_position_embeddings=128)
    if arch == "falcon":
        return T.FalconConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                              num_attention_heads=4)
    if arch == "phi":  # Phi-1/2: GELU written out (NewGELUActivation), attention beside the MLP
        return T.PhiConfig(**c, intermediate_size=n_ff, hidden_act="gelu_new")
    if arch == "glm":  # RoPE over interleaved pairs (GPT-J style), Llama's modules otherwise
        return T.GlmConfig(**c, intermediate_size=n_ff, num_key_value_heads=2, head_dim=8,
                           pad_token_id=0, eos_token_id=2, bos_token_id=1)
    if arch == "gpt_neox":
        return T.GPTNeoXConfig(**c, intermediate_size=n_ff)
    if arch == "gemma":
        return T.GemmaConfig(**c, intermediate_size=n_ff, num_key_value_heads=1, head_dim=8)
    if arch == "gemma2":  # post-norms, tanh caps small enough to matter at these sizes
        return T.Gemma2Config(**c, intermediate_size=n_ff, num_key_value_heads=2, head_dim=8,
                              query_pre_attn_scalar=8, attn_logit_softcapping=2.0,
                              final_logit_softcapping=3.0)
    if arch == "gemma3":  # a sliding-window layer (its own RoPE table) and a global one
        types = (["sliding_attention", "full_attention"] * layers)[:layers]
        return T.Gemma3TextConfig(**c, intermediate_size=n_ff, num_key_value_heads=2, head_dim=8,
                                  query_pre_attn_scalar=8, sliding_window=64, layer_types=types)
    if arch == "granite":  # Llama's modules, scaled residuals and logits
        return T.GraniteConfig(**c, intermediate_size=n_ff, num_key_value_heads=2,
                               residual_multiplier=0.5, embedding_multiplier=2.0,
                               logits_scaling=3.0)
    if arch == "gpt2":  # Conv1D projections (weights [in, out]), learned positions
        return T.GPT2Config(vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=4,
                            n_inner=n_ff, n_positions=128, bos_token_id=1, eos_token_id=2)
    if arch == "nemotron":  # squared ReLU, LayerNorm with weight + 1, RoPE over half of a head
        return T.NemotronConfig(**c, intermediate_size=n_ff, num_key_value_heads=2,
                                partial_rotary_factor=0.5, bos_token_id=1, eos_token_id=2)
    if arch == "arcee":  # Llama's modules with a squared-ReLU plain MLP (AFM)
        return T.ArceeConfig(**c, intermediate_size=n_ff, num_key_value_heads=2,
                             bos_token_id=1, eos_token_id=2)
    if arch == "qwen3_next":  # a linear-attention layer first (no self_attn), MoE FFNs with a
        # shared expert
        return T.Qwen3NextConfig(
            **c, num_key_value_heads=2, head_dim=8, intermediate_size=n_ff,
            moe_intermediate_size=16, shared_expert_intermediate_size=n_ff, num_experts=4,
            num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8,
            layer_types=(["linear_attention", "full_attention"] * layers)[:layers])
    raise KeyError(arch)


HF_ARCHS = ["llama_relu", "llama_silu", "mistral", "qwen2", "qwen3", "phi3", "opt", "falcon",
            "gpt_neox", "gemma", "gemma2", "gemma3", "granite", "nemotron", "arcee", "gpt2"]
TINY_FFNS = ["tiny_plain_relu", "tiny_gated_relu", "tiny_drelu", "tiny_fused_silu",
             "tiny_gated_relu2"]
ALL_ARCHS = HF_ARCHS + TINY_FFNS


class TinyFFN(nn.Module):
    def __init__(self, d: int, n_ff: int, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "fused_silu":
            self.gate_up = nn.Linear(d, 2 * n_ff, bias=False)
        else:
            self.up = nn.Linear(d, n_ff, bias=kind == "plain_relu")
            if kind != "plain_relu":
                self.gate = nn.Linear(d, n_ff, bias=False)
        self.down = nn.Linear(n_ff, d, bias=kind == "plain_relu")

    def forward(self, x):
        if self.kind == "plain_relu":
            return self.down(F.relu(self.up(x)))
        if self.kind == "gated_relu":
            return self.down(torch.relu(self.gate(x)) * self.up(x))
        if self.kind == "drelu":
            return self.down(F.relu(self.gate(x)) * F.relu(self.up(x)))
        if self.kind == "gated_relu2":  # squared ReLU written out
            return self.down(torch.square(F.relu(self.gate(x))) * self.up(x))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class TinyBlock(nn.Module):
    """A pre-norm transformer block written plainly: the FFN is inline in the block."""

    def __init__(self, d: int, n_ff: int, kind: str):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ffn = TinyFFN(d, n_ff, kind)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, t, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.ffn(self.norm2(x))


class HalvedLogitsLlama(T.LlamaForCausalLM):
    """A look-alike: Llama's modules and config, its logits halved in its own forward (what
    only a numeric check tells apart)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits / 2
        return out


class TinyLM(nn.Module):
    """A plain nn.Module causal LM: ids [B, T] -> logits [B, T, vocab]."""

    def __init__(self, kind: str, d: int = 32, n_ff: int = 80, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(TinyBlock(d, n_ff, kind) for _ in range(layers))
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def make(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0, **sizes) -> nn.Module:
    torch.manual_seed(seed)
    if arch.startswith("tiny_"):
        model = TinyLM(arch.removeprefix("tiny_"), **sizes)
    else:
        model = T.AutoModelForCausalLM.from_config(hf_config(arch, **sizes))
    return model.to(dtype).eval()


def logits(model, ids):
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def last_layer_on_host(dense: nn.Module, **compile_kw):
    """dense compiled (a copy) with a gpu_budget one byte short of every decoder layer's parts
    outside the FFN blocks, so that placement leaves the last layer wholly on the CPU ->
    (the compiled model, the budget). Not yet distributed."""
    import copy

    import picompile
    from picompile.passes import place

    probe = picompile.compile(copy.deepcopy(dense), gpu_budget=2**40, **compile_kw)
    budget = place.budget_for_share(probe.plan.placement.fixed_bytes, (), 0.0, less=1)
    return picompile.compile(copy.deepcopy(dense), gpu_budget=budget, **compile_kw), budget
