"""The decode step of a model split across a GPU and the CPU (runtime/device_decoder.py), with the
CPU standing in for the GPU: every hand-off, copy and merge runs, the segments eagerly. (Their
CUDA graphs: the gpu-marked tests in test_hybrid_gpu.py.)"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM

import picompile
from picompile.compiler import apply_order
from picompile.runtime import decoder as decoder_module
from picompile.runtime import generate as fast
from picompile.runtime.device_decoder import DeviceDecoder
from tests import zoo


def _split(arch, shares, mode="exact", dtype=torch.float32, seed=0, config=None, model_class=None):
    """(dense, compiled and split on the CPU stand-in): block i keeps shares[i % len] of its
    neurons (a random order) on the "GPU". `config`, `model_class`: the model's, instead of the
    zoo's."""
    dense = zoo.make(arch, dtype, seed=seed)
    if config is not None or model_class is not None:
        torch.manual_seed(seed)
        config = config or zoo.hf_config(arch)
        dense = (model_class(config) if model_class else
                 AutoModelForCausalLM.from_config(config)).to(dtype).eval()
    kw = {}
    if mode == "predicted":
        kw = dict(mode="predicted", calibration=torch.randint(0, zoo.VOCAB, (6, 32)))
    cm = picompile.compile(copy.deepcopy(dense), quiet=True, **kw)
    gen = torch.Generator().manual_seed(seed)
    for ffn, share in zip(cm.ffns().values(), itertools.cycle(shares)):
        apply_order(ffn, torch.randperm(ffn.n_ff, generator=gen))
        ffn.block.decided.hot_neurons = int(round(share * ffn.n_ff))
        ffn.select_kernel()
    cm.distribute("cpu")
    return dense, cm


def _ids(n=5, seed=1):
    return torch.randint(0, zoo.VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama_relu", "llama_silu", "qwen2", "qwen3", "phi3",
                                  "mistral", "opt", "gemma", "gemma2", "gemma3", "granite",
                                  "gpt2", "nemotron", "arcee"])
@pytest.mark.parametrize("shares", [(0.4,), (0.0,), (1.0,), (1.0, 0.3)])
def test_split_model_decodes_through_the_device_decoder_as_dense(arch, shares):
    dense, cm = _split(arch, shares)
    dec = cm.decoder()
    assert isinstance(dec, DeviceDecoder), cm.decoder_reason
    cold = [i for i, f in enumerate(cm.ffns().values()) if f.hybrid.cold is not None]
    # no layer on the host: one segment, its split blocks one batch of the cold worker's
    assert [(c, host) for _, c, host in dec.segments] == [(cold, [])]
    assert dec.graphs is None and "cpu" in dec.graph_reason
    ids = _ids()
    want = dense.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(cm.generate(ids, max_new_tokens=10, do_sample=False), want)


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_sliding_windows_past_their_size_decode_as_dense(arch):
    config = zoo.hf_config(arch)
    config.sliding_window = 4  # every layer (Mistral), every other one (Gemma 3)
    dense, cm = _split(arch, (0.5,), config=config)
    dec = cm.decoder()
    assert isinstance(dec, DeviceDecoder), cm.decoder_reason
    assert any(layer.window == 4 for layer in dec.layers)
    ids = _ids(n=7, seed=9)
    want = dense.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert torch.equal(cm.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False),
                       want)


@pytest.mark.parametrize("arch", ["llama_relu", "opt"])
def test_float16_split_model_matches_its_own_forward(arch):
    """The residual stream, norms and attention stay in the model's dtype, as HF's do."""
    dense, cm = _split(arch, (0.5,), dtype=torch.float16)
    assert isinstance(cm.decoder(), DeviceDecoder), cm.decoder_reason
    ids = _ids(seed=3)
    # greedy through the device decoder against the per-module path (no decoder)
    got = cm.generate(ids, max_new_tokens=8, do_sample=False)
    want = fast.generate(cm._orig_mod, ids, max_new_tokens=8)
    assert torch.equal(got, want)


def test_counts_each_side_as_the_per_module_path_does():
    _, cm = _split("llama_relu", (0.5,))
    assert isinstance(cm.decoder(), DeviceDecoder), cm.decoder_reason
    ffns = list(cm.ffns().values())

    def counts():
        return [(f.hybrid.hot.active_pairs, f.hybrid.cold.active_pairs, f.total_pairs)
                for f in ffns]

    assert all(c == (0, 0, 0) for c in counts())  # building (and verifying) counted nothing
    ids = _ids(seed=4)
    cm.reset_stats()
    got = cm.generate(ids, max_new_tokens=8, do_sample=False)
    through_decoder = counts()
    cm.reset_stats()
    assert torch.equal(fast.generate(cm._orig_mod, ids, max_new_tokens=8), got)
    per_module = counts()
    for (hot, cold, total), (hot_m, cold_m, total_m) in zip(through_decoder, per_module):
        assert total == total_m and hot > 0 and cold > 0
        assert abs(hot - hot_m) <= 0.03 * hot_m and abs(cold - cold_m) <= 0.03 * cold_m


def test_predicted_split_decodes_as_the_cpu_decoder_on_the_same_plan():
    _, cm = _split("llama_relu", (0.5,), mode="predicted", seed=2)
    cpu = copy.deepcopy(cm)
    for ffn in cpu.ffns().values():
        ffn.hybrid = None  # the same plan on the CPU alone: the C whole-step decoder
    assert isinstance(cm.decoder(), DeviceDecoder), cm.decoder_reason
    assert cpu.decoder() is not None and not isinstance(cpu.decoder(), DeviceDecoder)
    ids = _ids(seed=5)
    assert torch.equal(cm.generate(ids, max_new_tokens=10, do_sample=False),
                       cpu.generate(ids, max_new_tokens=10, do_sample=False))
    assert 0.0 < cm.sparsity() < 1.0


def test_timing_a_block_hands_decode_to_the_per_module_path():
    dense, cm = _split("llama_relu", (0.5,))
    assert isinstance(cm.decoder(), DeviceDecoder)
    ffn = next(iter(cm.ffns().values()))
    ffn.hybrid.timeline = []
    assert cm.decoder() is None and "times its hand-offs" in cm.decoder_reason
    ids = _ids(seed=6)
    want = dense.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(cm.generate(ids, max_new_tokens=4, do_sample=False), want)
    assert sum(s["tokens"] == 1 for s in ffn.hybrid.timeline) == 3  # every decode step timed
    ffn.hybrid.timeline = None
    assert isinstance(cm.decoder(), DeviceDecoder)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # its forward takes HF's older cache name
def test_an_architecture_it_does_not_reproduce_falls_back_with_a_reason():
    # Llama's modules, logits halved in its own forward
    dense, cm = _split("llama_relu", (0.5,), model_class=zoo.HalvedLogitsLlama)
    assert cm.decoder() is None and cm.decoder_reason
    ids = _ids(seed=7)
    assert torch.equal(cm.generate(ids, max_new_tokens=6, do_sample=False),
                       dense.generate(ids, max_new_tokens=6, do_sample=False))


@pytest.mark.parametrize("arch,name", [("phi", "Phi"), ("gpt_neox", "GPT-NeoX")])
def test_a_parallel_attention_and_ffn_split_across_a_device_decodes_per_module(arch, name):
    """Phi, GPT-NeoX: the C decoder runs them whole on the CPU; split across a device, the step
    (attention, then the FFN on its output) would compute another model: refused, the modules
    run it."""
    dense, cm = _split(arch, (0.5,))
    assert cm.decoder() is None and f"{name}'s parallel attention and FFN" in cm.decoder_reason
    ids = _ids(seed=3)
    assert torch.equal(cm.generate(ids, max_new_tokens=6, do_sample=False),
                       dense.generate(ids, max_new_tokens=6, do_sample=False))


def test_positions_outside_the_reserve_are_refused():
    _, cm = _split("llama_relu", (0.5,))
    dec = cm.decoder()
    dec.reserve(16)
    with pytest.raises(IndexError, match="outside the reserved"):
        dec.step(torch.tensor([1]), dec.max_len)


@pytest.mark.parametrize("mode", ["exact", "predicted"])
def test_its_own_prefill_of_a_long_prompt_then_sampling_equals_the_per_module_path(mode):
    """Prompts past the kernels' token limit take each side's batched path inside prefill; the
    decode steps then read the cache that prefill wrote."""
    _, cm = _split("llama_silu", (0.5,), mode=mode, seed=3)
    dec = cm.decoder()
    assert isinstance(dec, DeviceDecoder), cm.decoder_reason
    ids = _ids(n=21, seed=8)
    kw = dict(max_new_tokens=8, do_sample=True, temperature=0.8, top_k=20, seed=11)
    got = fast.generate(cm._orig_mod, ids, decoder=dec, **kw)
    assert torch.equal(got, fast.generate(cm._orig_mod, ids, **kw))
    assert torch.equal(cm.generate(ids, max_new_tokens=8, do_sample=False),
                       fast.generate(cm._orig_mod, ids, max_new_tokens=8))


def test_explain_names_the_decode_step():
    _, cm = _split("llama_relu", (0.5,))
    cm.decoder()
    text = picompile.explain(cm)
    assert ("decode step: picompile device decoder (runtime/device_decoder.py, 1 segment per "
            "token, 2 split blocks waited for on the device, eager: no CUDA graphs on cpu)"
            ) in text  # 2 layers, each handing off


def test_a_failing_device_decoder_falls_back_to_the_modules(monkeypatch):
    """An error inside a segment (here after the cold worker was armed) releases the worker,
    and the model runs its modules instead, saying why."""
    dense, cm = _split("llama_relu", (0.5,))

    def broken(self, i):
        raise RuntimeError("boom")

    monkeypatch.setattr(DeviceDecoder, "_ffn_begin", broken)
    assert cm.decoder() is None
    assert "the device decoder failed (RuntimeError: boom)" in cm.decoder_reason
    ids = _ids(seed=9)
    assert torch.equal(cm.generate(ids, max_new_tokens=6, do_sample=False),
                       dense.generate(ids, max_new_tokens=6, do_sample=False))


@pytest.mark.filterwarnings("ignore:picompile. no CUDA GPU found")
def test_float16_host_layers_run_in_c_over_their_16_bit_kv_cache():
    """A float16 model (as on a GPU): its host layer's C call reads and writes the float16 KV
    cache the device decoder's prefill filled; a step's logits the dense model's and the
    modules' path's (within float16's rounding: the C call keeps the stream in float32)."""
    dense = zoo.make("llama_relu", torch.float16, layers=3)
    cm, _ = zoo.last_layer_on_host(dense, max_context=64, quiet=True, mode="predicted",
                                   calibration=torch.randint(0, zoo.VOCAB, (4, 16)))
    cm.distribute("cpu")
    for f in cm.ffns().values():
        f.predictor.tau = float("-inf")
    dec = cm.decoder()
    ids = _ids(seed=3)
    cm.generate(ids, max_new_tokens=1, do_sample=False)  # the prompt's keys and values cached
    assert list(dec.host_runs) == [(2,)] and dec.k_cache[2].dtype == torch.float16
    with torch.no_grad():
        want = dense(torch.cat([ids, ids[:, :1]], 1)).logits[0, -1].float()
        token, pos = ids[0, :1], ids.shape[1]
        in_c = dec.step(token, pos).clone()[0]
        dec.host_runs = {}  # the modules' path, for comparison
        modules = dec.step(token, pos).clone()[0]
    scale = want.abs().max()
    assert (in_c - want).abs().max() <= 2e-2 * scale, ((in_c - want).abs().max(), scale)
    assert (in_c - modules).abs().max() <= 2e-2 * scale


@pytest.mark.filterwarnings("ignore:picompile. no CUDA GPU found")
@pytest.mark.parametrize("arch", ["llama_relu", "opt", "gemma2"])
def test_layers_the_budget_leaves_on_the_cpu_run_between_segments_as_dense(arch, tmp_path):
    """A budget that holds the parts outside the FFN blocks of all layers but the last: that
    layer runs wholly on the host, between the device's segments (the stand-in), and through
    hooks on the per-module path."""
    dense = zoo.make(arch, layers=3)
    cm, budget = zoo.last_layer_on_host(dense, max_context=64, quiet=True, mode="predicted",
                                        calibration=torch.randint(0, zoo.VOCAB, (4, 16)))
    placement = cm.plan.placement
    (last,) = placement.host_layers
    assert last.endswith("layers.2") and placement.fixed_on_gpu
    assert placement.gpu_bytes <= budget and sum(placement.fixed_bytes.values()) <= budget
    assert "wholly on the CPU" in picompile.explain(cm)
    cm.distribute("cpu")
    dec = cm.decoder()
    assert isinstance(dec, DeviceDecoder), cm.decoder_reason
    assert dec.on_host == [False, False, True] and "1 decoder layer on the CPU" in dec.describe()
    assert [host for _, _, host in dec.segments if host] == [[2]]
    host_ffn = list(cm.ffns().values())[2]
    assert host_ffn.hybrid is None and host_ffn.predictor.enabled
    assert host_ffn.kernel is not None  # its C kernel, bound on the CPU, and said so
    assert cm.paths[host_ffn.block.name] == "C, on the CPU with its decoder layer (placement)"
    for f in cm.ffns().values():
        f.predictor.tau = float("-inf")  # predict every neuron: must equal dense
    ids = _ids(seed=7)
    want = dense.generate(ids, max_new_tokens=8, do_sample=False)
    dec = cm.decoder()  # bound again to the thresholds just set
    dec.timeline = []
    cm.reset_stats()
    assert torch.equal(cm.generate(ids, max_new_tokens=8, do_sample=False), want)
    # the host layer ran through kernels/decoder.c, its block's statistics counted
    assert list(dec.host_runs) == [(2,)] and not dec.host_reason, dec.host_reason
    assert "(kernels/decoder.c)" in dec.describe()
    assert host_ffn.total_pairs >= 7 * host_ffn.n_ff and host_ffn.active_pairs > 0
    hosted = [s for s in dec.timings() if s["host_s"]]
    assert len(hosted) == 7  # one per decode step, on the segment the host layer follows
    assert all(dec.segments[s["segment"]][2] == [2] for s in hosted)
    dec.timeline = None
    cm.reset_stats()
    split = list(cm.ffns().values())[0]
    split.hybrid.timeline = []  # the per-module path: the host layer through its hooks
    assert cm.decoder() is None
    assert torch.equal(cm.generate(ids, max_new_tokens=8, do_sample=False), want)
    assert host_ffn.total_pairs > 0
    split.hybrid.timeline = None
    cm.save(tmp_path)
    loaded = picompile.load(copy.deepcopy(dense), tmp_path)
    assert loaded.plan.placement.host_layers == [last]
    if arch == "llama_relu":  # the report says which layers run on the CPU
        page = cm.report(tmp_path / "r.html", decode_tokens=2).read_text()
        assert f"the last 1 decoder layer ({last} on) runs wholly on the CPU" in page


def test_a_timeline_times_each_segment_and_split_block_of_each_step():
    dense, cm = _split("llama_relu", (0.5, 1.0), mode="predicted")
    dec = cm.decoder()
    assert isinstance(dec, DeviceDecoder), cm.decoder_reason
    ids = _ids(seed=8)
    want = cm.generate(ids, max_new_tokens=6, do_sample=False)
    dec.timeline = []
    assert torch.equal(cm.generate(ids, max_new_tokens=6, do_sample=False), want)
    entries = dec.timings()
    # per decode step after the prompt's token: layer 0's block (split), then the segment
    assert [(e["segment"], e["layer"]) for e in entries] == [(0, 0), (0, None)] * 5
    for block, segment in zip(entries[::2], entries[1::2]):
        assert 0 < block["device_s"] < block["wall_s"] < segment["wall_s"]
        assert block["cold_s"] > 0 and block["cold_wait_s"] >= 0
        # the block's wall runs from its input to its merged output: its cold part is in it
        assert block["wall_s"] >= block["cold_s"]

def test_a_wait_the_device_gave_up_on_stops_decoding_once():
    """The device's wait for a cold output that gave up (its pinned flag; set by hand here, as
    the GPU's kernel would after its timeout) fails the next step, says why, and is cleared:
    the decode after it runs."""
    dense, cm = _split("llama_relu", (0.5,))
    dec = cm.decoder()
    assert isinstance(dec, DeviceDecoder), cm.decoder_reason
    ids = _ids(seed=4)
    want = cm.generate(ids, max_new_tokens=4, do_sample=False)
    dec.gave_up.fill_(1)
    with pytest.raises(RuntimeError, match="stopped waiting for the CPU's cold rows"):
        cm.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(cm.generate(ids, max_new_tokens=4, do_sample=False), want)


def test_a_wait_that_gives_up_in_the_build_probe_falls_back_to_the_modules(monkeypatch):
    """A give-up in the probe step that checks a new device decoder (set when the device would
    set it, in its wait) is found there, not in the user's first generate: build falls back to
    the modules and says why."""
    dense, cm = _split("llama_relu", (0.5,))
    monkeypatch.setattr(DeviceDecoder, "_ffn_wait", lambda self, i: self.gave_up.fill_(1))
    dec, why = decoder_module.build(cm._orig_mod)
    assert dec is None and "stopped waiting for the CPU's cold rows" in why, why
