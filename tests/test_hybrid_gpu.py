"""Hybrid execution on a real GPU: equals dense, splits blocks across both devices, and keeps
peak GPU memory (PyTorch's pool + CuPy's pool + the CUDA context) within the budget.

Run where a GPU exists: `pytest -m gpu`."""

from __future__ import annotations

import contextlib
import copy
import gc

import pytest
import torch

import picompile
from picompile.passes import place
from tests import zoo

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
cupy = pytest.importorskip("cupy", reason="needs cupy (pip install picompile[cuda13])")


def _model(dtype, arch="opt"):
    return zoo.make(arch, dtype, n_ff=2048, hidden=256, layers=2)


@pytest.fixture(scope="module")
def _warm_gpu() -> int:
    """Create the CUDA context and cuBLAS's workspaces and load every kernel module these tests
    use (both dtypes, both architectures, both modes, the quantized formats) before anything is
    measured, so that no test depends on which ran first. -> the memory then in use outside
    PyTorch's pool (place.cuda_context_bytes)."""
    a = torch.randn(64, 64, device="cuda")
    (a @ a).sum().item()
    cal = torch.randint(0, zoo.VOCAB, (2, 16))
    runs = [dict(arch=arch, dtype=dtype, mode="predicted") for arch in ("opt", "llama_relu")
            for dtype in (torch.float16, torch.float32)]
    runs += [dict(arch="opt", dtype=dtype, mode="exact") for dtype in (torch.float16, torch.float32)]
    runs += [dict(arch="llama_relu", dtype=torch.float32, mode="exact", quantize=fmt)
             for fmt in ("q4_0", "q8_0")]
    for run in runs:
        arch, dtype = run.pop("arch"), run.pop("dtype")
        # a fault of the quantized kernels fails their own tests, not every test of this file
        with contextlib.suppress(Exception) if "quantize" in run else contextlib.nullcontext():
            cm = picompile.compile(_model(dtype, arch), gpu_budget=8 * 2**30, calibration=cal,
                                   max_context=64, quiet=True, **run)
            for f in cm.ffns().values():
                if f.predictor is not None:
                    f.predictor.tau = float("-inf")
            cm(torch.randint(0, zoo.VOCAB, (1, 4)))
            cm.generate(torch.randint(0, zoo.VOCAB, (1, 4)), max_new_tokens=2, do_sample=False)
            del cm
        gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return place.cuda_context_bytes()[0]


@pytest.fixture(autouse=True)
def _one_context(_warm_gpu, monkeypatch):
    """Every compile of a test counts the CUDA context as measured after the warm-up, so that a
    test's budget (made from a first compile's accounting) holds what its second compile
    places; what the process really holds outside PyTorch's pool is measured by _peak."""
    monkeypatch.setattr(place, "cuda_context_bytes",
                        lambda: (_warm_gpu, "measured once, after the tests' warm-up"))


def _peak() -> dict[str, int]:
    """What the budget promises to bound, by part: the peak of torch's reserved pool since the
    last reset, CuPy's pool, and what the process holds outside both (context, modules)."""
    free, total = torch.cuda.mem_get_info()
    pool = cupy.get_default_memory_pool().total_bytes()
    return dict(torch_peak_reserved=torch.cuda.max_memory_reserved(), cupy_pool=pool,
                outside=total - free - torch.cuda.memory_reserved() - pool)


def _measure_from_here(cm) -> None:
    """Peaks counted from here: the decoder for the switches set now built (a predictor's tau is
    part of its key), what a replaced one held collected, the allocator's cache emptied."""
    cm.decoder()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _assert_within(budget: int, cm) -> None:
    parts = _peak()
    assert sum(parts.values()) <= budget, (sum(parts.values()) - budget, parts, budget,
                                           picompile.explain(cm))


def _compile(dense, ffn_share: float, less: int = 0, **kw):
    """compile(dense, gpu_budget=B, **kw) with B such that `ffn_share` of the FFN neurons' bytes
    fit after the fixed parts, less `less` bytes, as a first compile with room for everything
    accounts them (the CUDA context measured, so the same in both: _warm_gpu loaded every
    module first)."""
    kw = dict(max_context=64, quiet=True, **kw)
    probe = picompile.compile(copy.deepcopy(dense), gpu_budget=64 * 2**30, **kw)
    budget = place.budget_for_share(probe.plan.placement.fixed_bytes, probe.ffns().values(),
                                    ffn_share, less)
    del probe
    gc.collect()
    torch.cuda.empty_cache()
    return picompile.compile(copy.deepcopy(dense), gpu_budget=budget, **kw), budget


def _split_blocks(cm) -> int:
    """Blocks with both a GPU part and a CPU part."""
    return sum(f.hybrid is not None and f.hybrid.hot is not None and f.hybrid.cold is not None
               for f in cm.ffns().values())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("mode", ["exact", "predicted"])
def test_hybrid_on_gpu_splits_equals_dense_and_holds_the_budget(dtype, mode):
    dense = _model(dtype)
    cm, budget = _compile(dense, 0.3, mode=mode, calibration=torch.randint(0, zoo.VOCAB, (4, 32)))
    assert cm.plan.placement.fixed_on_gpu
    assert _split_blocks(cm) > 0, picompile.explain(cm)
    if mode == "predicted":
        for ffn in cm.ffns().values():
            ffn.predictor.tau = float("-inf")  # predict every neuron: must equal dense
    _measure_from_here(cm)
    ids = torch.randint(0, zoo.VOCAB, (1, 8))
    want = dense.generate(ids, max_new_tokens=8, do_sample=False)
    got = cm.generate(ids, max_new_tokens=8, do_sample=False).cpu()
    if dtype == torch.float32:
        assert torch.equal(got, want)
    _assert_within(budget, cm)
    ffn = next(f for f in cm.ffns().values() if f.hybrid is not None and f.hybrid.cold is not None)
    assert ffn.hybrid.cold.active_pairs > 0


def test_hybrid_predicted_decode_on_gpu_counts_both_sides_and_times_with_events():
    """PowerInfer's path: the predictor on the GPU, hot rows compacted on the device, cold rows
    on the CPU at the same time."""
    dense = _model(torch.float16, "llama_relu")
    cm, _ = _compile(dense, 0.3, mode="predicted", calibration=torch.randint(0, zoo.VOCAB, (8, 32)))
    assert _split_blocks(cm) > 0, picompile.explain(cm)
    for f in cm.ffns().values():
        assert f.predictor.p1.device.type == "cuda" and f.predictor.p1.dtype == torch.float16
        f.hybrid.timeline = []
    cm.reset_stats()
    out = cm.generate(torch.randint(0, zoo.VOCAB, (1, 4)), max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 10)
    hybrid = next(f.hybrid for f in cm.ffns().values() if f.hybrid.cold is not None)
    assert hybrid.hot.active_pairs > 0 and hybrid.cold.active_pairs > 0
    steps = [s for s in hybrid.timings() if s["tokens"] == 1]
    assert len(steps) == 5
    for s in steps:
        assert 0 < s["hot_s"] <= s["wall_s"] and s["cold_s"] > 0 and s["hot_bytes"] > 0


def test_hybrid_logits_match_dense_on_gpu_in_predicted_mode_with_everything_predicted():
    dense = _model(torch.float32)
    cm, _ = _compile(dense, 0.3, mode="predicted", calibration=torch.randint(0, zoo.VOCAB, (4, 32)))
    assert _split_blocks(cm) > 0
    for ffn in cm.ffns().values():
        ffn.predictor.tau = float("-inf")
    ids = torch.randint(0, zoo.VOCAB, (2, 4))  # 8 tokens: the hot kernels and the cold worker
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(cm, ids).cpu(), zoo.logits(dense, ids),
                                   atol=1e-3, rtol=1e-3)


def test_a_model_on_the_gpu_compiles_in_predicted_mode():
    dense = _model(torch.float16, "llama_relu")
    cm, _ = _compile(dense.cuda(), 0.3, mode="predicted",
                     calibration=torch.randint(0, zoo.VOCAB, (4, 32)))
    assert _split_blocks(cm) > 0
    for f in cm.ffns().values():  # hot rows copied, the full weights on the CPU only
        assert f.w_up.device.type == "cpu" and f.hybrid.hot.w_up.device.type == "cuda"
        assert f.hybrid.hot.w_up.untyped_storage().nbytes() == (
            f.hybrid.hot.w_up.numel() * f.hybrid.hot.w_up.element_size())
    out = cm.generate(torch.randint(0, zoo.VOCAB, (1, 4)), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 8)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_quantized_model_splits_across_the_gpu_within_the_budget(fmt):
    """compile(quantize=, gpu_budget=): FFN blocks quantized, hot rows on the GPU in their
    format, cold rows on the CPU; attention and the LM head quantized on the GPU (placement
    counted the quantized bytes of both). Logits near the float model's, peak memory within the
    budget."""
    from picompile.runtime.dense_linear import QuantLinear

    dense = _model(torch.float32, "llama_relu")
    cm, budget = _compile(dense, 0.1, quantize=fmt, calibration=torch.randint(0, zoo.VOCAB, (4, 32)))
    assert _split_blocks(cm) > 0, picompile.explain(cm)
    assert all(f.qformat == fmt and f.hybrid.hot.qformat == fmt for f in cm.ffns().values()
               if f.hybrid.hot is not None)
    linears = [m for m in cm._orig_mod.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 9  # 4 attention projections per layer, the LM head
    assert all(m.qweight.is_cuda and m.path.startswith("CUDA") for m in linears)
    _measure_from_here(cm)
    ids = torch.randint(0, zoo.VOCAB, (2, 4))  # 8 tokens: the hot kernels and the cold worker
    with torch.no_grad():
        got, want = zoo.logits(cm, ids).cpu().float(), zoo.logits(dense, ids)
    # every linear quantized: q4_0 moves this random model's logits by a cosine of about 0.975
    # (measured on the CPU, which runs the same arithmetic)
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert cos > (0.999 if fmt == "q8_0" else 0.95), cos
    out = cm.generate(ids[:1], max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 10)  # 4 prompt tokens, 6 new
    _assert_within(budget, cm)


def test_the_device_waits_for_the_host_and_says_when_it_gave_up():
    """codegen.cuda.wait_value, the device decoder's wait for each split block's cold rows: it
    sees the host's write to pinned memory, and past its timeout it goes on and sets gave_up."""
    import time

    from picompile.codegen import cuda

    assert cuda.host_wait_works(torch.cuda.current_device()) == ""
    flag, gave_up = (torch.zeros(1, dtype=torch.int32, pin_memory=True) for _ in range(2))
    t0 = time.perf_counter()
    cuda.wait_value(flag, torch.ones(1, dtype=torch.int32, device="cuda"), gave_up, timeout_s=0.2)
    torch.cuda.synchronize()
    assert int(gave_up) == 1 and time.perf_counter() - t0 >= 0.2


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("ffn_share", [0.3, 1.5])
def test_decode_replays_cuda_graphs_and_equals_the_eager_segments(dtype, ffn_share, monkeypatch):
    """The device decoder's step captured as one CUDA graph (its split blocks' cold rows waited
    for on the device, split or not): the same tokens as the segments run eagerly, in float32
    with every neuron predicted the dense model's, its only KV cache within the budget; a timed
    step (eager) gives each split block's wall from CUDA events."""
    from picompile.runtime.device_decoder import DeviceDecoder

    if dtype == torch.float16:  # each generate prefills its whole prompt, as the first did: a
        # cached prompt's last token, prefilled alone, rounds otherwise in float16 (a near-tie
        # could turn); the prompt cache's own test is the next one
        monkeypatch.setenv("PICOMPILE_PROMPT_CACHE", "0")
    dense = _model(dtype, "llama_relu")
    cm, budget = _compile(dense, ffn_share, mode="predicted",
                          calibration=torch.randint(0, zoo.VOCAB, (4, 32)))
    for f in cm.ffns().values():
        f.predictor.tau = float("-inf")
    dec = cm.decoder()
    assert isinstance(dec, DeviceDecoder), cm.decoder_reason
    cold = [i for i, f in enumerate(cm.ffns().values()) if f.hybrid.cold is not None]
    assert [(c, h) for _, c, h in dec.segments] == [(cold, [])], picompile.explain(cm)
    assert bool(cold) == (ffn_share < 1)
    _measure_from_here(cm)
    ids = torch.randint(0, zoo.VOCAB, (1, 8))
    got = cm.generate(ids, max_new_tokens=12, do_sample=False)
    assert dec.graphs is not None and len(dec.graphs) == 1, dec.graph_reason
    _assert_within(budget, cm)
    if dtype == torch.float32:
        assert torch.equal(got.cpu(), dense.generate(ids, max_new_tokens=12, do_sample=False))
    dec.timeline = []
    assert torch.equal(cm.generate(ids, max_new_tokens=4, do_sample=False), got[:, :12])
    blocks = [e for e in dec.timings() if e["layer"] is not None]
    dec.timeline = None
    assert len(blocks) == 3 * len(cold)
    assert all(0 < b["device_s"] < b["wall_s"] and b["cold_s"] > 0 for b in blocks)
    monkeypatch.setenv("PICOMPILE_CUDA_GRAPHS", "0")
    eager = cm.decoder()
    assert isinstance(eager, DeviceDecoder) and eager is not dec and eager.graphs is None
    assert torch.equal(cm.generate(ids, max_new_tokens=12, do_sample=False), got)


def test_a_next_turn_reuses_the_device_decoders_kv_cache(monkeypatch):
    """The prompt cache through the device decoder on a GPU (a split model, its graphs
    replayed): a prompt that starts with the last call's tokens prefills only the rest, and
    gives the tokens of a prefill from position 0 and of the dense model."""
    from picompile.runtime.device_decoder import DeviceDecoder

    dense = _model(torch.float32, "llama_relu")
    cm, budget = _compile(dense, 0.3, mode="predicted",
                          calibration=torch.randint(0, zoo.VOCAB, (4, 32)))
    for f in cm.ffns().values():
        f.predictor.tau = float("-inf")
    _measure_from_here(cm)
    dec = cm.decoder()
    assert isinstance(dec, DeviceDecoder), cm.decoder_reason
    g = torch.Generator().manual_seed(5)
    first = cm.generate(torch.randint(0, zoo.VOCAB, (1, 8), generator=g), max_new_tokens=6,
                        do_sample=False).cpu()
    turn = torch.cat([first, torch.randint(0, zoo.VOCAB, (1, 5), generator=g)], 1)
    out = cm.generate(turn, max_new_tokens=6, do_sample=False).cpu()
    assert dec.graphs is not None, dec.graph_reason
    assert dec.prompt_reused == first.shape[1] - 1
    monkeypatch.setenv("PICOMPILE_PROMPT_CACHE", "0")
    assert torch.equal(cm.generate(turn, max_new_tokens=6, do_sample=False).cpu(), out)
    assert dec.prompt_reused == 0
    assert torch.equal(out, dense.generate(turn, max_new_tokens=6, do_sample=False))
    _assert_within(budget, cm)


def test_a_rebuilt_decoder_leaves_no_gpu_memory_behind():
    """A predictor switch rebuilds the device decoder: the replaced one releases its graphs and
    KV cache at once (no collector needed) and every capture runs on the one side stream
    (cuBLAS keeps a workspace per stream it ran on), so what the process holds stays put."""
    dense = _model(torch.float16, "llama_relu")
    cm, _ = _compile(dense, 0.3, mode="predicted", calibration=torch.randint(0, zoo.VOCAB, (4, 32)))
    ids = torch.randint(0, zoo.VOCAB, (1, 8))
    cm.generate(ids, max_new_tokens=4, do_sample=False)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved()
    first = cm.decoder()
    for tau in (float("-inf"), 0.0, float("-inf")):
        for f in cm.ffns().values():
            f.predictor.tau = tau
        cm.generate(ids, max_new_tokens=4, do_sample=False)
    assert cm.decoder() is not first and first.graphs is None  # rebuilt; the first released
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= held, (torch.cuda.memory_reserved(), held)


def test_a_model_on_the_gpu_without_a_budget_says_how_to_run_the_kernels(capsys, monkeypatch):
    monkeypatch.delenv("PICOMPILE_QUIET", raising=False)
    cm = picompile.compile(_model(torch.float16, "llama_relu").cuda())
    assert "no gpu_budget was given" in capsys.readouterr().err
    assert cm.generate(torch.randint(0, zoo.VOCAB, (1, 4)).cuda(), max_new_tokens=3).shape == (1, 7)


def test_a_model_on_the_gpu_whose_first_layer_does_not_fit_runs_on_the_cpu():
    """Nothing fits the budget: the model, given on the GPU, moves to the CPU (the budget holds;
    the CPU kernels run it), and decodes as the dense model."""
    dense = _model(torch.float32)
    ids = torch.randint(0, zoo.VOCAB, (1, 8))
    want = dense.generate(ids, max_new_tokens=6, do_sample=False)
    cm = picompile.compile(copy.deepcopy(dense).cuda(), gpu_budget=2**20, max_context=64,
                           calibration=torch.randint(0, zoo.VOCAB, (2, 16)), quiet=True)
    assert not cm.plan.placement.fixed_on_gpu
    assert all(p.device.type == "cpu" for p in cm._orig_mod.parameters())
    assert torch.equal(cm.generate(ids, max_new_tokens=6, do_sample=False), want)


@pytest.mark.parametrize("arch", ["llama_relu", "opt"])
def test_a_layer_left_on_the_cpu_runs_between_replayed_graphs_within_the_budget(arch):
    """A budget one byte short of every layer's non-FFN parts: the last layer runs wholly on the
    CPU between the device decoder's CUDA graphs, the tokens the dense model's (every neuron
    predicted), peak memory within the budget."""
    from picompile.runtime.device_decoder import DeviceDecoder

    dense = _model(torch.float32, arch)
    cm, budget = _compile(dense.cuda(), 0.0, less=1, mode="predicted",
                          calibration=torch.randint(0, zoo.VOCAB, (4, 32)))
    assert len(cm.plan.placement.host_layers) == 1, picompile.explain(cm)
    host = cm._orig_mod.get_submodule(cm.plan.placement.host_layers[0])
    assert all(p.device.type == "cpu" for p in host.parameters())
    for f in cm.ffns().values():
        f.predictor.tau = float("-inf")
    dec = cm.decoder()
    assert isinstance(dec, DeviceDecoder) and sum(dec.on_host) == 1, cm.decoder_reason
    _measure_from_here(cm)
    ids = torch.randint(0, zoo.VOCAB, (1, 8))
    got = cm.generate(ids, max_new_tokens=10, do_sample=False)
    assert dec.graphs is not None, dec.graph_reason
    assert len(dec.host_runs) == 1 and not dec.host_reason, dec.host_reason  # in C
    _assert_within(budget, cm)
    assert torch.equal(got.cpu(), dense.cpu().generate(ids, max_new_tokens=10, do_sample=False))


def test_a_loaded_hybrid_plan_runs_split_as_planned(tmp_path, capsys, monkeypatch):
    """load() of a plan made with a gpu_budget splits the model as compile did; with
    distribute=False it stays on the CPU and says how to split it."""
    monkeypatch.delenv("PICOMPILE_QUIET", raising=False)
    dense = _model(torch.float32)
    cm, _ = _compile(dense, 0.3, calibration=torch.randint(0, zoo.VOCAB, (4, 32)))
    cm.save(tmp_path)
    ids = torch.randint(0, zoo.VOCAB, (1, 8))
    want = cm.generate(ids, max_new_tokens=6, do_sample=False).cpu()
    del cm
    loaded = picompile.load(copy.deepcopy(dense), tmp_path)
    assert _split_blocks(loaded) > 0
    assert torch.equal(loaded.generate(ids, max_new_tokens=6, do_sample=False).cpu(), want)
    del loaded
    capsys.readouterr()
    on_cpu = picompile.load(copy.deepcopy(dense), tmp_path, distribute=False)
    assert "cm.distribute()" in capsys.readouterr().err
    assert all(f.hybrid is None for f in on_cpu.ffns().values())
