"""Place: which neurons of each FFN block live on the GPU ("hot") and which stay on the CPU.

Three parts, PowerInfer-style:

* `account(model, ffns, max_context=...)`: the bytes that must be on the GPU before any neuron
  can be: the non-FFN weights, the predictors' shared parts, the KV cache, the down biases and a
  workspace. Each is an item of the returned dict.
* `place(budget_bytes=..., fixed_bytes=..., blocks=[BlockDemand, ...])`: the pure core. Given what
  one neuron of each block costs and how often each fires (profiled), pick the hot neurons that
  serve the largest expected share of firings within the budget, with every block's hot count 0
  or at least a minimum slice.
* `apply_order(ffn, order)`: permute a block's neurons hot-first (most frequent first), so the hot
  neurons are rows 0 .. hot-1 of every per-neuron tensor, which is what the GPU kernels read. The
  cold neurons after them keep the model's own order (see `_placed_order`).

Everything here is plain arithmetic on byte counts and frequency vectors: it needs no GPU.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from picompile.config import KV_CACHE_STEP
from picompile.runtime.sparse_ffn import SparseFFN

# Per-neuron tensors of a SparseFFN (rows / entries indexed by neuron), and of its predictor.
FFN_ROW_TENSORS = ("w_gate", "w_up", "w_down_t", "b_gate", "b_up")
PREDICTOR_ROW_TENSORS = ("p2", "pb2")  # permuted with the neurons

# What the GPU holds outside PyTorch's tensors, when it cannot be measured (no GPU here at
# compile time). Stated, not measured: a CUDA 12/13 context with cuBLAS and the loaded kernel
# modules takes a few hundred MB on an H100.
DEFAULT_CUDA_CONTEXT_BYTES = 512 * 2**20
# cuBLAS and cuBLASLt workspaces: PyTorch allocates them in its pool per stream (32 MiB each on
# Hopper), and two streams run cuBLAS: the default one (prefill, the eager step) and the one the
# device decoder warms up and captures its CUDA graphs on.
CUBLAS_WORKSPACE_BYTES = 2 * 64 * 2**20
# The caching allocator rounds blocks up and fragments: this share of the budget stays free.
# 3% was measured too little: OPT-13B on an H100 peaked 2% over its budget (BENCHMARKS.md).
ALLOCATOR_RESERVE_SHARE = 0.06

# Default workspace: this many float32 [batch, max(d_model, n_ff)] buffers per FFN block (its
# input copy, the down input h, the candidate index list, the partial output), plus the float32
# logits [batch, vocab] when the vocabulary size is known. See `account`.
WORKSPACE_BUFFERS_PER_BLOCK = 4

DEFAULT_MIN_SLICE = 128


# -- what one neuron costs ---------------------------------------------------------------------

def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _row_bytes(t: torch.Tensor | None) -> int:
    """Bytes of one row (first-dim entry) of t."""
    if t is None or t.dim() == 0 or t.shape[0] == 0:
        return 0
    return _nbytes(t) // t.shape[0]


def neuron_bytes(ffn: SparseFFN, formats: tuple[str, str] | None = None) -> int:
    """Bytes one neuron of `ffn` costs on the GPU: its rows of w_gate (if any), w_up and w_down_t,
    and its entries of b_gate / b_up (if any). b_down is not per neuron, and the predictor goes
    to the GPU whole (every neuron's row: the GPU predicts the cold ones too), so both are fixed
    costs (see `account`). `formats` (gate / up rows' format, down rows' format): the block
    as the quantize pass will store it (placement runs before it), biases then float32."""
    if formats is None:
        return sum(_row_bytes(getattr(ffn, name, None)) for name in FFN_ROW_TENSORS)
    from picompile import quant

    fmt, down_fmt = formats
    rows = (ffn.w_gate is not None) + 1
    biases = sum(getattr(ffn, name) is not None for name in ("b_gate", "b_up"))
    return rows * quant.row_bytes(ffn.d_model, fmt) + quant.row_bytes(ffn.d_model, down_fmt) + 4 * biases


# -- what must be on the GPU besides the hot neurons -------------------------------------------

class Accounting(dict):
    """dict[str, int] of bytes by item, with `notes` (list[str]) on how items were counted."""

    def __init__(self, *args, notes: list[str] | None = None, **kw):
        super().__init__(*args, **kw)
        self.notes: list[str] = list(notes or [])


def _tensors_of(obj) -> list[torch.Tensor]:
    """Every tensor held by obj: an nn.Module's parameters and buffers, or a plain object's /
    dict's tensor attributes."""
    if obj is None:
        return []
    if isinstance(obj, nn.Module):
        return [*obj.parameters(), *obj.buffers()]
    items = obj.values() if isinstance(obj, dict) else vars(obj).values()
    return [t for t in items if isinstance(t, torch.Tensor)]


def _extent(t: torch.Tensor) -> tuple:
    """(storage key, first byte, end byte) of the memory t covers in its storage."""
    es = t.element_size()
    if t.device.type == "meta":  # no storage to share: identify by the tensor itself
        return (("meta", id(t)), 0, _nbytes(t))
    if t.numel() == 0:
        return (("empty", id(t)), 0, 0)
    span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    start = t.storage_offset() * es
    key = (str(t.device), t.untyped_storage().data_ptr())
    return (key, start, start + span * es)


def _union_bytes(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, -1
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _storage_bytes(tensors, skip_storages=frozenset(), planned=None) -> int:
    """Bytes of memory `tensors` cover, shared and tied tensors and views of one storage counted
    once; none of the storages in `skip_storages` (views of FFN weights held elsewhere, e.g. by
    a replaced Linear: those bytes are the FFN's, placed per neuron). `planned` {id(tensor):
    bytes}: tensors counted at those bytes instead (weights compile will quantize)."""
    planned = planned or {}
    intervals: dict[tuple, list[tuple[int, int]]] = {}
    later: dict[int, int] = {}
    for t in tensors:
        if id(t) in planned:
            later[id(t)] = planned[id(t)]
            continue
        key, a, b = _extent(t)
        if key not in skip_storages:
            intervals.setdefault(key, []).append((a, b))
    return sum(_union_bytes(v) for v in intervals.values()) + sum(later.values())


def _predictor_bytes(ffns) -> int:
    """The predictors of `ffns` whole, in float16 (as runtime.hybrid.distribute puts them on the
    GPU)."""
    return sum(2 * t.numel() for f in ffns if getattr(f, "predictor", None) is not None
               for t in _tensors_of(f.predictor))


def _model_dtype(tensors: list[torch.Tensor], fallback: torch.dtype) -> torch.dtype:
    """The floating dtype holding the most bytes: what the model computes (and caches KV) in."""
    by_dtype: dict[torch.dtype, int] = {}
    for t in tensors:
        if t.is_floating_point():
            by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + _nbytes(t)
    return max(by_dtype, key=by_dtype.get) if by_dtype else fallback


def kv_cache_bytes(config, *, max_context: int, batch: int, element_size: int
                   ) -> tuple[int, str | None]:
    """(bytes, note) of a full KV cache for a Hugging Face config: 2 (K and V) * layers *
    kv_heads * head_dim * max_context (rounded up to config.KV_CACHE_STEP) * batch *
    element_size. (0, why) when the config lacks the fields."""
    if config is None:
        return 0, ("kv_cache: the model has no Hugging Face config, so no KV cache is counted; "
                   "leave room for it in gpu_budget if the model keeps one")
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not layers or not heads:
        return 0, (f"kv_cache: {type(config).__name__} has no num_hidden_layers / "
                   "num_attention_heads, so no KV cache is counted")
    kv_heads = getattr(config, "num_key_value_heads", None)
    if not kv_heads:
        # Falcon's names: new_decoder_architecture -> num_kv_heads; multi_query -> 1 head.
        if getattr(config, "new_decoder_architecture", False):
            kv_heads = getattr(config, "num_kv_heads", None)
        elif getattr(config, "multi_query", False):
            kv_heads = 1
    kv_heads = kv_heads or heads
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if hidden else None)
    if not head_dim:
        return 0, f"kv_cache: {type(config).__name__} gives no head_dim, so no KV cache is counted"
    note = None
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        note = ("kv_cache: counted for the full max_context although the model has a sliding "
                "window (an upper bound)")
    positions = -(-max_context // KV_CACHE_STEP) * KV_CACHE_STEP  # as the device decoder grows it
    return 2 * layers * kv_heads * head_dim * positions * batch * element_size, note


def account(
    model: nn.Module,
    ffns: dict[str, SparseFFN],
    *,
    max_context: int,
    batch: int = 1,
    workspace_bytes: int | None = None,
    budget_bytes: int | None = None,
    planned_bytes: dict[int, int] | None = None,
) -> Accounting:
    """Bytes that must be on the GPU for a useful hybrid run, by item (a dict, with `.notes`):

    non_ffn_weights  every parameter and buffer of `model` outside the SparseFFN modules
                     (embeddings, attention, norms, head), shared / tied tensors counted once
                     (by the bytes of storage they cover, so views of one storage are not
                     double counted either); a weight in `planned_bytes` ({id(weight):
                     bytes}, quantize_pass.planned_linear_bytes) at the bytes given there;
    predictors       every predictor whole, in float16 (what distribute() puts on the GPU);
    kv_cache         2 * layers * kv_heads * head_dim * max_context (rounded up to a
                     KV_CACHE_STEP) * batch * element size of the model dtype, from the Hugging
                     Face config (0, with a note, without one);
    ffn_biases_down  every block's b_down: the output side of a block stays on the GPU;
    workspace        `workspace_bytes` if given, else WORKSPACE_BUFFERS_PER_BLOCK float32
                     [batch, max(d_model, n_ff)] buffers per block plus float32 logits
                     [batch, vocab] (decode-sized scratch);
    cuda_context     the CUDA context and loaded modules, outside PyTorch's pool: measured
                     where a GPU exists, else DEFAULT_CUDA_CONTEXT_BYTES;
    cublas_workspace CUBLAS_WORKSPACE_BYTES (stated);
    allocator_reserve ALLOCATOR_RESERVE_SHARE of `budget_bytes` (0 without one).

    Not counted: prefill activations beyond decode size (prefill runs before the budget's
    promise is measured by the tests: decode).
    """
    if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 0:
        raise ValueError(f"max_context must be an int >= 0, got {max_context!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    if workspace_bytes is not None and (isinstance(workspace_bytes, bool)
                                        or not isinstance(workspace_bytes, int)
                                        or workspace_bytes < 0):
        raise ValueError(f"workspace_bytes must be an int >= 0 or None, got {workspace_bytes!r}")
    notes: list[str] = []

    # Everything inside a SparseFFN (the given ones and any other in the model) is FFN.
    ffn_modules = {id(f): f for f in ffns.values()}
    ffn_modules.update({id(m): m for m in model.modules() if isinstance(m, SparseFFN)})
    ffn_tensors: list[torch.Tensor] = []
    for f in ffn_modules.values():
        ffn_tensors += _tensors_of(f)
        pred = getattr(f, "predictor", None)
        if pred is not None and not isinstance(pred, nn.Module):
            ffn_tensors += _tensors_of(pred)
    ffn_ids = {id(t) for t in ffn_tensors}
    ffn_storages = {_extent(t)[0] for t in ffn_tensors if t.numel()}

    others = [t for t in [*model.parameters(), *model.buffers()] if id(t) not in ffn_ids]
    non_ffn = _storage_bytes(others, ffn_storages, planned_bytes)
    predictors = _predictor_bytes(ffns.values())

    fallback = next(iter(ffns.values())).float_dtype if ffns else torch.float32
    dtype = _model_dtype(others, fallback)
    esize = torch.empty((), dtype=dtype).element_size()
    config = getattr(model, "config", None)
    kv, note = kv_cache_bytes(config, max_context=max_context, batch=batch, element_size=esize)
    if note:
        notes.append(note)

    biases_down = sum(_nbytes(f.b_down) for f in ffns.values())

    if workspace_bytes is None:
        per_block = sum(WORKSPACE_BUFFERS_PER_BLOCK * batch * max(f.d_model, f.n_ff) * 4
                        for f in ffns.values())
        vocab = getattr(config, "vocab_size", None) if config is not None else None
        workspace_bytes = per_block + (batch * vocab * 4 if isinstance(vocab, int) else 0)
        notes.append(
            f"workspace: {WORKSPACE_BUFFERS_PER_BLOCK} float32 [batch, max(d, n_ff)] buffers per "
            "block + float32 logits")

    context, how = cuda_context_bytes()
    notes.append(f"cuda_context: {how}; cublas_workspace: stated; allocator_reserve: "
                 f"{ALLOCATOR_RESERVE_SHARE:.0%} of the budget for the caching allocator's rounding")

    return Accounting(
        non_ffn_weights=non_ffn,
        predictors=predictors,
        kv_cache=kv,
        ffn_biases_down=biases_down,
        workspace=workspace_bytes,
        cuda_context=context,
        cublas_workspace=CUBLAS_WORKSPACE_BYTES,
        allocator_reserve=round(ALLOCATOR_RESERVE_SHARE * budget_bytes) if budget_bytes else 0,
        notes=notes,
    )


def budget_holding(gpu_bytes: float) -> int:
    """The gpu_budget under which placement can put `gpu_bytes` (account's items but the
    allocator reserve, plus hot neurons) on the GPU: the reserve is a share of the budget."""
    return int(gpu_bytes / (1 - ALLOCATOR_RESERVE_SHARE))


def budget_for_share(fixed_bytes: dict[str, int], ffns, share: float, less: int = 0) -> int:
    """The gpu_budget under which a placement that counted `fixed_bytes` (a plan's, made with
    room for everything) also holds `share` of the neurons of the SparseFFN blocks `ffns` (0:
    the fixed parts alone), less `less` bytes."""
    fixed = sum(n for item, n in fixed_bytes.items() if item != "allocator_reserve")
    ffn = sum(neuron_bytes(f) * f.n_ff for f in ffns)
    return budget_holding(fixed + share * ffn - less)


def cuda_context_bytes() -> tuple[int, str]:
    """(bytes, how): GPU memory in use outside PyTorch's pool (the CUDA context, kernel modules),
    measured on device 0 when a GPU is there (conservative: other processes count too), else
    DEFAULT_CUDA_CONTEXT_BYTES."""
    if not torch.cuda.is_available():
        return DEFAULT_CUDA_CONTEXT_BYTES, "no GPU here, a stated 512 MiB"
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    used = total - free - torch.cuda.memory_reserved()
    return max(0, used), "measured (GPU memory in use outside PyTorch's pool)"


# -- the placement problem ---------------------------------------------------------------------

@dataclass
class BlockDemand:
    """One FFN block as placement sees it."""

    name: str
    n_ff: int
    bytes_per_neuron: int  # `neuron_bytes(ffn)`
    freq: torch.Tensor  # [n_ff] float: firing frequency of each neuron, in [0, 1]


@dataclass
class PlacementResult:
    hot: dict[str, int]  # hot neuron count per block: 0, or >= min(min_slice, n_ff)
    order: dict[str, torch.Tensor]  # LongTensor [n_ff] per block: see _placed_order
    gpu_bytes: int  # fixed + hot neurons; never more than the budget
    fixed_on_gpu: bool  # False: even the fixed (non-FFN) parts did not fit
    expected_gpu_share: float  # sum of hot freq / sum of all freq
    notes: list[str] = field(default_factory=list)
    # An upper bound on the expected share any placement within this budget can reach (the
    # Lagrangian dual bound); share_bound - expected_gpu_share bounds the loss to the optimum.
    share_bound: float = 1.0


def _check_blocks(blocks: list[BlockDemand]) -> None:
    names = set()
    for b in blocks:
        if b.name in names:
            raise ValueError(f"two blocks are named {b.name!r}")
        names.add(b.name)
        if isinstance(b.n_ff, bool) or not isinstance(b.n_ff, int) or b.n_ff < 0:
            raise ValueError(f"block {b.name!r}: n_ff must be an int >= 0, got {b.n_ff!r}")
        if (isinstance(b.bytes_per_neuron, bool) or not isinstance(b.bytes_per_neuron, int)
                or b.bytes_per_neuron < 0):
            raise ValueError(f"block {b.name!r}: bytes_per_neuron must be an int >= 0, "
                             f"got {b.bytes_per_neuron!r}")
        f = b.freq
        if not isinstance(f, torch.Tensor) or tuple(f.shape) != (b.n_ff,):
            shape = tuple(f.shape) if isinstance(f, torch.Tensor) else type(f).__name__
            raise ValueError(f"block {b.name!r}: freq must be a tensor [n_ff={b.n_ff}], got {shape}")
        if f.numel() and not (torch.isfinite(f).all() and (f >= 0).all()):
            raise ValueError(f"block {b.name!r}: freq must be finite and >= 0")


def _hot_first(freq: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """(order, sorted freq): a block's neurons by descending firing frequency (LongTensor [n];
    equal freqs keep their neuron order) and their freqs in that order (float64 [n])."""
    f = freq.detach().to("cpu", torch.float64).numpy()
    o = np.argsort(-f, kind="stable")
    return torch.from_numpy(o.astype(np.int64)), f[o]


def _placed_order(hot_first: torch.Tensor, hot: int) -> torch.Tensor:
    """A block's neuron order once `hot` of its neurons are placed: the hot ones first, most
    frequent first (rows 0 .. hot-1: the GPU's), then the cold ones in ascending neuron number.
    Why not all by frequency: the CPU kernel cuts a call's neurons into chunks by ranges of
    neuron numbers (the C decoder's ffn_stable), and in frequency order the first range would
    hold most of the firings (half of them in 1 of 16 ranges for a power law), so one thread
    would do the work of many; the model's own order spreads them as the model does."""
    return torch.cat([hot_first[:hot], hot_first[hot:].sort().values])


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def place(
    *,
    budget_bytes: int,
    fixed_bytes: dict[str, int],
    blocks: list[BlockDemand],
    min_slice: int = DEFAULT_MIN_SLICE,
) -> PlacementResult:
    """Pick each block's hot neurons: maximize the expected share of firings served by the GPU,
    sum(freq of hot neurons) / sum(all freq), subject to

        sum(fixed_bytes) + sum_b hot_b * bytes_per_neuron_b <= budget_bytes,
        hot_b == 0  or  hot_b >= min(min_slice, n_ff_b)   (no GPU round trip for a handful).

    The fixed parts go first: if they alone exceed the budget (or the budget is 0), nothing is
    placed and everything runs on the CPU. Within a block all neurons cost the same, so the best
    hot set of a given size is always the most frequent neurons: the decision is one count per
    block, and `order` puts the hot ones first, most frequent first (`_placed_order`).

    Method and optimality. Per block, the value of k hot neurons is F_b(k), the sum of its k
    largest freqs (concave in k). A price lambda per byte splits the problem into one independent
    choice per block: k = 0, or k = max(m_b, #{neurons with freq/byte > lambda}), whichever is
    worth more at that price (the block is on iff its top m_b neurons' mean freq/byte beats
    lambda). The bytes this takes only grow as lambda falls, so a binary search over the finite
    set of breakpoints (neuron densities and block thresholds) finds the lowest price whose
    choice fits. That choice is *exactly optimal for the bytes it uses* (any Lagrangian solution
    is), and it is less than one tie group (neurons of equal density, or one block's minimum
    slice) short of the budget. Then:

    1. fill: the leftover is spent greedily by density (more neurons of placed blocks, or the
       minimum slice of an unplaced block), whichever fits;
    2. repair: up to SEARCH_ROUNDS rounds try flipping the blocks nearest the price (on -> off
       and off -> on at their minimum slice), one block and then, if none gains, two at once,
       re-solving the rest with the flipped blocks forced, and keep the best flip that gains;
    3. exchange: trade a block's least frequent hot neurons for another block's next neuron or
       slice that the leftover cannot hold, while a trade gains.

    Certificate: by weak duality OPT <= lambda * R + sum_b max(0, max_k F_b(k) - lambda c_b k)
    (R: bytes left after the fixed parts), returned as `share_bound`; the loss to the optimum is
    at most lambda times the leftover before the fill, so less than the value of one minimum
    slice (or tie group) of marginal neurons. At real sizes (a slice is MBs, the budget GBs)
    that is ~1e-5 of the share; on toy problems where a slice is a large part of the budget,
    exhaustive comparison (tests/test_place.py) finds the result optimal in most cases and a few
    percent off at worst (integer effects of neurons of different sizes). More budget never
    gives a lower share across budgets whose lowest fitting price differs (the bound of the
    smaller budget is below the Lagrangian value of the larger); within one price, only the
    fill / repair steps could break monotonicity, by less than the same bound.

    Blocks whose neurons cost 0 bytes are all hot (when the fixed parts fit). A budget covering
    everything makes every neuron hot, frequent or not. With no firings at all (all freq 0) the
    share is 1.0 if every neuron is hot, else 0.0.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"budget_bytes must be an int >= 0, got {budget_bytes!r}")
    if isinstance(min_slice, bool) or not isinstance(min_slice, int) or min_slice < 0:
        raise ValueError(f"min_slice must be an int >= 0, got {min_slice!r}")
    for k, v in fixed_bytes.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"fixed_bytes[{k!r}] must be an int >= 0, got {v!r}")
    _check_blocks(blocks)

    order: dict[str, torch.Tensor] = {}
    sorted_freq: dict[str, np.ndarray] = {}
    for b in blocks:
        order[b.name], sorted_freq[b.name] = _hot_first(b.freq)
    total_freq = float(sum(v.sum() for v in sorted_freq.values()))
    n_total = sum(b.n_ff for b in blocks)
    fixed = sum(fixed_bytes.values())
    notes: list[str] = []

    def result(hot: dict[str, int], fixed_on_gpu: bool, bound: float | None = None):
        gpu = (fixed if fixed_on_gpu else 0) + sum(hot[b.name] * b.bytes_per_neuron for b in blocks)
        if gpu > budget_bytes:  # cannot happen; checked because the promise is absolute
            raise RuntimeError(f"placement bug: {gpu} bytes placed > budget {budget_bytes}")
        served = sum(float(sorted_freq[b.name][: hot[b.name]].sum()) for b in blocks)
        all_hot = fixed_on_gpu and all(hot[b.name] == b.n_ff for b in blocks)
        if total_freq > 0:
            share = min(1.0, served / total_freq)
        else:
            share = 1.0 if all_hot else 0.0
        bound_share = share if bound is None else max(share, min(1.0, bound))
        placed = {b.name: _placed_order(order[b.name], hot[b.name]) for b in blocks}
        return PlacementResult(hot=hot, order=placed, gpu_bytes=gpu, fixed_on_gpu=fixed_on_gpu,
                               expected_gpu_share=share, notes=notes, share_bound=bound_share)

    none_hot = {b.name: 0 for b in blocks}
    if budget_bytes == 0:
        notes.append("gpu_budget is 0: nothing is placed on the GPU, everything runs on the CPU")
        return result(none_hot, False, 0.0)
    if fixed > budget_bytes:
        parts = ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in fixed_bytes.items() if v)
        notes.append(
            f"the non-FFN parts alone need {fixed:,} bytes ({parts}) > the budget "
            f"{budget_bytes:,} bytes, so everything runs on the CPU")
        return result(none_hot, False, 0.0)

    room = budget_bytes - fixed
    need_all = sum(b.n_ff * b.bytes_per_neuron for b in blocks)
    if need_all <= room:
        if n_total:
            notes.append(f"all {n_total:,} FFN neurons fit on the GPU")
        return result({b.name: b.n_ff for b in blocks}, True, None)

    hot, bound = _solve(room, blocks, sorted_freq, min_slice)
    res = result(hot, True, bound / total_freq if total_freq > 0 else None)
    placed = [b for b in blocks if hot[b.name]]
    n_hot = sum(hot.values())
    notes.append(
        f"{n_hot:,} of {n_total:,} FFN neurons hot in {len(placed)} of {len(blocks)} blocks; "
        f"expected GPU share of firings {res.expected_gpu_share:.1%} "
        f"(the optimum is at most {res.share_bound:.1%})")
    skipped = [b.name for b in blocks if not hot[b.name] and b.n_ff]
    if skipped and placed:
        notes.append(f"{len(skipped)} blocks get no hot neurons (a minimum slice of "
                     f"{min_slice} was not worth its bytes there): {', '.join(skipped[:4])}"
                     + (", ..." if len(skipped) > 4 else ""))
    return res


# -- decoder layers on the CPU, when the parts outside the FFN blocks do not fit ------------------

@dataclass
class LayerDemand:
    """One decoder layer as placement sees it: its share of the fixed items (the weights outside
    its FFN blocks, its KV cache, its predictors, its blocks' b_down) and its blocks' names."""

    name: str  # the layer's module name, e.g. "model.layers.39"
    fixed_bytes: dict[str, int]
    blocks: list[str]


def layer_demands(model: nn.Module, ffns: dict[str, SparseFFN], fixed: dict[str, int],
                  planned_bytes: dict[int, int] | None = None) -> list[LayerDemand]:
    """Each decoder layer's part of `fixed` (account's items, made with the same
    `planned_bytes`), in the model's layer order; [] for a model without a list of decoder
    layers (it then runs wholly on the GPU or the CPU)."""
    from picompile.passes.calibrate import LayerwiseUnsupported, decoder_layers

    try:
        layers = decoder_layers(model)
    except LayerwiseUnsupported:
        return []
    module_names = {id(m): n for n, m in model.named_modules()}
    kv = fixed.get("kv_cache", 0) // len(layers)
    demands = []
    for layer in layers:
        inside = {id(m) for m in layer.modules()}
        blocks = [n for n, f in ffns.items() if id(f) in inside]
        ffn_tensors = [t for n in blocks for t in _tensors_of(ffns[n])]
        ffn_ids = {id(t) for t in ffn_tensors}
        weights = _storage_bytes([t for t in [*layer.parameters(), *layer.buffers()]
                                  if id(t) not in ffn_ids],
                                 {_extent(t)[0] for t in ffn_tensors if t.numel()},
                                 planned_bytes)
        demands.append(LayerDemand(
            name=module_names[id(layer)], blocks=blocks,
            fixed_bytes={"non_ffn_weights": weights,
                         "predictors": _predictor_bytes(ffns[n] for n in blocks),
                         "kv_cache": kv,
                         "ffn_biases_down": sum(_nbytes(ffns[n].b_down) for n in blocks)}))
    return demands


def _layers(n: int) -> str:
    return f"{n} decoder layer{'s' if n != 1 else ''}"


def place_layers(*, budget_bytes: int, fixed_bytes: dict[str, int], blocks: list[BlockDemand],
                 layers: list[LayerDemand], min_slice: int = DEFAULT_MIN_SLICE
                 ) -> tuple[PlacementResult, list[str], dict[str, int]]:
    """`place`, and where the fixed parts exceed the budget, with the last decoder layers wholly
    on the CPU (attention and FFN, as llama.cpp's -ngl leaves layers): as few as it takes for the
    rest to fit. -> (result, the layers left on the CPU by module name, the fixed items the GPU
    holds: fixed_bytes less those layers' parts).

    Why whole layers, and as few as possible: a byte of a layer's attention on the GPU spares the
    CPU a byte read at every token, a byte of hot neurons only at the tokens they fire (freq <
    1), so the attention of a layer goes to the GPU before any neuron. At least one layer stays
    on the GPU; when even that does not fit, everything runs on the CPU (place's result)."""
    result = place(budget_bytes=budget_bytes, fixed_bytes=fixed_bytes, blocks=blocks,
                   min_slice=min_slice)
    if result.fixed_on_gpu or budget_bytes == 0 or len(layers) < 2:
        return result, [], dict(fixed_bytes)
    fixed = dict(fixed_bytes)
    host: list[LayerDemand] = []
    for layer in reversed(layers[1:]):
        host.insert(0, layer)
        for item, n in layer.fixed_bytes.items():
            fixed[item] = fixed.get(item, 0) - n
        if sum(fixed.values()) <= budget_bytes:
            break
    else:
        return result, [], dict(fixed_bytes)
    on_host = {name for layer in host for name in layer.blocks}
    inner = place(budget_bytes=budget_bytes, fixed_bytes=fixed, min_slice=min_slice,
                  blocks=[b for b in blocks if b.name not in on_host])
    # The share of firings over every block: the host layers' blocks serve none on the GPU.
    freq = {b.name: float(b.freq.sum()) for b in blocks}
    total = sum(freq.values())
    scale = sum(v for n, v in freq.items() if n not in on_host) / total if total > 0 else 0.0
    for b in blocks:
        if b.name in on_host:
            inner.hot[b.name] = 0
            inner.order[b.name] = torch.arange(b.n_ff)  # no hot neurons: the model's order
    inner.expected_gpu_share *= scale
    inner.share_bound *= scale
    parts = ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in fixed_bytes.items() if v)
    inner.notes.insert(0, (
        f"the non-FFN parts of all {len(layers)} layers need {sum(fixed_bytes.values()):,} bytes "
        f"({parts}) > the budget {budget_bytes:,}: the last {_layers(len(host))} "
        f"({host[0].name} on) run{'s' if len(host) == 1 else ''} wholly on the CPU, the other "
        f"{len(layers) - len(host)} on the GPU"))
    return inner, [layer.name for layer in host], fixed


# Local search: rounds of "flip one block's on/off decision, re-solve the rest", and how many
# blocks each round tries in either direction (those nearest the price).
SEARCH_ROUNDS = 4
SEARCH_CANDIDATES = 8
# Trades of neurons between blocks after the search (see _Solver.exchange).
EXCHANGE_ROUNDS = 16


@dataclass
class _Item:
    name: str
    density: np.ndarray  # freq / cost, sorted descending
    neg_density: np.ndarray  # -density, ascending (for searchsorted)
    prefix: np.ndarray  # [n + 1] prefix sums of the sorted freqs
    cost: int  # bytes per neuron
    m: int  # minimum slice
    theta: float  # mean density of the top m: the block is worth turning on below this price

    @property
    def n(self) -> int:
        return len(self.density)


class _Solver:
    """The placement problem of `place` over blocks with a cost; see its docstring."""

    def __init__(self, room: int, items: list[_Item]):
        self.room, self.items = room, items
        # Every price at which some choice changes; searching a superset of them is just as exact.
        self.breaks = np.unique(np.concatenate(
            [*(it.density for it in items), [it.theta for it in items], [0.0]]))[::-1]

    def choice(self, lam: float, state: list) -> list[int]:
        """The Lagrangian choice at price lam: per block the best of k = 0 and k >= m (ties: the
        smaller). state[i]: None free, True forced on, False forced off."""
        ks = []
        for it, s in zip(self.items, state):
            if s is False or (s is None and not it.theta > lam):
                ks.append(0)
            else:
                cnt = int(np.searchsorted(it.neg_density, -lam, side="left"))  # #{density > lam}
                ks.append(max(it.m, cnt))
        return ks

    def cost(self, ks: list[int]) -> int:
        return sum(k * it.cost for k, it in zip(ks, self.items))

    def value(self, ks: list[int]) -> float:
        return float(sum(it.prefix[k] for k, it in zip(ks, self.items)))

    def dual(self, lam: float) -> float:
        """lam * room + sum_b max(0, max_k F_b(k) - lam c_b k): at least any feasible value.
        k ranges over what a block could hold alone (m_b <= k <= room // c_b), which keeps the
        bound valid and tighter; by concavity the best such k is the free choice, clipped."""
        total = lam * self.room
        for k, it in zip(self.choice(lam, [None] * len(self.items)), self.items):
            k = min(k, self.room // it.cost)
            if k >= it.m:
                total += max(0.0, it.prefix[k] - lam * it.cost * k)
        return total

    def solve(self, state: list) -> tuple[list[int], float, int] | None:
        """(hot counts, price, index of the price in breaks), or None when the forced-on blocks'
        minimum slices alone do not fit."""
        fits = lambda j: self.cost(self.choice(float(self.breaks[j]), state)) <= self.room
        lo, hi = 0, len(self.breaks) - 1
        if not fits(lo):  # only forced-on slices can make even the highest price not fit
            return None
        if fits(hi):
            lo = hi
        while lo < hi:  # the lowest price (largest index) whose choice fits
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        lam = float(self.breaks[lo])
        ks = self.fill(self.choice(lam, state), state)
        return ks, lam, lo

    def fill(self, ks: list[int], state: list) -> list[int]:
        """Spend the leftover greedily by density: the next neurons of a placed block, or the
        minimum slice of an unplaced (not forced off) one. A neuron that does not fit ends its
        block (the next costs the same); so does a slice that does not fit."""
        ks = list(ks)
        left = self.room - self.cost(ks)
        heap: list[tuple[float, int, int]] = []  # (-density, 0 neuron / 1 slice, block)

        def push(i: int) -> None:
            it = self.items[i]
            if ks[i] == 0:
                if state[i] is not False and it.m * it.cost <= left:
                    heapq.heappush(heap, (-it.theta, 1, i))
            elif ks[i] < it.n and it.cost <= left:
                heapq.heappush(heap, (-float(it.density[ks[i]]), 0, i))

        for i in range(len(self.items)):
            push(i)
        while heap and left > 0:
            _, is_slice, i = heapq.heappop(heap)
            it = self.items[i]
            if is_slice:
                if it.m * it.cost > left:
                    continue
                ks[i], left = it.m, left - it.m * it.cost
            else:
                # A run: this block's next neurons down to the best density among the others.
                rest = it.neg_density[ks[i]:]
                run = int(np.searchsorted(rest, heap[0][0], side="right")) if heap else len(rest)
                run = min(max(run, 1), len(rest), left // it.cost)
                if run == 0:
                    continue
                ks[i], left = ks[i] + run, left - run * it.cost
            push(i)
        return ks

    def search(self) -> tuple[list[int], float]:
        """The Lagrangian + fill solution improved by flipping blocks on / off (each flip
        re-solves the rest with the flipped blocks forced); returns (hot counts, dual upper bound
        on the optimum's value). A round tries single flips first, then pairs of them when no
        single flip gains: turning one block's slice on often needs another's turned off."""
        free = [None] * len(self.items)
        ks, lam, j = self.solve(free)
        bound = self.dual(lam)
        if j + 1 < len(self.breaks):
            bound = min(bound, self.dual(float(self.breaks[j + 1])))
        best, best_value, state = ks, self.value(ks), free
        for _ in range(SEARCH_ROUNDS):
            if best_value >= bound * (1 - 1e-12):
                break  # provably optimal already
            its = self.items
            off = [i for i in range(len(its)) if state[i] is None and best[i] == 0
                   and its[i].m * its[i].cost <= self.room]
            on = [i for i in range(len(its)) if state[i] is None and best[i] > 0]
            off.sort(key=lambda i: -its[i].theta)  # most nearly worth a slice first
            on.sort(key=lambda i: its[i].prefix[best[i]] - lam * its[i].cost * best[i])
            candidates = off[:SEARCH_CANDIDATES] + on[:SEARCH_CANDIDATES]
            found = None
            for flips in (itertools.combinations(candidates, 1),
                          itertools.combinations(candidates, 2)):
                for group in flips:
                    trial = list(state)
                    for i in group:
                        trial[i] = best[i] == 0
                    solved = self.solve(trial)
                    if solved is None:
                        continue
                    v = self.value(solved[0])
                    if v > best_value * (1 + 1e-12) and (found is None or v > found[0]):
                        found = (v, solved, trial)
                if found is not None:
                    break
            if found is None:
                break
            best_value, (best, lam, _), state = found[0], found[1], found[2]
        best = self.exchange(best, state)
        return best, max(bound, self.value(best))

    def exchange(self, ks: list[int], state: list) -> list[int]:
        """Trade the least frequent hot neurons of one block for the next step of another (its
        next neuron, or its minimum slice) that the leftover is too small for, while a trade
        gains; refill after each. This mends the knapsack's integer effects that pricing cannot
        see (a leftover of 1 byte and a next neuron of 2: give up a 1-byte neuron of another)."""
        its = self.items
        for _ in range(EXCHANGE_ROUNDS):
            left = self.room - self.cost(ks)
            trade = None  # (gain, giver, neurons given, taker, neurons taken)
            for j, tj in enumerate(its):
                if ks[j] == 0 and state[j] is not False:
                    step = tj.m
                elif 0 < ks[j] < tj.n:
                    step = 1
                else:
                    continue
                need = step * tj.cost - left  # > 0: fill took every step that fits
                if need <= 0:
                    continue
                gain = tj.prefix[ks[j] + step] - tj.prefix[ks[j]]
                for i, ti in enumerate(its):
                    if i == j or ks[i] == 0:
                        continue
                    give = -(-need // ti.cost)
                    rest = ks[i] - give
                    if rest < 0 or (rest == 0 and state[i] is True) or 0 < rest < ti.m:
                        continue
                    net = gain - (ti.prefix[ks[i]] - ti.prefix[rest])
                    if net > 1e-12 * max(1.0, gain) and (trade is None or net > trade[0]):
                        trade = (net, i, give, j, step)
            if trade is None:
                break
            _, i, give, j, step = trade
            ks = list(ks)
            ks[i] -= give
            ks[j] += step
            ks = self.fill(ks, state)
        return ks


def _solve(room: int, blocks: list[BlockDemand], sorted_freq: dict[str, np.ndarray],
           min_slice: int) -> tuple[dict[str, int], float]:
    """Hot counts within `room` bytes (see `place`), and an upper bound on the optimum's value."""
    hot = {b.name: 0 for b in blocks}
    free_value = 0.0
    items = []
    for b in blocks:
        f = sorted_freq[b.name]
        if b.n_ff == 0:
            continue
        if b.bytes_per_neuron == 0:  # free: all hot
            hot[b.name] = b.n_ff
            free_value += float(f.sum())
            continue
        c, m = b.bytes_per_neuron, max(1, min(min_slice, b.n_ff))
        if m * c > room:  # not even its minimum slice fits: never hot
            continue
        prefix = np.concatenate([[0.0], np.cumsum(f)])
        d = f / c
        items.append(_Item(b.name, d, -d, prefix, c, m, float(prefix[m] / (m * c))))
    if not items:
        return hot, free_value
    ks, bound = _Solver(room, items).search()
    for k, it in zip(ks, items):
        hot[it.name] = k
    return hot, bound + free_value


# -- permuting a block's neurons ---------------------------------------------------------------

def _per_neuron_tensors(ffn: SparseFFN) -> list[tuple[str, torch.Tensor]]:
    n = ffn.n_ff
    out: list[tuple[str, torch.Tensor]] = []
    seen: set = set()

    def add(name: str, t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        # The same memory reached twice (one tensor, or two identical views) is permuted once.
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) if t.numel() else id(t)
        if key in seen:
            return
        if t.dim() == 0 or t.shape[0] != n:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [n_ff={n}, ...]")
        seen.add(key)
        out.append((name, t))

    for name in FFN_ROW_TENSORS:
        add(name, getattr(ffn, name, None))
    pred = getattr(ffn, "predictor", None)
    if pred is not None:
        for name in PREDICTOR_ROW_TENSORS:
            add(f"predictor.{name}", getattr(pred, name, None))
        add("predictor.freq", getattr(pred, "freq", None))
    add("freq", getattr(ffn, "freq", None))
    for name, buf in ffn.named_buffers():
        if name.rsplit(".", 1)[-1] == "freq":
            add(name, buf)
    return out


@torch.no_grad()
def apply_order(ffn: SparseFFN, order: torch.Tensor) -> None:
    """Permute `ffn`'s neurons in place: new neuron i is old neuron order[i]. Rows of w_gate, w_up,
    w_down_t, entries of b_gate and b_up, the predictor's p2 rows and pb2 entries, and any
    per-neuron buffer named `freq`. The block computes the same function afterwards (the down
    projection sums over neurons); its predictor's output columns follow the new order.

    The tensors are overwritten in place (their storage is kept, so aliases see the new order),
    and a bound C kernel is re-bound to them."""
    n = ffn.n_ff
    if not isinstance(order, torch.Tensor) or order.dim() != 1 or order.numel() != n:
        shape = tuple(order.shape) if isinstance(order, torch.Tensor) else type(order).__name__
        raise ValueError(f"order must be a 1-D tensor of length n_ff={n}, got {shape}")
    if order.is_floating_point() or order.dtype == torch.bool:
        raise ValueError(f"order must be an integer tensor, got {order.dtype}")
    order = order.detach().to("cpu", torch.long)
    if not torch.equal(torch.sort(order).values, torch.arange(n)):
        raise ValueError(f"order must be a permutation of 0..{n - 1}")
    if torch.equal(order, torch.arange(n)):
        return
    for _, t in _per_neuron_tensors(ffn):
        t.copy_(t.index_select(0, order.to(t.device)))
    if getattr(ffn, "kernel", None) is not None:
        ffn.select_kernel()
