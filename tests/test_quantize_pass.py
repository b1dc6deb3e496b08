"""compile(quantize=...): every FFN block and linear layer reads GGUF blocks; the model equals
the float model whose weights went through the same quantization (the kernels add nothing but
float32 rounding); plans record the format; a GGUF file's own tensors are kept as they are."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import picompile
from picompile import quant
from picompile.runtime.dense_linear import QuantLinear
from picompile.runtime.sparse_ffn import SparseFFN
from tests import zoo

FORMATS = sorted(quant.FORMATS)


def _fake_quant(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """w [rows, cols] through quantize -> dequantize, in w's dtype."""
    return quant.dequantize(quant.quantize(w, fmt), fmt, w.shape[1]).to(w.dtype)


@torch.no_grad()
def _fake_quant_model(dense: nn.Module, fmt: str) -> nn.Module:
    """The float model with what compile(quantize=fmt) quantizes quantized and dequantized:
    every nn.Linear, the down projection along its output dimension (the kernels' rows are
    neurons), the LM head untied from the embedding (which stays float)."""
    ref = copy.deepcopy(dense)
    for name, m in ref.named_modules():
        if isinstance(m, nn.Linear):
            w = m.weight
            if name.endswith("down_proj"):
                q = _fake_quant(w.t().contiguous(), fmt).t()
            else:
                q = _fake_quant(w, fmt)
            m.weight = nn.Parameter(q.contiguous(), requires_grad=False)
    return ref


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ["llama_relu", "llama_silu"])
def test_quantized_model_equals_the_fake_quantized_float_model(fmt, arch):
    dense = zoo.make(arch, hidden=64, n_ff=96)
    ref = _fake_quant_model(dense, fmt)
    cm = picompile.compile(copy.deepcopy(dense), quantize=fmt, quiet=True)
    ffns = [m for m in cm.model.modules() if isinstance(m, SparseFFN)]
    linears = [m for m in cm.model.modules() if isinstance(m, QuantLinear)]
    assert ffns and all(f.qformat == fmt and f.w_up.dtype == torch.uint8 for f in ffns)
    assert len(linears) == 2 * 4 + 1 and all(m.qformat == fmt for m in linears)  # q k v o x2, head
    ids = torch.randint(0, zoo.VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(cm, ids), zoo.logits(ref, ids), atol=2e-4, rtol=2e-4)
        # decode steps (the kernels, through the whole-step decoder where it runs)
        want = ref.generate(ids, max_new_tokens=6, do_sample=False)
        got = cm.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    text = picompile.explain(cm)
    assert f"FFN {fmt}" in text and f"linear {fmt}" in text


def test_quantized_plan_saves_and_loads(tmp_path):
    dense = zoo.make("llama_relu", hidden=64, n_ff=96)
    cm = picompile.compile(copy.deepcopy(dense), quantize="q4_0", quiet=True)
    cm.save(tmp_path / "plan")
    loaded = picompile.load(copy.deepcopy(dense), tmp_path / "plan")
    assert loaded.plan.quantize == "q4_0"
    ids = torch.randint(0, zoo.VOCAB, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(loaded, ids), zoo.logits(cm, ids))


def test_bad_quantize_arguments_are_refused_before_any_change():
    dense = zoo.make("llama_relu", hidden=64, n_ff=96)
    with pytest.raises(ValueError, match="quantize must be one of"):
        picompile.compile(dense, quantize="q5_k", quiet=True)
    with pytest.raises(ValueError, match="CPU only"):
        picompile.compile(dense, quantize="q8_0", gpu_budget="1GB", quiet=True)
    with pytest.raises(ValueError, match="pass gguf="):
        picompile.compile(dense, quantize="gguf", quiet=True)
    assert not any(isinstance(m, SparseFFN) for m in dense.modules())


def test_widths_off_the_block_size_stay_float_with_a_note():
    dense = zoo.make("llama_relu", hidden=48, n_ff=96)  # 48 is not a multiple of 32
    cm = picompile.compile(dense, quantize="q8_0", quiet=True)
    assert not any(isinstance(m, QuantLinear) for m in cm.model.modules())
    assert all(f.qformat is None for f in cm.model.modules() if isinstance(f, SparseFFN))
    text = picompile.explain(cm)
    assert "stays float" in text and "not a multiple of 32" in text


@pytest.mark.slow
def test_gguf_file_tensors_are_kept_as_they_are():
    """SmolLM2's Q4_1 file: q/k/v/o, gate and up keep the file's blocks (q and k in the row
    order transformers gives them), the tied LM head its Q8_0 embedding blocks; the compiled
    model stays close to the float model transformers dequantized."""
    import gguf

    from picompile import gguf_weights, models

    model, _ = models.load()
    path = models.default_gguf()
    dense = copy.deepcopy(model)
    cm = picompile.compile(model, gguf=path, quiet=True)
    assert cm.plan.quantize == "gguf"
    reader = {t.name: t for t in gguf.GGUFReader(path).tensors}
    mods = dict(cm.model.named_modules())
    v = mods["model.layers.3.self_attn.v_proj"]
    assert v.qformat == "q4_1" and torch.equal(v.qweight, torch.from_numpy(reader["blk.3.attn_v.weight"].data.copy()))
    assert mods["lm_head"].qformat == "q8_0"
    q = mods["model.layers.3.self_attn.q_proj"]
    torch.testing.assert_close(quant.dequantize(q.qweight, "q4_1", 576),
                               dense.model.layers[3].self_attn.q_proj.weight, atol=0, rtol=0)
    ffn = cm.ffns()["model.layers.3.mlp.sparse_ffn"]
    assert ffn.qformat == "q4_1"
    torch.testing.assert_close(quant.dequantize(ffn.w_up.data, "q4_1", 576),
                               dense.model.layers[3].mlp.up_proj.weight, atol=0, rtol=0)
    assert gguf_weights.module_name("blk.3.ffn_up.weight") == "model.layers.3.mlp.up_proj"
    ids = torch.randint(0, 49152, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = zoo.logits(cm, ids), zoo.logits(dense, ids)
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99
    assert "FFN q4_1" in picompile.explain(cm)
