"""Autotune: after lowering, time each block's decode on this machine with and without its
predictor, so that predictors="auto" runs a predictor only where it pays.

Like Inductor's select_algorithm, a separate stage over kernels already chosen and bound: it
measures and records (BlockPlan.measured.decode_us_*); CompiledModel.use_predictors decides from
the records. Byte counts (passes/predictors.decode_bytes) leave out the fixed costs per call
(Python, thread start-up) that decide small blocks: hence a measurement."""

from __future__ import annotations

import statistics
import time

import torch

from picompile.progress import progress_bar

TIMING_SAMPLES = 32  # block inputs from the profile on which each block is timed


def autotune(ffns: dict, block_inputs: dict[str, torch.Tensor], quiet: bool = False) -> None:
    """Time every block that has a predictor on `TIMING_SAMPLES` of its profiled inputs
    block_inputs[name] [N, d], and record the medians in its BlockPlan.measured."""
    names = [n for n in block_inputs if ffns[n].predictor is not None]
    xs = [timing_samples(block_inputs[n]) for n in names]
    timed = time_decode([ffns[n] for n in names], xs, quiet=quiet)
    for name, (exact_us, predicted_us) in zip(names, timed):
        measured = ffns[name].block.measured
        measured.decode_us_exact, measured.decode_us_predicted = exact_us, predicted_us


def timing_samples(x: torch.Tensor, n: int = TIMING_SAMPLES) -> torch.Tensor:
    """n of the profile's block inputs x [N, d], at random (seeded). Not every (N/n)-th: the
    profile holds calibration rows in order, so a stride that divides the row length picks one
    position of every row, and position 0 is not like the rest (it made a block time slower
    than on decode's tokens)."""
    pick = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[:n]
    return x[pick.sort().values]


@torch.no_grad()
def time_decode(ffns: list, xs: list[torch.Tensor], rounds: int = 5, quiet: bool = False
                ) -> list[tuple[float, float]]:
    """Per block, (exact, predicted): median microseconds of one single-token call without and
    with its predictor, over the block's inputs xs[i] [N, d].

    The blocks are called in model order, token after token, as decode calls them, so each
    finds in the cache what decode leaves there: in a model larger than the cache the other
    blocks evict a block's rows before its next call, which timing one block alone misses.
    Exact and predicted take turns per token, each going first every other round, so both see
    the same load on the machine."""
    n = min((len(x) for x in xs), default=0)
    if n == 0:
        return [(0.0, 0.0)] * len(ffns)  # nothing to time on: predictors="auto" leaves them exact
    # the samples may be on the GPU that profiled: time on the blocks' own device (the CPU)
    # (in the weights' dtype; float32 for quantized blocks, whose weights are uint8 blocks)
    xs = [x[:n].to(f.w_up.device, f.w_up.dtype if f.w_up.is_floating_point() else torch.float32)
          for f, x in zip(ffns, xs)]
    times = [([], []) for _ in ffns]  # per block: exact, predicted seconds
    enabled = [f.predictor.enabled for f in ffns]
    try:
        for r in progress_bar(range(rounds), "timing predictors", quiet):
            for s in range(n):
                for use in (False, True) if r % 2 == 0 else (True, False):
                    for ffn, x, t in zip(ffns, xs, times):
                        ffn.predictor.enabled = use
                        x1 = x[s : s + 1]  # [1, d]
                        t0 = time.perf_counter()
                        ffn(x1, ffn.predictor(x1))
                        t[use].append(time.perf_counter() - t0)
    finally:
        for ffn, on in zip(ffns, enabled):
            ffn.predictor.enabled = on
            ffn.reset_stats()
    return [(statistics.median(e) * 1e6, statistics.median(p) * 1e6) for e, p in times]
