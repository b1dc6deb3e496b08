"""The compiled model as a user handles it after compile (issue 12): dtype changes, attributes,
saving, compiling again, failed compiles, pickling, and what explain() says."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from transformers import GenerationConfig

import picompile
from picompile.passes import profile as profile_pass
from picompile.runtime.sparse_ffn import SparseFFN
from tests import zoo


def _pair(arch="llama_relu", **kw):
    dense = zoo.make(arch)
    return dense, picompile.compile(copy.deepcopy(dense), quiet=True, **kw)


def _ids(seed=0):
    return torch.randint(0, zoo.VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("first,then", [(torch.float16, None), (torch.bfloat16, torch.float32)])
def test_dtype_change_after_compile_rebinds_the_kernels(first, then):
    """The C kernels read weights through raw pointers: a dtype change must rebind them (it
    gave NaN logits in float16, relative error 0.69 for bf16 then float())."""
    dense, cm = _pair()
    cm.to(first)
    dense.to(first)
    if then is not None:
        cm.to(then)
        dense.to(then)
    dtype = then or first
    for ffn in cm.ffns().values():
        assert ffn.w_up.dtype == dtype
    with torch.no_grad():
        got, want = zoo.logits(cm, _ids()).float(), zoo.logits(dense, _ids()).float()
    assert torch.isfinite(got).all()
    assert (got - want).norm() / want.norm() < (2e-2 if first != torch.float32 else 1e-4)


def test_predicted_model_survives_half():
    dense, cm = _pair(mode="predicted", calibration=torch.randint(0, zoo.VOCAB, (4, 32)))
    cm.half()
    for ffn in cm.ffns().values():
        assert ffn.predictor.p1.dtype == torch.float16
    with torch.no_grad():
        assert torch.isfinite(zoo.logits(cm, _ids())).all()


def test_setting_an_attribute_reaches_the_model():
    _, cm = _pair()
    config = GenerationConfig(max_new_tokens=3, do_sample=False)
    cm.generation_config = config
    assert cm._orig_mod.generation_config is config
    out = cm.generate(torch.randint(0, zoo.VOCAB, (1, 4)))
    assert out.shape == (1, 7)


def test_the_wrapper_does_not_shadow_the_models_attributes():
    """As torch.compile's OptimizedModule: the wrapped model is `_orig_mod`, and every name the
    model has (HF's `model` backbone, `lm_head`, `config`) is the model's own."""
    dense, cm = _pair()
    assert cm.model is cm._orig_mod.model and type(cm.model) is type(dense.model)
    assert cm.lm_head is cm._orig_mod.lm_head and cm.config is cm._orig_mod.config
    assert all(k.startswith("_orig_mod.") for k in cm.state_dict())
    cm.plan = cm.plan  # the wrapper's own names stay the wrapper's
    assert "plan" not in vars(cm._orig_mod)


def test_save_pretrained_refuses_and_points_to_save(tmp_path):
    _, cm = _pair()
    with pytest.raises(TypeError, match=r"cm\.save\(dir\)"):
        cm.save_pretrained(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_compiling_or_loading_onto_a_compiled_model_says_so(tmp_path):
    _, cm = _pair()
    for target in (cm, cm._orig_mod):
        with pytest.raises(ValueError, match="already compiled"):
            picompile.compile(target, quiet=True)
    cm.save(tmp_path / "plan")
    with pytest.raises(ValueError, match="already compiled"):
        picompile.load(cm._orig_mod, tmp_path / "plan")


def _has_sparse_ffn(model) -> bool:
    return any(isinstance(m, SparseFFN) for m in model.modules())


def test_calibration_ids_outside_the_vocabulary_are_refused_before_any_rewrite():
    model = zoo.make("llama_relu")
    bad = torch.full((2, 8), zoo.VOCAB + 5)
    with pytest.raises(ValueError, match="vocabulary"):
        picompile.compile(model, mode="predicted", calibration=bad, quiet=True)
    assert not _has_sparse_ffn(model)
    cm = picompile.compile(model, mode="predicted", calibration=bad % zoo.VOCAB, quiet=True)
    assert cm.plan.blocks


def test_a_compile_that_fails_part_way_leaves_the_model_as_it_was(monkeypatch):
    model = zoo.make("llama_relu")
    with torch.no_grad():
        before = zoo.logits(model, _ids())

    def broken(*args, **kwargs):
        raise RuntimeError("profiling broke")

    monkeypatch.setattr(profile_pass, "profile", broken)
    with pytest.raises(RuntimeError, match="profiling broke"):
        picompile.compile(model, mode="predicted", calibration=_ids(), quiet=True)
    assert not _has_sparse_ffn(model)
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(model, _ids()), before, atol=0, rtol=0)
    monkeypatch.undo()
    assert picompile.compile(model, mode="predicted", calibration=_ids(), quiet=True).plan.blocks


def test_torch_save_and_load_of_a_compiled_model():
    dense, cm = _pair(mode="predicted", calibration=torch.randint(0, zoo.VOCAB, (4, 32)))
    buf = io.BytesIO()
    torch.save(cm, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)  # our own bytes, just written
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(back, _ids()), zoo.logits(cm, _ids()))
    for mine, theirs in zip(cm.ffns().values(), back.ffns().values()):
        assert (mine.kernel is None) == (theirs.kernel is None)
        assert (mine.predictor.kernel is None) == (theirs.predictor.kernel is None)


def test_explain_says_no_target_sparsity_for_all_relu_and_keeps_reasons_whole():
    _, cm = _pair(sparsity=0.5, calibration=torch.randint(0, zoo.VOCAB, (2, 16)))
    text = picompile.explain(cm)
    assert "target sparsity" not in text.splitlines()[0]
    for line in text.splitlines():
        if "kept eager:" in line:
            reason = line.split("kept eager:", 1)[1].strip()
            assert reason and (reason.endswith(".") or len(reason.split()) > 2), line


def test_a_silu_model_compiled_without_sparsity_says_it_stays_dense(capsys):
    picompile.compile(zoo.make("llama_silu"), quiet=False)
    assert "stay dense" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["attention", "ffn"])
def test_a_weight_whose_storage_is_swapped_is_read_again_by_every_path(where):
    """`.data = ...` on a weight after compile: generate (the whole-step decoder, prefill > 8
    tokens by BLAS, so no module forward sees the swap first) and the per-module path read the
    new weight, never the freed one."""
    dense = zoo.make("llama_relu")
    cm = picompile.compile(copy.deepcopy(dense), quiet=True)
    ids = torch.randint(3, zoo.VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    cm.generate(ids, **kw)  # binds the decoder
    with torch.no_grad():
        if where == "attention":
            for model in (cm._orig_mod, dense):
                o = model.model.layers[0].self_attn.o_proj
                o.weight.data = o.weight.data * 3
        else:
            ffn = next(iter(cm.ffns().values()))
            ffn.w_down_t.data = ffn.w_down_t.data * 3
            mlp = dense.model.layers[0].mlp
            mlp.down_proj.weight.data = mlp.down_proj.weight.data * 3
    want = dense.generate(ids, **kw)
    for _ in range(2):
        assert torch.equal(cm.generate(ids, **kw), want)
    with torch.no_grad():
        torch.testing.assert_close(cm(ids[:, :5]).logits, dense(ids[:, :5]).logits,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tokens", [6, 12])
@pytest.mark.parametrize("quantize", [None, "q8_0"])
def test_gradients_flow_through_every_path(tokens, quantize, monkeypatch):
    """Autograd through a compiled model: the C kernels have no backward, so a call that records
    takes the differentiable path (decode-sized inputs too). Float: the dense model's input
    gradients; quantized: the plain-PyTorch layers' (straight-through rounding)."""
    from picompile.config import REFERENCE_ENV
    from picompile.runtime.kernel_module import KernelModule

    dense = zoo.make("llama_relu")
    cm = picompile.compile(copy.deepcopy(dense), quantize=quantize, gptq=False, quiet=True)
    ids = torch.randint(3, zoo.VOCAB, (1, tokens), generator=torch.Generator().manual_seed(2))
    if quantize is not None:  # the reference: the same layers with every kernel unselected
        dense = copy.deepcopy(cm._orig_mod)
        monkeypatch.setenv(REFERENCE_ENV, "1")
        for m in dense.modules():
            if isinstance(m, KernelModule):
                m.select_kernel()
        monkeypatch.delenv(REFERENCE_ENV)
    grads = []
    for model in (dense, cm):
        e = model.get_input_embeddings()(ids).detach().requires_grad_()
        model(inputs_embeds=e, labels=ids).loss.backward()
        grads.append(e.grad)
    assert grads[1].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-3, atol=1e-5)


def test_generate_returns_an_ordinary_tensor_and_forward_works_after_it():
    """As HF's: the output takes in-place edits and autograd; a 16-bit model's forward after a
    generate that prefilled > 8 tokens (the prefill's scratch buffers) works outside it."""
    cm = picompile.compile(zoo.make("llama_silu"), dtype="float16", quiet=True)
    ids = torch.randint(3, zoo.VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    out = cm.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert not out.is_inference()
    out[0, 0] = 1
    with torch.no_grad():
        assert cm(ids).logits.shape == (1, 9, zoo.VOCAB)


def test_explain_names_the_linear_paths_after_a_dtype_change():
    cm = picompile.compile(zoo.make("llama_silu"), quiet=True)
    cm.half()
    line = next(l for l in picompile.explain(cm).splitlines() if l.startswith("other linears"))
    assert "float16" in line and "float32" not in line
