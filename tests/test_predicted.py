"""Predicted mode, placement in compile, and saved plans."""

from __future__ import annotations

import copy
import json
import pathlib
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import picompile
from picompile import saving
from picompile.compiler import _attach_predictor, apply_order
from picompile.runtime.sparse_ffn import SparseFFN, down_input
from tests import zoo
from tests.test_compile import TOL


class OraclePredictor(nn.Module):
    """Predicts exactly the neurons that fire: the true mask."""

    def __init__(self, ffn: SparseFFN):
        super().__init__()
        self.ffn = [ffn]  # a list, so it is not registered as a submodule (no cycle)

    def forward(self, x):
        f = self.ffn[0]
        h = down_input(x.reshape(-1, f.d_model), f.w_up, w_gate=f.w_gate, b_gate=f.b_gate,
                       b_up=f.b_up, act=f.act, drelu=f.drelu)
        return h.abs() > f.threshold


@pytest.mark.parametrize("arch", ["llama_relu", "opt", "tiny_drelu", "tiny_plain_relu"])
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 3), seq=st.integers(1, 12))
def test_any_placement_with_the_oracle_predictor_equals_dense(arch, seed, batch, seq):
    dense = zoo.make(arch, seed=seed)
    cm = picompile.compile(copy.deepcopy(dense), quiet=True)
    gen = torch.Generator().manual_seed(seed)
    for ffn in cm.ffns().values():
        apply_order(ffn, torch.randperm(ffn.n_ff, generator=gen))  # any hot-first order
        ffn.block.decided.hot_neurons = int(torch.randint(0, ffn.n_ff + 1, (), generator=gen))
        _attach_predictor(cm.graphs, ffn, OraclePredictor(ffn))
        ffn.select_kernel()  # weights moved: bind the kernel again
    ids = torch.randint(0, zoo.VOCAB, (batch, seq), generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(cm, ids), zoo.logits(dense, ids), **TOL[torch.float32])
    assert "predictor" in next(iter(cm.graphs.values())).code


def _calibration(n=8, seq=48, seed=0):
    return torch.randint(0, zoo.VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))


def test_predicted_mode_with_recall_one_equals_exact_mode():
    dense = zoo.make("llama_relu")
    exact = picompile.compile(copy.deepcopy(dense), quiet=True)
    pred = picompile.compile(copy.deepcopy(dense), mode="predicted", calibration=_calibration(),
                             predictors="all", quiet=True)
    for ffn in pred.ffns().values():
        assert ffn.predictor.enabled
        ffn.predictor.tau = float("-inf")  # every neuron predicted: recall 1.0
    ids = torch.randint(0, zoo.VOCAB, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(pred, ids), zoo.logits(exact, ids), **TOL[torch.float32])


def test_predicted_mode_reports_predictors():
    pred = picompile.compile(zoo.make("llama_silu"), mode="predicted", sparsity=0.5,
                             calibration=_calibration(), quiet=True)
    from picompile.passes.predictors import kernel_bytes

    for b in pred.plan.blocks:  # the bytes decode reads (float16 matrices), as B/token counts
        assert b.measured.predictor_bytes == kernel_bytes(b.decided.predictor_rank, b.d_model, b.d_ff)
        assert b.measured.predictor_recall >= 0.98  # calibrated for 0.99 on held-out samples
        assert 0.4 < b.measured.true_density < 0.6  # thresholded at 50%: the predictor's target
        assert b.measured.predicted_density >= b.measured.true_density * 0.9
    report = picompile.explain(pred)
    assert "rank" in report and "recall" in report and "pred/true density" in report
    code = pred.graphs["model.layers.0.mlp"].code
    assert "self.sparse_ffn.predictor(x)" in code


def test_predictors_run_only_where_they_make_decode_faster():
    """predictors="auto": a block runs its predictor iff compile timed it faster with it; a
    block that does not runs exact (and equals exact mode)."""
    dense = zoo.make("llama_relu")
    auto = picompile.compile(copy.deepcopy(dense), mode="predicted", calibration=_calibration(),
                             quiet=True)
    exact = picompile.compile(copy.deepcopy(dense), quiet=True)
    for ffn in auto.ffns().values():
        b = ffn.block
        assert b.measured.decode_bytes_exact > 0 and b.measured.decode_bytes_predicted > 0
        assert b.measured.decode_us_exact > 0 and b.measured.decode_us_predicted > 0
        assert ffn.predictor.enabled == (b.measured.decode_us_predicted < b.measured.decode_us_exact)
        b.measured.decode_us_predicted = b.measured.decode_us_exact + 1  # slower: off
    auto.use_predictors("auto")
    ids = torch.randint(0, zoo.VOCAB, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(auto, ids), zoo.logits(exact, ids), **TOL[torch.float32])
    report = picompile.explain(auto)
    assert "B/token exact->pred" in report and "us exact->pred" in report and " no" in report
    first, *rest = auto.ffns().values()
    first.block.measured.decode_us_predicted = first.block.measured.decode_us_exact - 1e-3  # faster: on
    auto.use_predictors("auto")
    assert first.predictor.enabled and not any(f.predictor.enabled for f in rest)
    auto.use_predictors("all")
    assert all(f.predictor.enabled for f in auto.ffns().values())
    auto.use_predictors("none")  # trained and kept, none runs: exact mode again
    assert not any(f.predictor.enabled for f in auto.ffns().values())
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(auto, ids), zoo.logits(exact, ids), **TOL[torch.float32])
    with pytest.raises(ValueError, match="predictors="):
        picompile.compile(copy.deepcopy(dense), mode="predicted", calibration=_calibration(),
                          predictors="some")


def test_time_decode_calls_blocks_in_model_order_token_by_token():
    """Each token runs through every block in order, exact and predicted in turn (each first
    every other round), as decode would; the predictors' switches are left as they were."""
    from picompile.passes.autotune import time_decode

    calls = []

    class Pred:
        def __init__(self):
            self.enabled = True

        def __call__(self, x):
            return torch.ones(1, 3, dtype=torch.bool) if self.enabled else None

    class Block:
        def __init__(self, name):
            self.name, self.w_up, self.predictor = name, torch.zeros(3, 2), Pred()

        def __call__(self, x, mask):
            calls.append((self.name, int(x[0, 0]), mask is not None))

        def reset_stats(self):
            calls.append((self.name, "reset"))

    blocks = [Block("a"), Block("b")]
    blocks[1].predictor.enabled = False
    xs = [torch.arange(3.0)[:, None].expand(3, 2), torch.arange(5.0)[:, None].expand(5, 2)]
    timed = time_decode(blocks, xs, rounds=2, quiet=True)
    assert len(timed) == 2 and all(e > 0 and p > 0 for e, p in timed)
    first_round = [(n, t, p) for t in range(3) for p in (False, True) for n in "ab"]
    second_round = [(n, t, p) for t in range(3) for p in (True, False) for n in "ab"]
    assert calls[:-2] == first_round + second_round  # 3 tokens: the shorter sample list
    assert sorted(calls[-2:]) == [("a", "reset"), ("b", "reset")]
    assert blocks[0].predictor.enabled and not blocks[1].predictor.enabled
    assert time_decode(blocks, [xs[0][:0], xs[1]], quiet=True) == [(0.0, 0.0)] * 2


def test_timing_samples_spread_over_positions():
    """The profile holds calibration rows in order; the timing inputs must not all sit at one
    position of every row (as a stride of 1024 over 256-token rows would, all at position 0)."""
    from picompile.passes.autotune import timing_samples

    x = torch.arange(128 * 256, dtype=torch.float32)[:, None]  # [N, 1]: the token's place
    picked = timing_samples(x, 32)[:, 0].long()
    assert picked.shape == (32,) and len(set(picked.tolist())) == 32
    assert len(set((picked % 256).tolist())) > 16  # many positions within the rows
    assert torch.equal(picked, timing_samples(x, 32)[:, 0].long())  # seeded
    assert torch.equal(picked, picked.sort().values)  # in profile order
    assert timing_samples(x[:5], 32).shape == (5, 1)


def test_decode_bytes_counts_the_rows_the_kernel_reads():
    from picompile.passes.predictors import PredictorStats, decode_bytes, kernel_bytes

    d, n_ff = 100, 400
    row = d * 4  # float32
    stats = PredictorStats(rank=8, recall=1.0, predicted_density=0.25, true_density=0.2, nbytes=0)
    pred = kernel_bytes(8, d, n_ff)
    assert pred == 8 * (d + n_ff) * 2 + (8 + n_ff) * 4  # float16 matrices, float32 biases
    relu = picompile.compile(zoo.make("tiny_plain_relu", d=d, n_ff=n_ff), quiet=True)
    plain = next(iter(relu.ffns().values()))
    # plain: every candidate's up row, then the down rows of the firing neurons
    assert decode_bytes(plain, stats) == (round(n_ff * (1 + 0.2) * row),
                                          round(pred + n_ff * (0.25 + 0.2) * row))
    gated = next(iter(picompile.compile(zoo.make("llama_relu"), quiet=True).ffns().values()))
    row, n = gated.d_model * 4, gated.n_ff
    pred = kernel_bytes(8, gated.d_model, n)
    # gated ReLU: the gate row of each candidate, up and down rows only where the gate fired
    assert decode_bytes(gated, stats) == (round(n * (1 + 0.4) * row), round(pred + n * (0.25 + 0.4) * row))
    gated.act = "silu"  # SiLU never gives exact zeros: gate and up for every candidate
    assert decode_bytes(gated, stats) == (round(n * (2 + 0.2) * row), round(pred + n * (0.5 + 0.2) * row))


def test_predicted_mode_needs_calibration():
    with pytest.raises(ValueError, match="calibration"):
        picompile.compile(zoo.make("llama_relu"), mode="predicted")


@pytest.mark.parametrize("budget", [0, 20_000, 60_000, "1GB"])
def test_compile_places_within_the_budget(budget):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cm = picompile.compile(zoo.make("llama_relu", n_ff=256), gpu_budget=budget,
                               calibration=_calibration(), quiet=True)
    placement = cm.plan.placement
    assert placement.budget_bytes == picompile.budget.parse_budget(budget)
    assert placement.gpu_bytes <= placement.budget_bytes
    hot = [b.decided.hot_neurons for b in cm.plan.blocks]
    if budget == "1GB":
        assert hot == [256, 256] and placement.fixed_on_gpu
    if budget == 0:
        assert hot == [0, 0] and not placement.fixed_on_gpu
    if not torch.cuda.is_available():
        assert any("no CUDA GPU" in str(w.message) for w in caught)
    assert "placement: budget" in picompile.explain(cm)


def test_hot_first_order_keeps_outputs():
    dense = zoo.make("llama_relu", n_ff=256)
    cm = picompile.compile(copy.deepcopy(dense), gpu_budget=40_000, calibration=_calibration(),
                           quiet=True)
    for ffn in cm.ffns().values():
        assert ffn.order is not None and sorted(ffn.order.tolist()) == list(range(256))
    ids = torch.randint(0, zoo.VOCAB, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(cm, ids), zoo.logits(dense, ids), **TOL[torch.float32])


# -- saved plans ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    dense = zoo.make("llama_silu", n_ff=128)
    cm = picompile.compile(copy.deepcopy(dense), mode="predicted", sparsity=0.5,
                           gpu_budget="30KB", calibration=_calibration(), predictors="all",
                           quiet=True)
    path = tmp_path_factory.mktemp("plans") / "plan"
    cm.save(path)
    return dense, cm, path


def test_load_rebuilds_the_same_model_without_profiling(saved, monkeypatch):
    dense, cm, path = saved
    from picompile.passes import profile as profile_pass

    monkeypatch.setattr(profile_pass, "profile", lambda *a, **k: pytest.fail("load profiled"))
    loaded = picompile.load(copy.deepcopy(dense), path)
    assert loaded.plan.to_json() == cm.plan.to_json()
    assert all(f.predictor.enabled for f in loaded.ffns().values())  # predictors="all" kept
    ids = torch.randint(0, zoo.VOCAB, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(loaded, ids), zoo.logits(cm, ids), atol=0, rtol=0)


def test_load_refuses_another_model(saved):
    dense, _, path = saved
    with pytest.raises(saving.PlanError, match="different model"):
        picompile.load(zoo.make("llama_silu", n_ff=128, seed=7), path)
    # the same model in another dtype: the error says the plan's (and how to convert)
    with pytest.raises(saving.PlanError, match=r"different model.*, in float32 \(--dtype "
                                               r"float32 .*model.to\(torch.float32\)\)"):
        picompile.load(copy.deepcopy(dense).to(torch.bfloat16), path)


@pytest.mark.parametrize("damage", ["flip", "truncate", "version", "no_manifest", "bad_json"])
def test_load_refuses_damaged_plans(saved, tmp_path, damage):
    dense, _, path = saved
    copy_dir = tmp_path / "plan"
    import shutil

    shutil.copytree(path, copy_dir)
    tensors = copy_dir / "tensors.safetensors"
    manifest = copy_dir / "manifest.json"
    if damage == "flip":
        data = bytearray(tensors.read_bytes())
        data[-3] ^= 0xFF
        tensors.write_bytes(bytes(data))
        match = "checksum"
    elif damage == "truncate":
        tensors.write_bytes(tensors.read_bytes()[:100])
        match = "checksum"
    elif damage == "version":
        m = json.loads(manifest.read_text())
        m["version"] = 99
        manifest.write_text(json.dumps(m))
        match = "version"
    elif damage == "no_manifest":
        manifest.unlink()
        match = "manifest"
    else:
        manifest.write_text("{not json")
        match = "corrupt"
    with pytest.raises(saving.PlanError, match=match):
        picompile.load(copy.deepcopy(dense), copy_dir)


def test_save_is_atomic(saved, tmp_path, monkeypatch):
    _, cm, path = saved
    target = tmp_path / "plan"
    cm.save(target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(saving, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        cm.save(target)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["plan"]  # no temporary left behind
    assert not list(pathlib.Path(target).glob("*.pkl"))


@settings(max_examples=15, deadline=None)
@given(rank=st.integers(1, 6), d=st.integers(8, 40), n_ff=st.integers(8, 80), bias=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_low_rank_first_projection_predicts_its_sign(rank, d, n_ff, bias, seed):
    """A first projection W of rank r: LowRankFirst's rank-r predictor computes W x + b itself
    (its ReLU kept off by the offset; float16 storage of p1 / p2 the only error)."""
    from picompile.passes.predictors import LowRankFirst

    gen = torch.Generator().manual_seed(seed)
    rank = min(rank, d, n_ff)
    w = torch.randn(n_ff, rank, generator=gen) @ torch.randn(rank, d, generator=gen)  # [n_ff, d]
    b = torch.randn(n_ff, generator=gen) if bias else None
    x = torch.randn(200, d, generator=gen) * (1 + 3 * torch.rand(d, generator=gen))  # uneven scales
    pred = LowRankFirst(w, b, x).predictor(rank)
    assert pred.rank == rank
    want = x @ w.T + (0 if b is None else b)
    got = pred.logits(x)
    scale = (x.abs() @ w.abs().T + (0 if b is None else b.abs())).amax()
    assert (got - want).abs().max() <= 3e-3 * scale


def test_relu_predictors_try_the_low_rank_first_projection():
    """Held-out predicted density with the first projection offered is never above the
    randomly initialised predictor's (the same one is among the candidates), and on a block
    whose gate is nearly low-rank it is far below it: few samples do not train a predictor
    from random weights, while the truncated SVD sees the structure in the weights."""
    from picompile.passes.predictors import first_projection, train_predictor
    from picompile.passes.profile import BlockProfile

    gen = torch.Generator().manual_seed(0)
    d, n_ff, r = 256, 1024, 16
    w = torch.randn(n_ff, r, generator=gen) @ torch.randn(r, d, generator=gen) / d**0.5
    w += 0.01 * torch.randn(n_ff, d, generator=gen)
    b = -1.3 * w.norm(dim=1)  # about 10% firing on unit-normal inputs
    x = torch.randn(400, d, generator=gen)
    y = x @ w.T + b > 0
    prof = BlockProfile(y.float().mean(0), x.half(), y, len(x))
    _, plain = train_predictor(prof, seed=1)
    _, low = train_predictor(prof, seed=1, first=(w, b))
    assert low.predicted_density <= plain.predicted_density + 1e-9
    assert low.recall >= 0.99 and low.predicted_density < 1.3 * low.true_density < plain.predicted_density
    ffn = next(iter(picompile.compile(zoo.make("llama_relu"), quiet=True).ffns().values()))
    assert first_projection(ffn)[0] is ffn.w_gate
    ffn.act = "silu"
    assert first_projection(ffn) is None


def test_a_neuron_that_adds_most_of_the_output_is_always_predicted():
    """A neuron whose down row dwarfs the others' (a "massive activation", as in SmolLM2's
    layer 2) is predicted for every input, whatever the predictor learnt: missing it once
    would wreck the block's output at any recall. Few other neurons are forced."""
    from picompile.passes.predictors import critical_neurons

    dense = zoo.make("llama_silu")
    j = 5
    with torch.no_grad():
        dense.model.layers[0].mlp.down_proj.weight[:, j] *= 300
    cm = picompile.compile(dense, mode="predicted", sparsity=0.5, calibration=_calibration(),
                           predictors="all", quiet=True)
    ffns = list(cm.ffns().values())
    first = ffns[0]
    at = j if first.order is None else int((first.order == j).nonzero())  # hot-first order
    x = torch.randn(64, first.d_model, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert bool(first.predictor(x)[:, at].all())
    forced = [int((f.predictor.pb2 >= 1e4).sum()) for f in ffns]
    assert forced[0] >= 1 and sum(forced) <= 0.05 * sum(f.n_ff for f in ffns), forced
    assert at in critical_neurons(first, x).tolist()
