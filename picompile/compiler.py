"""The compiler: runs the passes in order and wraps the result.

    capture -> detect -> rewrite -> calibrate (thresholds, measured sparsity) -> select kernels
"""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from picompile.budget import parse_budget
from picompile.capture import capture, replace_module
from picompile.passes import calibrate as calibrate_pass
from picompile.passes import rewrite as rewrite_pass
from picompile.passes.detect import detect
from picompile.plan import MODES, Plan, Unmatched
from picompile.runtime.sparse_ffn import SparseFFN


class CompiledModel(nn.Module):
    """The model with its FFN blocks rewritten. Called and `.generate(...)`d like the model it
    wraps; every other attribute (config, device, ...) is the wrapped model's."""

    def __init__(self, model: nn.Module, plan: Plan, graphs: dict[str, fx.GraphModule],
                 paths: dict[str, str]):
        super().__init__()
        self.model = model
        self.plan = plan
        # The rewritten graphs by module name. They are submodules of `model` already, so keep
        # them out of nn.Module's registry (no double counting in state_dict / parameters).
        object.__setattr__(self, "graphs", graphs)
        self.paths = paths  # block name -> execution path picked ("C", "reference (...)")

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def generate(self, *args, **kwargs):
        if not hasattr(self.model, "generate"):
            raise TypeError(f"{type(self.model).__name__} has no generate(); call the model instead")
        return self.model.generate(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("model"), name)

    def ffns(self) -> dict[str, SparseFFN]:
        """Block name -> its SparseFFN module."""
        return {ffn.block.name: ffn for ffn in self.model.modules() if isinstance(ffn, SparseFFN)}

    def reset_stats(self) -> None:
        for ffn in self.ffns().values():
            ffn.reset_stats()

    def sparsity(self) -> float | None:
        """Share of (token, neuron) pairs skipped since the last reset_stats(), over all blocks."""
        active = total = 0
        for ffn in self.ffns().values():
            active, total = active + ffn.active_pairs, total + ffn.total_pairs
        return None if total == 0 else 1.0 - active / total


def _check_args(model, mode, sparsity, gpu_budget) -> int | None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"picompile.compile needs a torch.nn.Module, got {type(model).__name__}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(map(repr, MODES))}")
    if sparsity is not None:
        if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0 <= sparsity < 1:
            raise ValueError(f"sparsity must be a number in [0, 1), got {sparsity!r}")
    budget = parse_budget(gpu_budget)
    if mode == "predicted":
        raise NotImplementedError(
            "mode='predicted' (trained predictors) is not available yet; use mode='exact'"
        )
    return budget


def compile(
    model: nn.Module,
    *,
    gpu_budget: int | str | None = None,
    mode: str = "exact",
    sparsity: float | None = None,
    calibration=None,
    tokenizer=None,
    quiet: bool = False,
) -> CompiledModel:
    """Compile `model` (rewritten in place) into activation-sparse FFN blocks.

    mode="exact": ReLU blocks compute only the neurons that fire, losslessly. SiLU/GELU blocks
    stay dense unless `sparsity` is given; then a per-block threshold on |down input|,
    calibrated on `calibration` (token ids, or strings with `tokenizer`), skips that share.
    """
    budget = _check_args(model, mode, sparsity, gpu_budget)
    model.eval()
    plan = Plan(mode=mode, target_sparsity=sparsity)
    plan.placement.budget_bytes = budget

    # capture + detect: the deepest traceable modules that hold FFN blocks
    detections = {}

    def holds_block(name: str, gm: fx.GraphModule) -> bool:
        detections[name] = found = detect(gm)
        return bool(found.matches)

    captured, eager = capture(model, holds_block)
    plan.unmatched += [Unmatched(u.name, u.reason) for u in eager]
    plan.unmatched += [Unmatched(name, why) for name, found in detections.items() for why in found.rejected]

    # rewrite: one SparseFFN node per block
    graphs: dict[str, fx.GraphModule] = {}
    ffns: dict[str, SparseFFN] = {}
    for cap in captured:
        found = detections[cap.name]
        for i, match in enumerate(found.matches):
            attr = "sparse_ffn" if len(found.matches) == 1 else f"sparse_ffn_{i}"
            block_name = f"{cap.name}.{attr}" if cap.name else attr
            block = rewrite_pass.block_plan(cap.gm, match, cap.name, block_name)
            ffns[block_name] = rewrite_pass.rewrite(cap.gm, match, block, attr)
            plan.blocks.append(block)
        rewrite_pass.finish(cap.gm)
        graphs[cap.name] = cap.gm
        model = replace_module(model, cap.name, cap.gm)
    if not ffns:
        reasons = "; ".join(f"{u.module}: {u.reason}" for u in plan.unmatched[:5]) or (
            "no linear -> activation -> linear pattern anywhere in the traced graphs")
        raise ValueError(
            f"picompile found no FFN block in {type(model).__name__} ({reasons}). Supported: "
            "down(act(up x)), down(act(gate x) * up x), dReLU, fused gate_up; act in relu, silu, gelu"
        )

    # calibrate: thresholds for SiLU/GELU blocks, measured sparsity for all
    needs_threshold = sparsity and any(not b.exact for b in plan.blocks)
    if calibration is None and needs_threshold:
        raise ValueError(
            f"sparsity={sparsity} needs calibration data for the SiLU/GELU blocks' thresholds: "
            "pass calibration= (a LongTensor of token ids, or strings with tokenizer=)"
        )
    if calibration is not None:
        ids = calibrate_pass.calibration_ids(calibration, tokenizer)
        plan.calibration_tokens = int(ids.numel())
        calibrate_pass.calibrate(model, ffns, ids, sparsity, quiet=quiet)

    # kernels: picked once per block
    paths = {name: ffn.select_kernel() for name, ffn in ffns.items()}
    return CompiledModel(model, plan, graphs, paths)


def explain(cm: CompiledModel) -> str:
    """A readable report: per block what was found and decided; what was left dense, and why."""
    if not isinstance(cm, CompiledModel):
        raise TypeError(f"explain() takes a CompiledModel, got {type(cm).__name__}")
    plan, ffns = cm.plan, cm.ffns()
    lines = [f"picompile: {len(plan.blocks)} FFN blocks, mode={plan.mode}"
             + (f", target sparsity {plan.target_sparsity:.0%}" if plan.target_sparsity else "")
             + (f", calibrated on {plan.calibration_tokens} tokens" if plan.calibration_tokens else "")]
    header = f"  {'block':<36} {'kind':<6} {'act':<9} {'d x n_ff':<12} {'how':<16} {'calib.':>7} {'run':>7}  path"
    lines.append(header)

    def pct(v):
        return "-" if v is None else f"{v:.1%}"

    for b in plan.blocks:
        how = "exact" if b.threshold == 0 else f"|h|>{b.threshold:.3g}"
        if not b.exact and b.threshold == 0:
            how = "dense"
        ffn = ffns.get(b.name)
        run = pct(ffn.sparsity if ffn is not None else None)
        bias = "+b" if b.bias else ""
        lines.append(f"  {b.name:<36} {b.kind + bias:<6} {b.act:<9} {f'{b.d_model}x{b.d_ff}':<12} "
                     f"{how:<16} {pct(b.measured_sparsity):>7} {run:>7}  {cm.paths.get(b.name, '-')}")
    lines.append("  (calib.: sparsity measured on calibration data; run: sparsity since reset_stats())")
    if plan.unmatched:
        lines.append("not matched (left dense):")
        lines += [f"  {u.module or '<model>'}: {u.reason}" for u in plan.unmatched]
    return "\n".join(lines)

