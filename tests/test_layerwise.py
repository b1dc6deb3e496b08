"""Layer-by-layer ("sequential", GPTQ-style) calibration and profiling, and the passes on
models and samples that are not on the CPU.

On the CPU, device="cpu" runs the layer-by-layer path with no moves: it must give what the
whole-model path gives, bit for bit up to float rounding. The GPU tests run where one exists
(`pytest -m gpu`)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import picompile
from picompile.passes import calibrate as calibrate_pass
from picompile.passes import predictors as predictors_pass
from picompile.passes import profile as profile_pass
from tests import zoo

# llama: HF layers returning a tensor, MLPs captured; opt: whole decoder layers captured as
# GraphModules; tiny: a plain nn.Module called with the ids only.
ARCHS = ["llama_relu", "llama_silu", "opt", "tiny_gated_relu"]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _ids(rows=5, seq=24, seed=0):
    # 5 rows in batches of 4: the last batch is smaller, so blocks see calls of two sizes
    return torch.randint(0, zoo.VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))


def _compiled(arch, **kw):
    return picompile.compile(zoo.make(arch, **kw), quiet=True)


def _assert_same_profiles(a, b, exact=True):
    assert a.keys() == b.keys()
    for name in a:
        pa, pb = a[name], b[name]
        assert pa.tokens == pb.tokens
        assert pa.freq.device.type == "cpu" and pa.freq.dtype == torch.float32
        tol = dict(rtol=0, atol=1e-6) if exact else dict(rtol=0, atol=0.02)
        torch.testing.assert_close(pa.freq, pb.freq.cpu(), **tol)
        if exact:
            assert torch.equal(pa.y, pb.y), name
            torch.testing.assert_close(pa.x, pb.x)


@pytest.mark.parametrize("arch", ARCHS)
def test_layerwise_profile_equals_whole_model(arch):
    cm = _compiled(arch)
    ffns, ids = cm.ffns(), _ids()
    if arch == "llama_silu":  # thresholds, so that not every neuron fires
        calibrate_pass.calibrate(cm._orig_mod, ffns, ids, 0.5, quiet=True)
    whole = profile_pass.profile(cm._orig_mod, ffns, ids, quiet=True)
    layerwise = profile_pass.profile(cm._orig_mod, ffns, ids, quiet=True, device="cpu")
    _assert_same_profiles(whole, layerwise)
    assert all(0 < p.density < 1 and len(p.x) > 0 for p in whole.values())


@pytest.mark.parametrize("device, order", [(None, "0101"), ("cpu", "0011")])
def test_layerwise_runs_every_batch_through_a_layer_before_the_next(device, order):
    cm = _compiled("opt")
    calls = []
    handles = [f.register_forward_hook(lambda *_, i=i: calls.append(str(i)))
               for i, f in enumerate(cm.ffns().values())]
    calibrate_pass.run_calibration(cm._orig_mod, _ids(), quiet=True, device=device)  # 2 batches
    for h in handles:
        h.remove()
    assert "".join(calls) == order


def test_layerwise_profile_with_few_samples_keeps_the_same_tokens():
    # samples_per_block < tokens: a random subset, which must not depend on the block order
    cm = _compiled("llama_relu")
    ffns, ids = cm.ffns(), _ids(rows=6)
    kw = dict(quiet=True, memory_bytes=40 * 2 * (2 * 32 + 80))
    whole = profile_pass.profile(cm._orig_mod, ffns, ids, **kw)
    layerwise = profile_pass.profile(cm._orig_mod, ffns, ids, device="cpu", **kw)
    assert all(0 < len(p.x) <= 40 for p in whole.values())
    _assert_same_profiles(whole, layerwise)


def _calibrated(model, ffns, ids, sparsity, device):
    for ffn in ffns.values():  # the thresholds a previous run set change the activations
        ffn.threshold = ffn.block.decided.threshold = 0.0
    calibrate_pass.calibrate(model, ffns, ids, sparsity, quiet=True, device=device)
    return {n: (f.block.decided.threshold, f.block.measured.sparsity) for n, f in ffns.items()}


@pytest.mark.parametrize("arch", ["llama_silu", "opt"])
def test_layerwise_calibration_gives_the_same_thresholds(arch):
    cm = _compiled(arch)
    ffns, ids = cm.ffns(), _ids(rows=6, seq=32)
    sparsity = 0.5 if arch == "llama_silu" else None  # OPT is ReLU: exact, measured only
    whole = _calibrated(cm._orig_mod, ffns, ids, sparsity, None)
    layerwise = _calibrated(cm._orig_mod, ffns, ids, sparsity, "cpu")
    for name, (threshold, measured) in whole.items():
        assert layerwise[name][0] == pytest.approx(threshold, rel=1e-6)
        assert layerwise[name][1] == pytest.approx(measured, abs=1e-6)
        if sparsity:
            assert threshold > 0 and abs(measured - sparsity) < 0.02


def test_layerwise_calibration_leaves_the_model_as_it_was():
    cm = _compiled("llama_relu")
    ids = _ids(rows=2, seq=9, seed=1)
    with torch.no_grad():
        expected = zoo.logits(cm, ids)
    params = dict(cm._orig_mod.named_parameters())
    before = {k: v.clone() for k, v in cm._orig_mod.state_dict().items()}
    profile_pass.profile(cm._orig_mod, cm.ffns(), _ids(), quiet=True, device="cpu")
    assert dict(cm._orig_mod.named_parameters()) == params  # the same Parameter objects
    after = cm._orig_mod.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with torch.no_grad():  # and it still runs as before (no hook left behind on layer 0)
        torch.testing.assert_close(zoo.logits(cm, ids), expected)


def test_layerwise_needs_a_list_of_decoder_layers():
    class TwoBlocks(nn.Module):  # blocks as attributes, not in a ModuleList
        def __init__(self):
            super().__init__()
            self.a, self.b = zoo.TinyFFN(8, 16, "plain_relu"), zoo.TinyFFN(8, 16, "plain_relu")

        def forward(self, x):
            return self.b(self.a(x))

    cm = picompile.compile(TwoBlocks(), quiet=True)
    with pytest.raises(calibrate_pass.LayerwiseUnsupported, match="list of decoder layers"):
        calibrate_pass.run_calibration(cm._orig_mod, torch.randn(2, 3, 8), device="cpu", quiet=True)
    assert calibrate_pass.calibration_device(cm._orig_mod) == (None, None)  # the whole-model path
    assert isinstance(calibrate_pass.decoder_layers(_compiled("opt").model), nn.ModuleList)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_layerwise_in_float32_for_a_half_model_equals_the_widened_model(dtype):
    """A float16 / bfloat16 model on the CPU calibrates layer by layer in float32 (torch's CPU
    half matmul is a slow loop): what the whole float32-widened model profiles, and every
    weight back in its own dtype, bit for bit."""
    cm = _compiled("llama_silu")
    cm._orig_mod.to(dtype)
    before = {k: p.clone() for k, p in cm._orig_mod.state_dict().items()}
    ffns, ids = cm.ffns(), _ids()
    layerwise = profile_pass.profile(cm._orig_mod, ffns, ids, quiet=True, device="cpu",
                                     dtype=torch.float32)
    after = cm._orig_mod.state_dict()
    assert all(after[k].dtype == t.dtype and torch.equal(after[k], t) for k, t in before.items())
    cm._orig_mod.float()
    whole = profile_pass.profile(cm._orig_mod, ffns, ids, quiet=True)
    _assert_same_profiles(whole, layerwise)
    expected = ("cuda", None) if torch.cuda.is_available() else ("cpu", torch.float32)
    cm._orig_mod.to(dtype)
    assert calibrate_pass.calibration_device(cm._orig_mod) == expected
    cm._orig_mod.float()
    assert calibrate_pass.calibration_device(cm._orig_mod)[1] is None  # float32: as it is


def test_compile_predicted_of_a_float16_model_on_the_cpu():
    model = zoo.make("llama_relu").half()
    cm = picompile.compile(model, mode="predicted", calibration=_ids(rows=8, seq=48),
                           predictors="all", quiet=True)
    assert all(p.dtype != torch.float32 for n, p in cm._orig_mod.named_parameters()
               if "predictor" not in n and p.is_floating_point())
    for b in cm.plan.blocks:
        assert b.measured.predictor_recall >= 0.9 and 0 < b.measured.true_density < 1
    with torch.no_grad():
        assert zoo.logits(cm, _ids(rows=1, seq=5)).isfinite().all()


def test_predictors_train_to_the_cpu_and_deterministically():
    cm = _compiled("llama_relu")
    profiles = profile_pass.profile(cm._orig_mod, cm.ffns(), _ids(), quiet=True)
    prof = next(iter(profiles.values()))
    a, stats = predictors_pass.train_predictor(prof, epochs=2)
    b, _ = predictors_pass.train_predictor(prof, epochs=2)
    assert all(p.device.type == "cpu" for p in a.parameters())
    assert a.tau == b.tau and all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert stats.recall > 0.9


# -- on a GPU ---------------------------------------------------------------------------------

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama_relu", "opt"])
def test_whole_model_profile_of_a_model_on_the_gpu(arch):
    """The model on the GPU, the ids on the CPU: counters on the GPU, freq back on the CPU,
    samples where they were recorded; predictors train there and come back on the CPU."""
    cm = _compiled(arch)
    ids = _ids()
    on_cpu = profile_pass.profile(cm._orig_mod, cm.ffns(), ids, quiet=True)
    cm._orig_mod.to("cuda")
    on_gpu = profile_pass.profile(cm._orig_mod, cm.ffns(), ids, quiet=True)
    _assert_same_profiles(on_cpu, on_gpu, exact=False)
    prof = next(iter(on_gpu.values()))
    assert prof.x.is_cuda and prof.y.is_cuda
    pred, stats = predictors_pass.train_predictor(prof, epochs=2)
    assert all(p.device.type == "cpu" for p in pred.parameters())
    assert stats.recall > 0.9


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama_silu", "opt"])
def test_layerwise_on_the_gpu_for_a_model_on_the_cpu(arch):
    cm = _compiled(arch)
    ffns, ids = cm.ffns(), _ids()
    devices = {k: p.device for k, p in cm._orig_mod.named_parameters()}
    whole = profile_pass.profile(cm._orig_mod, ffns, ids, quiet=True)
    layerwise = profile_pass.profile(cm._orig_mod, ffns, ids, quiet=True, device="cuda")
    _assert_same_profiles(whole, layerwise, exact=False)
    assert all(p.device == devices[k] for k, p in cm._orig_mod.named_parameters())  # moved back
    assert calibrate_pass.calibration_device(cm._orig_mod) == ("cuda", None)


@gpu
@pytest.mark.gpu
def test_compile_predicted_profiles_layer_by_layer_on_the_gpu():
    dense = zoo.make("llama_silu")
    cm = picompile.compile(copy.deepcopy(dense), mode="predicted", sparsity=0.5,
                           calibration=_ids(rows=8, seq=48), predictors="all", quiet=True)
    assert all(p.device.type == "cpu" for p in cm._orig_mod.parameters())
    for b in cm.plan.blocks:
        assert b.measured.predictor_recall >= 0.98 and 0.4 < b.measured.true_density < 0.6
    with torch.no_grad():
        assert zoo.logits(cm, _ids(rows=1, seq=5)).isfinite().all()


@pytest.mark.parametrize("all_logits, positions", [(True, 24), (False, 1)])
def test_calibration_runs_the_lm_head_on_every_position_only_where_a_pass_reads_it(
        all_logits, positions):
    """calibrate and profile read the FFN blocks only: their forward passes run the LM head on
    the last position (logits_to_keep=1); the Hessians pass, which reads its input, on all."""
    cm = _compiled("llama_silu")
    head = cm._orig_mod.get_output_embeddings()
    seen = []
    calibrate_pass.run_calibration(cm._orig_mod, _ids(seq=24), quiet=True, all_logits=all_logits,
                                   hooks=[(head, lambda _m, args, _o: seen.append(args[0].shape[-2]))])
    assert len(seen) == 2 and set(seen) == {positions}  # 5 rows in batches of 4
