"""The hybrid executor with the CPU standing in for the GPU: every split, transfer and merge
runs; for any placement the compiled model still equals the dense one."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import picompile
from picompile.compiler import apply_order
from tests import zoo
from tests.test_compile import TOL


def _hybrid(dense, seed, hot_share=None, mode="exact"):
    kw = {}
    if mode == "predicted":
        kw = dict(mode="predicted", calibration=torch.randint(0, zoo.VOCAB, (6, 32)))
    cm = picompile.compile(copy.deepcopy(dense), quiet=True, **kw)
    gen = torch.Generator().manual_seed(seed)
    for ffn in cm.ffns().values():
        apply_order(ffn, torch.randperm(ffn.n_ff, generator=gen))
        share = float(torch.rand((), generator=gen)) if hot_share is None else hot_share
        ffn.block.decided.hot_neurons = int(round(share * ffn.n_ff))
        ffn.select_kernel()
    cm.distribute("cpu")
    return cm


@pytest.mark.parametrize("arch", ["llama_relu", "opt", "tiny_drelu", "tiny_plain_relu", "gemma"])
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 3), seq=st.integers(1, 20),
       hot=st.sampled_from([None, 0.0, 1.0]))
def test_hybrid_equals_dense_for_any_placement(arch, seed, batch, seq, hot):
    dense = zoo.make(arch, seed=seed)
    cm = _hybrid(dense, seed, hot)
    ids = torch.randint(0, zoo.VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(cm, ids), zoo.logits(dense, ids), **TOL[torch.float32])


def test_hybrid_generate_matches_dense_and_counts_both_sides():
    dense = zoo.make("llama_relu")
    cm = _hybrid(dense, 0, 0.4)
    ids = torch.randint(0, zoo.VOCAB, (1, 5))
    want = dense.generate(ids, max_new_tokens=10, do_sample=False)
    got = cm.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(got, want)
    ffn = next(iter(cm.ffns().values()))
    assert ffn.hybrid.hot.active_pairs > 0 and ffn.hybrid.cold.active_pairs > 0
    assert 0.2 < cm.sparsity() < 0.9
    assert "hybrid" in picompile.explain(cm)


def test_hybrid_predicted_equals_cpu_predicted():
    dense = zoo.make("llama_relu")
    cpu = _hybrid(dense, 3, 0.5, mode="predicted")
    ref = copy.deepcopy(cpu)
    for ffn in ref.ffns().values():
        ffn.hybrid = None  # the same plan, run on the CPU alone
    ids = torch.randint(0, zoo.VOCAB, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(cpu, ids), zoo.logits(ref, ids), **TOL[torch.float32])


@pytest.mark.parametrize("T", [1, 3, 8, 12])
def test_a_split_block_computes_the_union_of_a_few_tokens_predictions(T):
    """Calls of 2 to 8 tokens: the GPU's kernels compute the union of the tokens' predicted rows
    for each token, and the cold rows do the same, so a split block is one computation (the
    CPU-only kernel gives each token its own); one token, and prefills of more, per token."""
    cm = _hybrid(zoo.make("llama_relu"), 3, 0.5, mode="predicted")
    ref = copy.deepcopy(cm)
    gen = torch.Generator().manual_seed(T)
    for (name, ffn), ref_ffn in zip(cm.ffns().items(), ref.ffns().values()):
        ref_ffn.hybrid = None  # the same rows, on the CPU alone
        x = torch.randn(T, ffn.d_model, generator=gen)
        mask = torch.rand(T, ffn.n_ff, generator=gen) < 0.4
        union = mask.any(0, keepdim=True).expand(T, -1) if 1 < T <= 8 else mask
        with torch.no_grad():
            got, want, own = ffn(x, mask), ref_ffn(x, union), ref_ffn(x, mask)
        torch.testing.assert_close(got, want, **TOL[torch.float32])
        if 1 < T <= 8:  # the union computes more than each token's own
            assert not torch.allclose(want, own), name


def test_timeline_records_both_sides():
    cm = _hybrid(zoo.make("llama_relu"), 1, 0.5)
    ffn = next(iter(cm.ffns().values()))
    ffn.hybrid.timeline = []
    with torch.no_grad():
        cm(torch.randint(0, zoo.VOCAB, (1, 1)))
    (step,) = ffn.hybrid.timeline
    assert step["tokens"] == 1 and step["cold_s"] > 0 and step["hot_s"] > 0
    assert step["wall_s"] >= max(step["hot_s"], step["cold_s"]) * 0.5


def test_cuda_hot_kernel_takes_the_sparse_ffn_kernel_interface():
    """SparseFFN hands its kernel the predicted mask; the CUDA adapter turns it into the hot
    row list. Checked without a GPU through a stand-in for codegen.cuda.CudaFFN."""
    from picompile.runtime.hybrid import CudaHotKernel

    calls = []

    class StandInCudaFFN:
        def ffn_given_idx(self, x, idx):
            calls.append(idx)
            return torch.zeros_like(x), 0

        def ffn_given_mask(self, x, mask):
            calls.append(mask)
            return torch.zeros_like(x), 0

    cm = picompile.compile(zoo.make("tiny_gated_relu", n_ff=6), quiet=True)
    ffn = next(iter(cm.ffns().values()))
    kernel = CudaHotKernel.__new__(CudaHotKernel)  # no CUDA: skip building the real one
    kernel.ffn, kernel.all_rows = StandInCudaFFN(), torch.arange(6, dtype=torch.int32)
    ffn.kernel = kernel
    x = torch.randn(2, ffn.d_model)
    predicted = torch.tensor([[1, 0, 0, 1, 0, 0], [0, 0, 0, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(ffn(x, predicted), torch.zeros_like(x))
    ffn(x)
    assert torch.equal(calls[0], predicted) and torch.equal(calls[1], kernel.all_rows)


def test_distribute_copies_hot_rows_and_frees_none_on_the_device():
    """Hot rows are copies, not views of the full weights (a view keeps the whole storage on
    the device after the full weights move to the CPU)."""
    cm = _hybrid(zoo.make("llama_relu"), 0, 0.5)
    for ffn in cm.ffns().values():
        hot = ffn.hybrid.hot
        assert hot.w_up.untyped_storage().nbytes() == hot.w_up.numel() * hot.w_up.element_size()
        assert hot.w_up.untyped_storage().data_ptr() != ffn.w_up.untyped_storage().data_ptr()


def test_cold_rows_are_read_from_the_full_weights_on_the_host():
    """The host holds each cold row once: the cold part's weights are views of the full CPU
    weights (a copy doubled the host memory of a mostly-cold model), and stay right."""
    dense = zoo.make("llama_relu")
    cm = _hybrid(dense, 0, 0.3)
    for ffn in cm.ffns().values():
        cold, n_hot = ffn.hybrid.cold, ffn.hybrid.n_hot
        for name in ("w_gate", "w_up", "w_down_t"):
            full, part = getattr(ffn, name), getattr(cold, name)
            assert part.data_ptr() == full[n_hot:].data_ptr() and part.is_contiguous(), name
    ids = torch.randint(0, zoo.VOCAB, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(cm, ids), zoo.logits(dense, ids), **TOL[torch.float32])


def _cold_job(ffn, x, mask, out, ready, done):
    """A cold-worker job over all of `ffn`'s rows (its C kernel's pointers)."""
    from picompile.codegen import cold_worker
    from picompile.codegen.decoder import function_pointer

    k = ffn.kernel
    return cold_worker.Job(function_pointer(k.library.ffn), *k.pointers(), ffn.n_ff, ffn.d_model,
                           x.shape[0], ffn.threshold, x.data_ptr(),
                           None if mask is None else mask.data_ptr(), out.data_ptr(),
                           ready.data_ptr(), 1, done.data_ptr())


@pytest.mark.parametrize("arch", ["llama_relu", "opt"])
def test_cold_worker_runs_a_batch_in_order_each_job_after_its_ready(arch):
    """The worker takes a batch of jobs (a decode step's split blocks), runs each once its
    `ready` holds the batch's serial (on a GPU the device's copy puts it there; an earlier
    batch's value does not count), computes what the block's kernel computes on the calling
    thread, and sets each job's `done` to the serial as its output is written (what the device
    waits for)."""
    import threading
    import time

    from picompile.codegen import cold_worker
    from picompile.runtime.hybrid import last_cold_seconds, start_cold, wait_cold

    cm = picompile.compile(zoo.make(arch), quiet=True)  # 2 decoder layers
    ffns = list(cm.ffns().values())
    gen = torch.Generator().manual_seed(0)
    jobs, io, inputs = [], [], []  # inputs: alive while the worker reads them
    for ffn in ffns:
        x = torch.randn(3, ffn.d_model, generator=gen)
        mask = torch.rand(3, ffn.n_ff, generator=gen) < 0.5
        out = torch.full_like(x, float("nan"))
        ready, done = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        io.append((ffn.kernel(x, threshold=ffn.threshold, mask=mask), out, ready, done))
        jobs.append(_cold_job(ffn, x, mask, out, ready, done))
        inputs.append((x, mask))
    lib = cold_worker.load()
    serial = start_cold(jobs)
    assert serial > 0 and lib.pi_cold_start(jobs[0], 1, 5) == -1  # one batch at a time
    io[0][2].fill_(serial - 1)  # an earlier batch's flag, landing late: not this one's
    time.sleep(0.05)
    assert all(torch.isnan(out).all() for _, out, _, _ in io)  # nothing before `ready`
    (_, first), (_, second) = io[0][0], io[1][0]
    io[1][2].fill_(serial)  # the second block's input first: the worker still waits for the first
    time.sleep(0.05)
    assert torch.isnan(io[1][1]).all() and int(io[0][3]) == 0
    threading.Timer(0.05, lib.pi_set_flag, args=(io[0][2].data_ptr(), serial)).start()
    assert lib.pi_wait_value(io[1][3].data_ptr(), serial) == 0  # the last block is done
    assert wait_cold(2) == [first, second]
    for (want, _), out, _, done in io:
        torch.testing.assert_close(out, want)
        assert int(done) == serial
    waited, ran = last_cold_seconds(0)
    assert waited >= 0.1 and ran > 0 and last_cold_seconds(1)[1] > 0
    assert lib.pi_cold_wait(None) == -4  # nothing outstanding
    assert lib.pi_cold_start(jobs[0], 0, 1) == -5  # an empty batch
    assert start_cold(jobs[:1]) == serial + 1  # each batch its own serial
    io[0][2].fill_(serial + 1)
    assert wait_cold(1) == [first] and int(io[0][3]) == serial + 1


def test_an_error_mid_call_leaves_the_cold_worker_usable(monkeypatch):
    """An exception (Ctrl-C) after the worker was started, in the device decoder's step or in a
    block's per-module call, releases and waits for the worker: the next call runs."""
    from picompile.runtime.device_decoder import DeviceDecoder
    from picompile.runtime.hybrid import HybridFFN

    cm = _hybrid(zoo.make("llama_relu"), 2, 0.3, mode="predicted")
    ids = torch.randint(0, zoo.VOCAB, (1, 5))
    want = cm.generate(ids, max_new_tokens=4, do_sample=False)
    send = HybridFFN.send

    def interrupted(*args, **kwargs):
        monkeypatch.setattr(HybridFFN, "send", send)  # once
        raise KeyboardInterrupt

    assert isinstance(cm.decoder(), DeviceDecoder), cm.decoder_reason
    for path in ("device decoder", "per-module"):
        if path == "per-module":  # a block that times its hand-offs runs the modules' path
            next(iter(cm.ffns().values())).hybrid.timeline = []
            assert cm.decoder() is None
        monkeypatch.setattr(HybridFFN, "send", interrupted)
        with pytest.raises(KeyboardInterrupt):
            cm.generate(ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(cm.generate(ids, max_new_tokens=4, do_sample=False), want), path


def test_decode_runs_the_cold_part_on_the_worker():
    """One-token steps hand the cold rows to the worker (its job is built and it reports its
    wait); the result still equals the CPU-only block."""
    cm = _hybrid(zoo.make("llama_relu"), 2, 0.3, mode="predicted")
    ffn = next(iter(cm.ffns().values()))
    ffn.hybrid.timeline = []
    x = torch.randn(1, ffn.d_model)
    predicted = torch.rand(1, ffn.n_ff) < 0.6
    with torch.no_grad():
        got = ffn.hybrid(x, predicted)
    assert ffn.hybrid._staging is not None and ffn.hybrid._staging.job is not None
    assert "cold_wait_s" in ffn.hybrid.timeline[0]
    hybrid, ffn.hybrid = ffn.hybrid, None
    want = ffn(x, predicted)
    ffn.hybrid = hybrid
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_quantized_blocks_split_across_a_gpu_with_q8_0_down_rows(monkeypatch):
    """A quantized block's hot rows go to the CUDA kernels as the CPU holds them (uint8 blocks,
    4-bit gate / up rows in the dot layout) with their formats; blocks whose down rows the GPU
    kernels do not read (float, 4-bit) are refused before anything moves. Checked without a GPU
    through a stand-in for codegen.cuda.CudaFFN."""
    from picompile.codegen import cuda
    from picompile.runtime import hybrid

    seen = {}

    class StandInCudaFFN:
        def __init__(self, w_up, w_down_t, **kw):
            seen.update(kw, w_up=w_up, w_down_t=w_down_t)

    monkeypatch.setattr(cuda, "CudaFFN", StandInCudaFFN)
    cm = picompile.compile(zoo.make("llama_relu"), quiet=True)
    ffn = next(iter(cm.ffns().values()))
    ffn.quantize_("q4_1", "q8_0")
    hybrid._check_quantized(ffn, torch.device("cuda"))  # accepted
    view = hybrid._view(ffn, slice(0, 5), "cpu", with_down_bias=True, share=False)
    hybrid.CudaHotKernel(view)
    assert seen["qformat"] == "q4_1" and seen["down_qformat"] == "q8_0"
    assert torch.equal(seen["w_up"], ffn.w_up[:5]) and seen["w_up"].dtype == torch.uint8
    assert torch.equal(seen["w_gate"], ffn.w_gate[:5]) and torch.equal(seen["w_down_t"], ffn.w_down_t[:5])
    for down in ("float32", "q4_1"):
        ffn.quantize_("q4_1", down)
        with pytest.raises(ValueError, match="q8_0 down rows"):
            hybrid._check_quantized(ffn, torch.device("cuda"))
        hybrid._check_quantized(ffn, torch.device("cpu"))  # the CPU stand-in takes any


@pytest.mark.parametrize("change", ["swap", "in place"])
def test_weights_changed_after_the_split_are_split_again(change):
    """The device holds copies of the hot rows: a block whose weights change after distribute
    (storage swapped, or written in place) is split again, on the per-module path and through
    the device decoder, and computes with the new weights."""
    dense = zoo.make("llama_relu")
    cm = _hybrid(dense, 0, 0.5)
    ids = torch.randint(0, zoo.VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    cm.generate(ids, **kw)  # builds the device decoder over the first split
    ffn = cm.ffns()["model.layers.0.mlp.sparse_ffn"]
    before = ffn.hybrid
    with torch.no_grad():
        if change == "swap":
            ffn.w_down_t.data = ffn.w_down_t.data * 3
        else:
            ffn.w_down_t.mul_(3)
        down = dense.model.layers[0].mlp.down_proj.weight
        down.data = down.data * 3
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(cm, ids), zoo.logits(dense, ids), **TOL[torch.float32])
    assert ffn.hybrid is not before
    assert torch.equal(cm.generate(ids, **kw), dense.generate(ids, **kw))


def test_a_refused_dtype_change_leaves_the_split_model_as_it_was():
    cm = _hybrid(zoo.make("llama_relu"), 0, 0.5)
    with pytest.raises(RuntimeError, match="cannot change afterwards"):
        cm.half()
    assert {p.dtype for p in cm.parameters()} == {torch.float32}
