"""explain(cm): what compile found and decided, as text: per block its kind, sparsity, predictor
and placement, the weights by format, which decode path runs, and what was left dense and why."""

from __future__ import annotations

import re

from picompile.compiled_model import CompiledModel
from picompile.runtime.dense_linear import DenseLinear, QuantLinear
from picompile.runtime.sparse_ffn import SparseFFN, dtype_name


def _weights_line(cm: CompiledModel) -> str:
    """Bytes of the weights by role and format: "FFN q4_0 12,345 B (30 blocks); ...", an FFN
    format "q4_1 (down q8_0)" where the down rows have their own. A tensor shared by several
    modules (tied weights) counts once."""
    groups: dict[tuple[str, str], list[int]] = {}  # (role, format) -> [modules, bytes]
    seen: set[int] = set()

    def add(role, fmt, tensors):
        tensors = [t for t in tensors if t is not None and id(t) not in seen]
        seen.update(id(t) for t in tensors)
        g = groups.setdefault((role, fmt), [0, 0])
        g[0] += 1
        g[1] += sum(t.numel() * t.element_size() for t in tensors)

    for m in cm._orig_mod.modules():
        if isinstance(m, SparseFFN):
            fmt = getattr(m, "qformat", None) or dtype_name(m.w_up.dtype)
            if m.down_format != fmt:
                fmt = f"{fmt} (down {m.down_format})"
            add("FFN", fmt, [m.w_gate, m.w_up, m.w_down_t])
        elif isinstance(m, QuantLinear):
            add("linear", m.qformat, [m.qweight])
        elif isinstance(m, DenseLinear):
            add("linear", dtype_name(m.weight.dtype), [m.weight])
    rest: dict[str, int] = {}  # everything else (embeddings, norms, biases, eager layers)
    for t in list(cm._orig_mod.parameters()) + list(cm._orig_mod.buffers()):
        if id(t) not in seen and t.is_floating_point():
            seen.add(id(t))
            rest[dtype_name(t.dtype)] = rest.get(dtype_name(t.dtype), 0) + t.numel() * t.element_size()
    parts = [f"{role} {fmt} {b:,} B ({n} {'block' if role == 'FFN' else 'layer'}{'s' * (n != 1)})"
             for (role, fmt), (n, b) in groups.items()]
    parts += [f"other {fmt} {b:,} B" for fmt, b in rest.items()]
    return "; ".join(parts)


def explain(cm: CompiledModel) -> str:
    """A readable report: per block what was found and decided; what was left dense, and why."""
    if not isinstance(cm, CompiledModel):
        raise TypeError(f"explain() takes a CompiledModel, got {type(cm).__name__}")
    plan, ffns = cm.plan, cm.ffns()
    predicted = plan.mode == "predicted"
    placed = plan.placement.budget_bytes is not None

    def pct(v):
        return "-" if v is None else f"{v:.1%}"

    head = f"picompile: {len(plan.blocks)} FFN blocks, mode={plan.mode}"
    if plan.applied_sparsity:
        head += f", target sparsity {plan.applied_sparsity:.0%}"
    if plan.calibration_tokens:
        head += f", calibrated on {plan.calibration_tokens} tokens"
    cols = (f"  {'block':<34} {'kind':<10} {'act':<9} {'d x n_ff':<11} {'skips':<14} "
            f"{'calib.':>6} {'run':>6}")
    if predicted:
        cols += (f" {'rank':>5} {'recall':>7} {'pred/true density':>17} {'pred.bytes':>10}"
                 f" {'B/token exact->pred':>21} {'us exact->pred':>14} {'used':>4}")
    if placed:
        cols += f" {'hot':>6}"
    lines = [head, cols + "  path"]
    for b in plan.blocks:
        how = "exact zeros" if b.decided.threshold == 0 else f"|h|<={b.decided.threshold:.3g}"
        if not b.exact and b.decided.threshold == 0:
            how = "none (dense)"
        ffn = ffns.get(b.name)
        row = (f"  {b.name:<34} {b.kind + ('+bias' if b.bias else ''):<10} {b.act:<9} "
               f"{f'{b.d_model}x{b.d_ff}':<11} {how:<14} {pct(b.measured.sparsity):>6} "
               f"{pct(ffn.sparsity if ffn is not None else None):>6}")
        if predicted:
            dens = f"{pct(b.measured.predicted_density)} / {pct(b.measured.true_density)}"
            row += f" {b.decided.predictor_rank or '-':>5} {pct(b.measured.predictor_recall):>7} {dens:>17} {b.measured.predictor_bytes:>10}"
            used = "yes" if ffn is not None and ffn.predictor is not None and ffn.predictor.enabled else "no"
            row += (f" {f'{b.measured.decode_bytes_exact:,}->{b.measured.decode_bytes_predicted:,}':>21}"
                    f" {f'{b.measured.decode_us_exact:.0f}->{b.measured.decode_us_predicted:.0f}':>14} {used:>4}")
        if placed:
            row += f" {b.decided.hot_neurons:>6}"
        lines.append(row + f"  {cm.paths.get(b.name, '-')}")
    lines.append("  calib.: sparsity measured on calibration data; run: since the last reset_stats()")
    if cm.linear_paths:
        by_path: dict[str, int] = {}
        for name, path in cm.linear_paths.items():
            # the layer's own path now (a dtype change or distribute selects its kernel again);
            # compile's reason for a layer it left as nn.Linear
            path = getattr(cm._orig_mod.get_submodule(name), "path", path)
            by_path[path] = by_path.get(path, 0) + 1
        lines.append("other linears (attention, LM head): " +
                     "; ".join(f"{n} {path}" for path, n in by_path.items()))
    lines.append("weights: " + _weights_line(cm))
    lines += [f"  quantization: {n}" for n in cm.quant_notes]
    lines.append("decode step: " + (cm._decoder.describe() if cm._decoder is not None else
                                    f"per module in PyTorch (whole-step decoder: {cm.decoder_reason})"))
    lines.append("whole-model graph: " + ("not captured (cm.capture_steps() exports it)"
                                          if cm.step_graphs is None else cm.step_graphs.line(cm._orig_mod)))
    if predicted:
        lines.append(f"  B/token: weight bytes read per decoded token; us: measured microseconds "
                     f"per decoded token; used: the block runs its predictor "
                     f"(predictors='{plan.predictors}')")
    if placed:
        p = plan.placement
        lines.append(f"placement: budget {p.budget_bytes:,} B, on the GPU {p.gpu_bytes:,} B, "
                     f"expected share of firing neurons on the GPU {p.expected_gpu_share:.1%}")
        lines += [f"  {item}: {n:,} B" for item, n in p.fixed_bytes.items()]
        if not p.fixed_on_gpu:
            lines.append("  the non-FFN parts do not fit the budget: they run on the CPU too")
        lines += [f"  note: {n}" for n in p.notes]
    if plan.unmatched:
        lines.append("not captured as fx graphs (they run as the model's own modules, their "
                     "linear layers on the kernels above; FFN blocks among them stay dense):")
        groups: dict[tuple[str, str], int] = {}  # (module name with layer numbers as *, reason)
        for u in plan.unmatched:
            key = (re.sub(r"\.\d+(?=\.|$)", ".*", u.module) or "<model>", u.reason)
            groups[key] = groups.get(key, 0) + 1
        lines += [f"  {name}{f' (x{n})' if n > 1 else ''}: {reason}"
                  for (name, reason), n in groups.items()]
    return "\n".join(lines)
