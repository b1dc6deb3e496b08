"""Calibrated rounding of weights into GGUF's blocks: GPTQ (Frantar et al. 2022, arXiv 2210.17323).

    blocks = gptq.quantize(w, "q4_0", H)              # w [O, K], H [K, K] -> uint8 [O, row_bytes(K)]
    blocks = gptq.quantize_transposed(wt, "q8_0", H)  # wt [K, O] (FFN down_t) -> uint8 [K, row_bytes(O)]

Why: round-to-nearest (quant.quantize) makes each weight as close as it can be, but what the
model needs close is each layer's output X W^T over the inputs it sees. GPTQ quantizes the
weight one input column at a time and moves each column's rounding error onto the columns not
yet quantized, weighted by the inverse of the inputs' Hessian H = X^T X / n, so that the errors
cancel along the directions the inputs actually take (perplexities: BENCHMARKS.md, session 11).

The output is exactly GGUF's block layout (quant.py): only which blocks are chosen changes, so
every kernel reads it unchanged. Each block's scale (and q4_1's minimum) is chosen when the
quantizer reaches the first of the block's columns, from the error-updated weights: by the
format's own rule (gguf's reference, reproduced here bit for bit), or for the 4-bit formats by
a search weighted by the Hessian's diagonal (quantize's `search`). Columns go in order of
decreasing H diagonal (`act_order`). With H = identity and no search nothing moves and the
result is quant.quantize's, byte for byte.

Two layouts: `quantize` for weights blocked along their input dimension (nn.Linear's [O, K],
the FFN's gate and up rows); `quantize_transposed` for the FFN's down rows, stored as
down_t [n_ff, d] and blocked along d, down's *output* dimension: there an input column of
down is a row of down_t, quantized whole (each of its blocks by the format's rule) before its
error moves to the later rows.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from picompile import quant

DAMP = 0.01  # share of the mean diagonal of H added to it (the paper's "percdamp")
BATCH = 128  # columns per lazy batch update (a multiple of quant.BLOCK)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, as ggml's roundf and gguf's np_roundf compute it."""
    a = x.abs()
    f = torch.floor(a)
    return torch.sign(x) * (f + torch.floor(2 * (a - f)))


def _scales(blocks: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks float32 [..., 32] -> (d, id, m) [..., 1] by gguf's rule for `fmt`: d the scale
    (float32, stored as float16), id = 1/d (0 where d = 0) as gguf divides, m q4_1's minimum
    (zeros for the others)."""
    if fmt == "q8_0":
        d = blocks.abs().amax(dim=-1, keepdim=True) / 127
        m = torch.zeros_like(d)
    elif fmt == "q4_0":
        imax = blocks.abs().argmax(dim=-1, keepdim=True)
        d = blocks.gather(-1, imax) / -8
        m = torch.zeros_like(d)
    else:  # q4_1
        hi = blocks.amax(dim=-1, keepdim=True)
        m = blocks.amin(dim=-1, keepdim=True)
        d = (hi - m) / 15
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    return d, inv, m


def _searched_scales(blocks: torch.Tensor, a: torch.Tensor, fmt: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks float32 [R, 32], importances a [32] -> (d, id, m) [R, 1] for the 4-bit formats:
    the scale (and q4_1's minimum) minimising sum a (x - value)^2 over a few candidate grids,
    each refitted by weighted least squares (llama.cpp's make_qx_quants / make_qkx3_quants with
    an importance matrix). q8_0: gguf's rule."""
    if fmt == "q8_0":
        return _scales(blocks, fmt)
    x = blocks[None]  # [1, R, 32]
    if fmt == "q4_0":
        imax = blocks.abs().argmax(dim=-1, keepdim=True)
        mx = blocks.gather(-1, imax)  # [R, 1] the signed value of largest magnitude
        steps = torch.arange(-9, 10, dtype=torch.float32)[:, None, None]  # [S, 1, 1]
        iscale = torch.where(mx == 0, 0, -(8 + 0.1 * steps) / mx)  # [S, R, 1]
        lv = (iscale * x).round_().clamp_(-8, 7)  # [S, R, 32]
        sxl = ((a * x) * lv).sum(-1)  # [S, R]; in place where it can, the same arithmetic
        sll = (a * lv).mul_(lv).sum(-1)
        score = torch.where(sll > 0, sxl * sxl / sll.clamp_min(1e-30), -1)
        best = score.argmax(0, keepdim=True)  # [1, R]
        d = (sxl.gather(0, best) / sll.gather(0, best).clamp_min(1e-30))[0, :, None]
        d = torch.where(mx == 0, 0, d)
        m = torch.zeros_like(d)
    else:  # q4_1: levels 0..15, value = d * l + m
        lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)  # [R, 1]
        steps = torch.arange(37, dtype=torch.float32)[:, None, None]
        iscale = torch.where(hi == lo, 0, (14.1 + 0.05 * steps) / (hi - lo))  # [S, R, 1]
        lv = (iscale * (x - lo)).round_().clamp_(0, 15)  # [S, R, 32]
        alv, ax = a * lv, a * x
        sw, sl, sx = a.sum(), alv.sum(-1), ax.sum(-1)
        sll, sxl = alv.mul_(lv).sum(-1), (ax * lv).sum(-1)
        det = sw * sll - sl * sl
        ok = det > 0
        dd = torch.where(ok, (sw * sxl - sx * sl) / det.clamp_min(1e-30), 0)
        mm = torch.where(ok, (sll * sx - sl * sxl) / det.clamp_min(1e-30), 0)
        err = (a * (dd[..., None] * lv).add_(mm[..., None]).sub_(x).pow_(2)).sum(-1)
        err = torch.where(ok & (dd > 0), err, float("inf"))
        best = err.argmin(0, keepdim=True)
        d, m = dd.gather(0, best)[0, :, None], mm.gather(0, best)[0, :, None]
        rtn_d, _, rtn_m = _scales(blocks, fmt)
        none = torch.isinf(err.gather(0, best))[0, :, None]
        d, m = torch.where(none, rtn_d, d), torch.where(none, rtn_m, m)
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    return d, inv, m


def _levels(x: torch.Tensor, inv: torch.Tensor, m: torch.Tensor, fmt: str) -> torch.Tensor:
    """x float32 -> its integer levels (as float32) under scale 1/inv, by gguf's rule; values
    the scale was not chosen for (error-updated later columns) are clamped to the format."""
    if fmt == "q8_0":
        return _roundf(x * inv).clamp(-127, 127)
    if fmt == "q4_0":
        return torch.trunc(x * inv + 8.5).clamp(0, 15)
    return torch.trunc((x - m) * inv + 0.5).clamp(0, 15)


def _values(q: torch.Tensor, d16: torch.Tensor, m16: torch.Tensor, fmt: str) -> torch.Tensor:
    """What the kernels read back: levels q with the float16 scale (and minimum), float32."""
    if fmt == "q8_0":
        return d16 * q
    if fmt == "q4_0":
        return d16 * (q - 8)
    return d16 * q + m16


def _pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, fmt: str) -> torch.Tensor:
    """levels q [R, nb, 32], d / m [R, nb] (float32) -> uint8 [R, nb * block_bytes], GGUF's."""
    R, nb = d.shape

    def f16_bytes(t):  # [R, nb] -> [R, nb, 2] (a fresh tensor: views of bytes need stride 1)
        return torch.empty(R, nb, 1, dtype=torch.float16).copy_(t[..., None]).view(torch.uint8)

    head = [f16_bytes(d)]
    if fmt == "q8_0":
        body = q.to(torch.int8).view(torch.uint8)
    else:
        n = q.to(torch.uint8)
        body = n[..., :16] | (n[..., 16:] << 4)
        if fmt == "q4_1":
            head.append(f16_bytes(m))
    return torch.cat([*head, body], dim=-1).reshape(R, -1)


@dataclass(frozen=True)
class Prepared:
    """What GPTQ needs of one Hessian, computed once for every weight reading the same inputs
    (q, k and v; gate and up): prepare()'s answer."""

    perm: torch.Tensor  # [K] long: position -> input column (the order columns are quantized in)
    u: torch.Tensor  # [K, K] upper Cholesky factor of the damped inverse Hessian, in that order
    dead: torch.Tensor  # [K] bool by column: inputs no calibration token reached
    importance: torch.Tensor  # [K] the Hessian's diagonal by column (dead ones: the live mean)


def prepare(hessian: torch.Tensor, damp: float = DAMP, act_order: bool = True) -> Prepared:
    """The order (decreasing H diagonal with act_order, else 0..K-1) and the upper Cholesky
    factor of (H + damp * mean(diag H) * I)^-1 in that order. Inputs no calibration token
    reached (diag 0) get H's diagonal 1: uncoupled from the others, their weights are rounded
    to nearest. (The paper's code zeroes them, right for an input that is always zero; an FFN
    neuron that never fired on the calibration tokens may fire on the user's.)
    Raises torch.linalg.LinAlgError where H is not positive definite even damped."""
    h = hessian.to("cpu", torch.float32)
    K = h.shape[0]
    if h.shape != (K, K):
        raise ValueError(f"a Hessian is square, got {tuple(h.shape)}")
    diag = h.diagonal().clone()
    perm = torch.argsort(diag, descending=True, stable=True) if act_order else torch.arange(K)
    h = h[perm][:, perm]  # a copy, in the order
    dead = h.diagonal() == 0
    h.diagonal()[dead] = 1
    h.diagonal().add_(damp * h.diagonal().mean())
    lower = torch.linalg.cholesky(h)
    inv = torch.linalg.solve_triangular(lower, torch.eye(K), upper=False)  # L^-1
    u = torch.linalg.cholesky(inv.T @ inv, upper=True)
    importance = diag.clone()  # the 4-bit scale search weighs a dead input as an average one
    importance[diag == 0] = diag[diag > 0].mean() if bool((diag > 0).any()) else 1.0
    return Prepared(perm, u, diag == 0, importance)


def _prepared(hessian, K: int, damp: float, act_order: bool) -> Prepared:
    prep = hessian if isinstance(hessian, Prepared) else prepare(hessian, damp, act_order)
    if prep.u.shape != (K, K):
        raise ValueError(f"the Hessian of a weight with {K} input features is [{K}, {K}], "
                         f"got {tuple(prep.u.shape)}")
    return prep


def _run(wt: torch.Tensor, u: torch.Tensor, row) -> None:
    """The GPTQ loop over the input columns of a weight, held transposed as wt [K, O] (in
    place, float32; a column is a contiguous row; u [K, K], prepare()'s factor, in the same
    order): row(j, rows [B', O] of its lazy batch from row j on, current, wide) -> row j
    quantized [O], where current(positions) gives rows not yet quantized as the updates so far
    leave them; each row's error, scaled by the inverse factor, is taken off the rows after it
    (within the batch at once, beyond it once per batch).
    Threads: the per-row ops are small (a row of O values): on 2 cores shared with another
    process, torch's two OpenMP threads made them 10-60x slower than one thread (measured), so
    the loop runs on one. The lazy batch update (a matrix product) and what `row` does under
    `wide()` (a block's scale search) run on torch's own count."""
    n = torch.get_num_threads()
    with _threads(1):
        _batches(wt, u, row, lambda: _threads(n))


@contextlib.contextmanager
def _threads(n: int):
    """torch's OpenMP threads set to n within the block."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _batches(wt: torch.Tensor, u: torch.Tensor, row, wide) -> None:
    """_run's loop, lazy batch by lazy batch."""
    K = wt.shape[0]
    for i1 in range(0, K, BATCH):
        i2 = min(i1 + BATCH, K)
        w1 = wt[i1:i2]  # [B, O], a view: updated in place
        err = torch.empty_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):

            def current(pos, i1=i1, i2=i2, i=i, w1=w1, err=err):
                """rows at positions pos (>= i1 + i) as the updates so far leave them [n, O]"""
                out = wt[pos].clone()
                later = pos >= i2
                if later.any():
                    out[later] -= u[i1:i1 + i, pos[later]].T @ err[:i]
                return out

            q = row(i1 + i, w1[i:], current, wide)
            torch.div(w1[i] - q, u1[i, i], out=err[i])  # [O]
            w1[i + 1:].addr_(u1[i, i + 1:], err[i], alpha=-1)
        with wide():
            wt[i2:].addmm_(u[i1:i2, i2:].T, err, alpha=-1)


def quantize(w: torch.Tensor, fmt: str, hessian: torch.Tensor | Prepared, damp: float = DAMP,
             act_order: bool = True, search: bool = True) -> torch.Tensor:
    """w [O, K] (any float dtype), hessian [K, K] of the layer's inputs (or prepare()'s answer
    for it: damp and act_order are then its own) -> uint8 [O, row_bytes(K, fmt)]: GGUF blocks
    of 32 along K, as quant.quantize lays them out, rounded by GPTQ.

    act_order: the columns in order of decreasing H diagonal (the inputs of most energy first,
    while the most columns are left to take their errors: the paper's "act-order"); a block's
    scale is set when the first of its 32 columns comes, from all 32 as the updates so far
    leave them. search (4-bit formats): that scale (and q4_1's minimum) is the one of a few
    candidate grids that fits the block best, weighted by the columns' H diagonal, refitted by
    least squares (llama.cpp's rule with an importance matrix), not gguf's max-based one.
    On SmolLM2 at q4_0 (BENCHMARKS.md, session 11) each of the two took perplexity down by
    about as much as GPTQ's plain order did. Without search, H = identity gives quant.quantize's
    blocks byte for byte (no error moves, every block gets gguf's scale); with it, the scale is
    the least-squares one for the same levels instead."""
    why = quant.why_not_quantizable(w.shape)
    if why is not None:
        raise ValueError(f"cannot quantize to {fmt}: {why}")
    fmt = quant.format_of(fmt).name
    O, K = w.shape
    prep = _prepared(hessian, K, damp, act_order)
    perm, importance = prep.perm, prep.importance  # position -> column; [K] by column
    pos_of = torch.argsort(perm)  # column -> position
    W = w.detach().to("cpu", torch.float32).t().clone()  # [K, O]
    W = W[perm].contiguous()  # in the order
    nb = K // quant.BLOCK
    Q = torch.empty(K, O)  # levels, by column
    D, INV, M = (torch.empty(nb, O) for _ in range(3))
    D16, M16 = torch.empty(nb, O), torch.empty(nb, O)  # the scales as stored
    started = [False] * nb

    def row(p, rest, current, wide):
        j = int(perm[p])
        b = j // quant.BLOCK
        if not started[b]:  # the block's scales, from its 32 columns as they are now
            cols = slice(b * quant.BLOCK, (b + 1) * quant.BLOCK)
            vals = current(pos_of[cols]).T  # [O, 32]
            if search and fmt != "q8_0":  # the 4-bit formats
                with wide():  # [candidates, O, 32] at once: worth all threads
                    d, inv, m = _searched_scales(vals, importance[cols], fmt)
            else:
                d, inv, m = _scales(vals, fmt)  # [O, 1]
            D[b], INV[b], M[b] = d[:, 0], inv[:, 0], m[:, 0]
            D16[b], M16[b] = D[b].to(torch.float16), M[b].to(torch.float16)
            started[b] = True
        Q[j] = q = _levels(rest[0], INV[b], M[b], fmt)
        return _values(q, D16[b], M16[b], fmt)

    _run(W, prep.u, row)
    levels = Q.T.reshape(O, nb, quant.BLOCK)
    return _pack(levels, D.T.contiguous(), M.T.contiguous(), fmt)


def quantize_transposed(wt: torch.Tensor, fmt: str, hessian: torch.Tensor | Prepared,
                        damp: float = DAMP) -> torch.Tensor:
    """wt [K, O] (a layer's weight transposed: row j is input column j, as the FFN's down_t),
    hessian [K, K] of the layer's inputs (or prepare(act_order=False)'s answer) -> uint8 [K, row_bytes(O, fmt)]: GGUF blocks of 32
    along O (quant.quantize(wt)'s layout), rounded by GPTQ: each row quantized whole by the
    format's rule, its error moved onto the rows after it."""
    why = quant.why_not_quantizable(wt.shape)
    if why is not None:
        raise ValueError(f"cannot quantize to {fmt}: {why}")
    fmt = quant.format_of(fmt).name
    K, O = wt.shape
    prep = _prepared(hessian, K, damp, act_order=False)
    if not torch.equal(prep.perm, torch.arange(K)):
        raise ValueError("quantize_transposed takes its rows in order: prepare(act_order=False)")
    W = wt.detach().to("cpu", torch.float32).clone()  # [K, O]
    nb = O // quant.BLOCK
    Q = torch.empty(K, nb, quant.BLOCK)  # levels, down_t's layout
    D, M = torch.empty(K, nb), torch.empty(K, nb)

    def row(j, rest, _current, _wide):
        blocks = rest[0].reshape(nb, quant.BLOCK)
        d, inv, m = _scales(blocks, fmt)
        q = _levels(blocks, inv, m, fmt)
        Q[j], D[j], M[j] = q, d[:, 0], m[:, 0]
        return _values(q, d.to(torch.float16).float(), m.to(torch.float16).float(), fmt).reshape(O)

    _run(W, prep.u, row)
    return _pack(Q, D, M, fmt)
