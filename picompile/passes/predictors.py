"""Predictors: per block, a low-rank MLP d -> r -> n_ff (PowerInfer's and DejaVu's form) that
guesses from the block input which neurons will fire, so gate, up and down are computed only
for those.

Trained on the profile's (input, active mask) samples with binary cross-entropy. Its decision
threshold `tau` is then set on held-out samples so that the target share of firing neurons is
caught (recall, default 0.99); the rank is the smallest of RANKS whose predicted density is at
most `max_density_ratio` times the true density at that recall. The search stops early when a
larger rank stops helping (SiLU blocks of SmolLM2 predict ~95% of neurons at recall 0.99 at any
rank: their activity is far less predictable than ReLU's), keeping the best rank tried.

Recall counts neurons, not what they add: a few neurons of some blocks add a large share of
the output on some tokens (the "massive activations" of early layers: one SmolLM2 neuron adds
more than half of layer 2's output on some tokens), and a predictor that misses one there wrecks
the output at 99% recall. `critical_neurons` finds them on the calibration samples and the
predictor always picks them (Predictor.always; BENCHMARKS.md session 19).

A predictor only pays where the gate rows it lets the block skip cost more than the predictor
itself: `decode_bytes` counts both, `passes/autotune.py` measures both (what decides
`predictors="auto"`, since fixed costs per call dominate small blocks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from picompile.activations import zero_below
from picompile.passes.profile import BlockProfile
from picompile.progress import progress_bar
from picompile.runtime.predictor import Predictor
from picompile.runtime.sparse_ffn import down_input

RANKS = (16, 32, 64, 128, 256, 512)
# Training steps per predictor are capped so that steps * n_ff stays under this: 2000 steps for
# n_ff = 640, 830 for SmolLM2's 1536. Bounds compile time on large models.
STEP_BUDGET = 2000 * 640
# On a GPU a step costs far less: 8x the budget, and at least MIN_GPU_STEPS where the samples
# are few (a 13B model's 2 GB of samples is ~1,600 tokens per block: 40 steps by epochs alone).
GPU_STEP_BUDGET = 8 * STEP_BUDGET
MIN_GPU_STEPS = 300
MIN_GAIN = 0.02  # a rank that lowers the predicted density by less than this ends the search
# tau is set on held-out samples for a miss rate this much under the target's: text unlike the
# calibration data (measured on the ReLU fixture's held-out split) misses a little more.
MISS_MARGIN = 0.8
# critical_neurons: a neuron is always computed if on some calibration token it adds more than
# this times the block's median output norm (massive activations stand far above it; ordinary
# neurons of a sparse ReLU block reach a few times it: BENCHMARKS.md session 19)
CRITICAL_SHARE = 4.0
CRITICAL_ROWS = 4096  # samples per chunk while measuring (bounds the [rows, n_ff] temporaries)


def kernel_bytes(rank: int, d: int, n_ff: int) -> int:
    """Bytes the C predictor kernel reads per call: float16 matrices, float32 biases."""
    return rank * (d + n_ff) * 2 + (rank + n_ff) * 4


@dataclass
class PredictorStats:
    rank: int
    recall: float  # share of firing neurons predicted, on held-out samples
    predicted_density: float  # share of neurons predicted to fire
    true_density: float  # share that really fire
    nbytes: int  # the predictor's bytes as its kernels read them (float16 matrices)


def _fit(x: torch.Tensor, y: torch.Tensor, rank: int, epochs: int, seed: int,
         init: Predictor | None = None) -> Predictor:
    """x [N, d] float32, y [N, n_ff] float32 -> a trained predictor (tau unset), on x's device;
    from random weights, or from `init`'s (of that rank) when given.

    Trained where the samples are (a GPU when profiling ran on one: much faster for large
    n_ff). Random numbers come from a CPU generator on any device (weights initialised on the
    CPU, batch indices drawn there and moved), so a CPU run gives the same result whether or
    not a GPU is there."""
    gen = torch.Generator().manual_seed(seed)
    n, d = x.shape
    n_ff = y.shape[1]
    l1, l2 = nn.Linear(d, rank), nn.Linear(rank, n_ff)
    for layer in (l1, l2):
        bound = 1 / layer.in_features**0.5
        layer.weight.data.uniform_(-bound, bound, generator=gen)
        layer.bias.data.zero_()
    l1, l2 = l1.to(x.device), l2.to(x.device)
    if init is not None:
        for layer, (w, b) in ((l1, (init.p1, init.pb1)), (l2, (init.p2, init.pb2))):
            layer.weight.data.copy_(w)
            layer.bias.data.copy_(b)
    else:  # start from the marginal firing rate, so early steps need not learn it
        rate = y.mean(0).clamp(1e-4, 1 - 1e-4)
        l2.bias.data.copy_(torch.log(rate / (1 - rate)))
    params = [*l1.parameters(), *l2.parameters()]
    batch = min(1024, n)
    if x.is_cuda:
        steps = min(GPU_STEP_BUDGET // max(n_ff, 1), max(epochs * (n // batch), MIN_GPU_STEPS))
    else:
        steps = max(1, min(epochs * (n // batch), STEP_BUDGET // max(n_ff, 1)))
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    with torch.enable_grad():
        for step in range(steps):
            sel = torch.randint(n, (batch,), generator=gen).to(x.device)  # [batch]
            loss = F.binary_cross_entropy_with_logits(l2(F.relu(l1(x[sel]))), y[sel])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    return Predictor(l1.weight.detach().clone(), l1.bias.detach().clone(),
                     l2.weight.detach().clone(), l2.bias.detach().clone())


class LowRankFirst:
    """Rank-r approximations of a block's first projection (the gate, or up where there is no
    gate): W [n_ff, d], b [n_ff] or None, float32. A ReLU block's neuron fires where
    w_j . x + b_j > 0, so W_r x + b is a predictor by itself, and a far better start than random
    weights: trained from random weights on a few hundred samples, a predictor can miss the
    structure a truncated SVD sees directly in the weights.

    W_r is best where the inputs are: it minimizes E ||(W - W_r) x||^2 over the samples x
    [N, d] (the SVD of W L, Sigma = L L^T their second moment, regularized since N may be
    below d). One decomposition serves every rank up to the one it was computed for."""

    RIDGE = 1e-2  # Sigma + RIDGE * mean(diag Sigma) * I

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, x: torch.Tensor):
        self.w = w.detach().float().to(x.device)
        self.b = None if b is None else b.detach().float().to(x.device)
        self.x = x
        sigma = x.T @ x / len(x)  # [d, d]
        sigma += (self.RIDGE * float(sigma.diagonal().mean()) + 1e-12) * torch.eye(
            sigma.shape[0], device=x.device)
        self.L = torch.linalg.cholesky(sigma)  # [d, d] lower
        self._svd: tuple | None = None  # U [n_ff, q], S [q], V [d, q]

    @torch.no_grad()
    def predictor(self, rank: int, seed: int = 0) -> Predictor:
        """logits = W_r x + b as a Predictor: p1 = V^T L^-1 [r, d], p2 = U S [n_ff, r]. The ReLU
        between them is kept off by an offset pb1 twice the largest |p1 x| on the samples (the
        hidden units stay positive: the map is linear), taken back out in pb2. Rows of p1 and
        columns of p2 are scaled to equal norms, for their float16 storage."""
        if self._svd is None or self._svd[1].numel() < rank:
            q = min(max(2 * rank, rank + 8), *self.w.shape)
            devices = [self.w.device] if self.w.is_cuda else []
            with torch.random.fork_rng(devices=devices):  # the caller's random state is kept
                torch.manual_seed(seed)  # svd_lowrank's random projection
                self._svd = torch.svd_lowrank(self.w @ self.L, q=q, niter=2)
        U, S, V = (t[..., :rank] for t in self._svd)
        p1 = torch.linalg.solve_triangular(self.L.T, V, upper=True).T  # [r, d]
        p2 = U * S  # [n_ff, r]
        scale = (p2.norm(dim=0) / p1.norm(dim=1).clamp_min(1e-30)).sqrt().clamp_min(1e-30)  # [r]
        p1, p2 = p1 * scale[:, None], p2 / scale
        offset = 2 * (self.x @ p1.T).abs().amax(0) + 1e-6  # [r]
        pb2 = (self.b if self.b is not None else torch.zeros(len(p2), device=p2.device)) - p2 @ offset
        return Predictor(p1, offset, p2, pb2)


@torch.no_grad()
def calibrate_tau(pred: Predictor, x: torch.Tensor, y: torch.Tensor, target_recall: float
                  ) -> PredictorStats:
    """Set pred.tau so that `target_recall` of the firing (x [N, d], neuron) pairs (y [N, n_ff]
    bool) are predicted. Runs on the samples' device: pred is moved there (in place)."""
    logits = pred.to(x.device).logits(x)  # [N, n_ff]
    pos = logits[y]
    if pos.numel() == 0:
        pred.tau = float(logits.max()) if logits.numel() else 0.0
    else:
        k = max(1, int((1 - target_recall) * pos.numel()))  # this many may be missed
        pred.tau = float(pos.kthvalue(k).values) - 1e-6
    predicted = logits > pred.tau
    recall = float((predicted & y).sum() / max(int(y.sum()), 1))
    nbytes = kernel_bytes(pred.rank, x.shape[1], logits.shape[1])  # what decode reads
    return PredictorStats(pred.rank, recall, float(predicted.float().mean()),
                          float(y.float().mean()), nbytes)


@torch.no_grad()
def critical_neurons(ffn, x: torch.Tensor, share: float = CRITICAL_SHARE) -> torch.Tensor:
    """Neurons of `ffn` (float weights) that on some sample of x [N, d] add more than `share`
    times the median sample's output norm: |h_i| * |down row i| against |out|, with h and out as
    the block computes them (only the neurons over its threshold). -> LongTensor [k]."""
    w_up, w_down = ffn.w_up.float(), ffn.w_down_t.float()  # [n_ff, d]
    w_gate = None if ffn.w_gate is None else ffn.w_gate.float()
    down_norm = w_down.norm(dim=1)  # [n_ff]
    peak = torch.zeros(ffn.n_ff, device=w_down.device)  # largest |h_i| * |down_i| seen
    out_norms = []
    for r0 in range(0, len(x), CRITICAL_ROWS):
        xc = x[r0 : r0 + CRITICAL_ROWS].to(device=w_down.device, dtype=torch.float32)
        h = down_input(xc, w_up, w_gate=w_gate, b_gate=ffn.b_gate, b_up=ffn.b_up, act=ffn.act,
                       drelu=ffn.drelu, compute_dtype=torch.float32)  # [rows, n_ff]
        h = torch.where(h.abs() > ffn.threshold, h, torch.zeros((), device=h.device))
        peak = torch.maximum(peak, h.abs().amax(0) * down_norm)
        out_norms.append((h @ w_down).norm(dim=1))  # [rows]
    typical = torch.cat(out_norms).median()
    return (peak > share * typical).nonzero().flatten().cpu()


def train_predictor(
    prof: BlockProfile,
    target_recall: float = 0.99,
    max_density_ratio: float = 1.3,
    epochs: int = 40,
    seed: int = 0,
    first: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    always: torch.Tensor | None = None,
) -> tuple[Predictor, PredictorStats]:
    """Smallest rank meeting the density target at `target_recall`, on held-out samples.
    Trains on the device of the profile's samples; the predictor returned is on the CPU
    (compile places it later). `always`: neurons every predictor tried picks (critical_neurons),
    counted in its statistics.

    `first`: the block's first projection (W [n_ff, d], b [n_ff] or None) for ReLU blocks. Then
    each rank also tries W's low-rank approximation as the predictor (LowRankFirst), alone and
    as the start of training, and keeps whichever of the three predicts fewest neurons on
    held-out samples."""
    x, y = prof.x.float(), prof.y  # [N, d] float32, [N, n_ff] bool
    n_val = max(1, len(x) // 10)
    xt, yt, xv, yv = x[n_val:], y[n_val:].float(), x[:n_val], y[:n_val]
    if len(xt) == 0:
        xt, yt = xv, yv.float()
    d, n_ff = x.shape[1], y.shape[1]
    ranks = [r for r in RANKS if r < min(d, n_ff)] or [max(1, min(d, n_ff) // 2)]
    low_rank = None if first is None else LowRankFirst(*first, xt)
    recall = 1 - (1 - target_recall) * MISS_MARGIN
    best = None
    for rank in ranks:
        start = None if low_rank is None else low_rank.predictor(rank, seed)
        tried = [_fit(xt, yt, rank, epochs, seed)]
        if start is not None:
            tried += [start, _fit(xt, yt, rank, epochs, seed, init=start)]
        if always is not None and len(always):
            for p in tried:
                p.always(always)
        pred, stats = min(((p, calibrate_tau(p, xv, yv, recall)) for p in tried),
                          key=lambda ps: ps[1].predicted_density)
        if stats.predicted_density <= max_density_ratio * max(stats.true_density, 1e-9):
            return pred.cpu(), stats
        gain = 1.0 if best is None else best[1].predicted_density - stats.predicted_density
        if gain > 0:
            best = (pred, stats)
        if gain < MIN_GAIN:
            break  # a larger rank does not help: this block's activity is hard to predict
    return best[0].cpu(), best[1]


def decode_bytes(ffn, stats: PredictorStats) -> tuple[int, int]:
    """(exact, predicted): weight bytes the C decode kernel reads per token for this block,
    without and with the predictor (whose own bytes count), from the held-out statistics.

    The kernel reads one first row per candidate neuron (the gate; gate and up for gated blocks
    whose activation is not ReLU, as SiLU never gives exact zeros) and the rest of a neuron's
    rows only when it fires. Exact mode takes every neuron as a candidate, predicted mode the
    predicted ones; a block gains from its predictor when the first rows it skips outweigh the
    bytes of the predictor's kernel."""
    first, later = _row_reads(ffn)
    predicted = (kernel_bytes(stats.rank, ffn.d_model, ffn.n_ff)
                 + ffn.n_ff * (stats.predicted_density * first + stats.recall * stats.true_density * later))
    return exact_decode_bytes(ffn, stats.true_density), round(predicted)


def record(ffn, predictor: Predictor, stats: PredictorStats) -> None:
    """Write what training decided and measured into the block's plan."""
    decided, measured = ffn.block.decided, ffn.block.measured
    decided.predictor_rank, decided.predictor_tau = stats.rank, predictor.tau
    measured.predictor_recall, measured.predictor_bytes = stats.recall, stats.nbytes
    measured.predicted_density, measured.true_density = stats.predicted_density, stats.true_density
    measured.decode_bytes_exact, measured.decode_bytes_predicted = decode_bytes(ffn, stats)


def refresh_decode_bytes(ffn) -> None:
    """The block's decode bytes (record's) again from what training measured, for the rows it
    holds now: after quantize its blocks' bytes, not the float rows training saw."""
    decided, measured = ffn.block.decided, ffn.block.measured
    if decided.predictor_rank is None:
        return
    stats = PredictorStats(decided.predictor_rank, measured.predictor_recall,
                           measured.predicted_density, measured.true_density,
                           measured.predictor_bytes)
    measured.decode_bytes_exact, measured.decode_bytes_predicted = decode_bytes(ffn, stats)


def _row_reads(ffn) -> tuple[int, int]:
    """(bytes read per candidate neuron, further bytes per firing neuron): the first rows are
    gate / up rows (ffn.row_bytes each), the later ones up (gated ReLU) and down
    (ffn.down_row_bytes: its own format)."""
    gated = ffn.w_gate is not None
    first_rows = 2 if gated and not zero_below(ffn.act) else 1  # gate / up rows per candidate
    later_up = 1 if gated and zero_below(ffn.act) else 0  # up rows per firing neuron, then down
    return first_rows * ffn.row_bytes, later_up * ffn.row_bytes + ffn.down_row_bytes


def exact_decode_bytes(ffn, density: float) -> int:
    """Weight bytes the C decode kernel reads per token for this block without a predictor,
    when `density` of its neurons fire (every neuron is a candidate): decode_bytes's exact."""
    first, later = _row_reads(ffn)
    return round(ffn.n_ff * (first + density * later))


def first_projection(ffn) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(W [n_ff, d], b [n_ff] or None) whose sign decides a ReLU block's firing (the gate, or
    up without a gate) as float weights; None for other activations (a SiLU neuron never
    gives exact zeros: its firing is a threshold on |h|, not a sign) and quantized rows."""
    if not zero_below(ffn.act):
        return None
    w, b = (ffn.w_gate, ffn.b_gate) if ffn.w_gate is not None else (ffn.w_up, ffn.b_up)
    if not w.is_floating_point():
        return None
    return w, b


def train_all(profiles: dict[str, BlockProfile], ffns: dict | None = None, quiet: bool = False,
              **kw) -> dict[str, tuple[Predictor, PredictorStats]]:
    """train_predictor per block; with `ffns` (by the same names, float weights), ReLU blocks
    also try their first projection's low-rank approximation, and every block's critical
    neurons are always predicted."""
    def one(name, prof):
        ffn = ffns[name] if ffns else None
        if ffn is None or not ffn.w_up.is_floating_point():
            return train_predictor(prof, **kw)
        return train_predictor(prof, first=first_projection(ffn),
                               always=critical_neurons(ffn, prof.x), **kw)

    return {name: one(name, prof)
            for name, prof in progress_bar(profiles.items(), "training predictors", quiet,
                                           total=len(profiles))}


def insert_predictor_node(gm: fx.GraphModule, ffn_attr: str) -> None:
    """`y = self.ffn(x)` -> `p = self.ffn.predictor(x); y = self.ffn(x, p)` in the graph."""
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target == ffn_attr:
            with gm.graph.inserting_before(node):
                p = gm.graph.call_module(f"{ffn_attr}.predictor", (node.args[0],))
            node.args = (node.args[0], p)
    gm.recompile()
