"""`picompile report` and `cm.report(path)`: one self-contained HTML file that shows why a
compiled model is fast or slow, with plots rather than columns of numbers.

Sections, each from what compile measured or decided (a section without data says why):

    firing      per-block neuron firing frequency, sorted: the power law PowerInfer builds on
                (compile's profile, cm.firing: mode="predicted" or a gpu_budget)
    placement   the hot/cold split of each block against the GPU budget (plan.placement)
    predictors  recall and predicted vs true density per block (mode="predicted")
    throughput  FFN weight bytes read per token (the decode kernel's row reads at the measured
                density) and decode tokens/s of a short greedy decode run here

Plots are drawn on matplotlib's Agg canvas (a Figure without pyplot: no display, no global
state) and embedded as base64 PNGs, so the file can be mailed or attached as is. It is written
to a temporary file beside `path` and renamed over it: a reader never sees half a report.
"""

from __future__ import annotations

import base64
import html
import importlib.util
import io
import os
import pathlib
import re
import secrets
import time

import numpy as np
import torch

from picompile.passes.place import neuron_bytes
from picompile.passes.predictors import exact_decode_bytes
from picompile.saving import protected


def check_output(path) -> pathlib.Path:
    """The report's path, after checking that a file can be written there: called before
    anything slow, so a typo costs no compile."""
    p = pathlib.Path(path)
    parent = p.parent
    if p.is_dir():
        raise IsADirectoryError(f"{p}: is a directory; give a file name for the report, "
                                f"e.g. {p / 'report.html'}")
    if not parent.exists():
        raise FileNotFoundError(f"{p}: cannot write the report, directory {parent} does not "
                                "exist; create it first or give another path")
    if not parent.is_dir():
        raise NotADirectoryError(f"{p}: cannot write the report, {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{p}: cannot write the report, no write permission in {parent}")
    if protected(p):
        raise PermissionError(f"{p}: the file is read-only; picompile does not replace it: make "
                              "it writable (chmod u+w) or give another path")
    return p


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError("picompile report draws its plots with matplotlib: "
                          "pip install 'picompile[report]'")


def report(cm, path, *, prompt_ids: torch.Tensor | None = None, decode_tokens: int = 32
           ) -> pathlib.Path:
    """Write the HTML report of `cm` (a CompiledModel) to `path`; returns the path.

    prompt_ids [1, T]: what the timed decode starts from (default: the model's BOS token, or
    token 0 without one). decode_tokens: how many tokens it generates; 0 measures nothing.
    The decode resets cm's statistics (cm.sparsity() then gives the decode's sparsity)."""
    from picompile.compiled_model import CompiledModel
    from picompile.explain import explain

    if not isinstance(cm, CompiledModel):
        raise TypeError(f"report() takes a CompiledModel, got {type(cm).__name__}")
    if isinstance(decode_tokens, bool) or not isinstance(decode_tokens, int) or decode_tokens < 0:
        raise ValueError(f"decode_tokens must be an int >= 0, got {decode_tokens!r}")
    path = check_output(path)
    require_matplotlib()

    names = {b.name: n for b, n in zip(cm.plan.blocks, _short_names(cm.plan.blocks))}
    decode = _measure_decode(cm, prompt_ids, decode_tokens)
    body = [_header(cm),
            _firing_section(cm, names),
            _placement_section(cm, names),
            _predictor_section(cm, names),
            _throughput_section(cm, names, decode),
            f"<h2>explain()</h2>\n<details><summary>the plan as text</summary>"
            f"<pre>{html.escape(explain(cm))}</pre></details>"]
    _write_atomic(path, _PAGE.format(body="\n".join(body)))
    return path


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>picompile report</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em;
       color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
img {{ max-width: 100%; }}
.none {{ color: #a15c00; }}
pre {{ font-size: 0.8em; overflow-x: auto; }}
</style>
</head>
<body>
{body}
</body>
</html>
"""


# -- sections -----------------------------------------------------------------------------------

def _header(cm) -> str:
    plan = cm.plan
    source = getattr(getattr(cm._orig_mod, "config", None), "_name_or_path", "")
    rows = [("model", type(cm._orig_mod).__name__ + (f" ({source})" if source else "")),
            ("FFN blocks", str(len(plan.blocks))),
            ("mode", plan.mode),
            ("target sparsity", f"{plan.applied_sparsity:.0%}" if plan.applied_sparsity else "none"),
            ("calibration tokens", f"{plan.calibration_tokens:,}" if plan.calibration_tokens
             else "none (no calibration data)"),
            ("decode step", cm._decoder.describe() if cm._decoder is not None
             else f"per module in PyTorch ({cm.decoder_reason})"),
            ("written", time.strftime("%Y-%m-%d %H:%M:%S"))]
    if plan.mode == "predicted":
        rows.insert(4, ("predictors", plan.predictors))
    return "<h1>picompile report</h1>\n" + _table(["", ""], rows, head=False)


def _top10_share(f: np.ndarray) -> float:
    """The share of a block's firings on its most frequent 10% of neurons."""
    s = np.sort(f)[::-1]
    return float(s[: int(np.ceil(0.1 * len(s)))].sum() / s.sum())


def _firing_section(cm, names: dict[str, str]) -> str:
    out = ['<h2 id="firing">Neuron firing frequency</h2>']
    freqs = {b.name: cm.firing[b.name].double().numpy() for b in cm.plan.blocks if b.name in cm.firing}
    if not freqs:
        return out[0] + _none(
            "No firing profile: compile profiles each neuron only for mode='predicted' or a "
            "gpu_budget (--mode predicted or --gpu-budget), and a plan loaded from disk does not "
            "carry it. Compile with one of them to see this plot.")
    top10 = {name: _top10_share(f) for name, f in freqs.items() if f.sum() > 0}
    measured = (f" Here the most frequent 10% of a block's neurons carry "
                f"{min(top10.values()):.0%} to {max(top10.values()):.0%} of its firings (10% if "
                "all fired alike)." if top10 else "")
    out.append(f"<p>Share of the {cm.plan.calibration_tokens:,} calibration tokens on which each "
               "neuron fired (|down input| above the block's threshold), neurons sorted from "
               "most to least frequent. PowerInfer counts on a skew, a few neurons firing on "
               "most tokens and most rarely, to put the hot ones on the GPU and leave the cold "
               f"on the CPU.{measured}</p>")
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    by_rank, cumulative = fig.subplots(1, 2)
    norm = Normalize(0, max(len(freqs) - 1, 1))
    cmap = colormaps["viridis"]
    hot = {b.name: b.decided.hot_neurons for b in cm.plan.blocks}
    placed = cm.plan.placement.budget_bytes is not None
    rows = []
    for i, (name, f) in enumerate(freqs.items()):
        s = np.sort(f)[::-1]
        n = len(s)
        color = cmap(norm(i))
        rank = np.arange(1, n + 1)
        by_rank.plot(rank[s > 0], s[s > 0], color=color, lw=1, label=names[name])
        total = s.sum()
        if total > 0:
            share = np.concatenate([[0.0], np.cumsum(s) / total])
            cumulative.plot(np.arange(n + 1) / n * 100, share * 100, color=color, lw=1)
            if placed and hot[name]:  # placement put this block's most frequent neurons hot
                cumulative.plot(hot[name] / n * 100, share[hot[name]] * 100, "o", color=color)
            carry80 = int(np.searchsorted(share, 0.8)) / n
            rows.append((names[name], f"{float(s.mean()):.1%}", f"{float((s > 0).mean()):.1%}",
                         f"{top10[name]:.1%}", f"{carry80:.1%}"))
        else:
            rows.append((names[name], "0.0%", "0.0%", "-", "-"))
    by_rank.set(xscale="log", yscale="log", xlabel="neuron rank (most frequent first)",
                ylabel="firing frequency (share of tokens)", title="sorted, log-log")
    cumulative.plot([0, 100], [0, 100], color="#999", ls="--", lw=1, label="every neuron alike")
    cumulative.set(xlabel="% of the block's neurons (most frequent first)",
                   ylabel="% of the block's firings", title="cumulative", xlim=(0, 100), ylim=(0, 100))
    if placed:
        cumulative.plot([], [], "o", color="#555", label="hot / cold boundary")
    cumulative.legend(loc="lower right")
    if len(freqs) <= 8:
        by_rank.legend(title="block", fontsize="small")
    else:
        bar = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=[by_rank, cumulative])
        bar.set_label("block index (model order)")
    out.append(_img(fig, "per-block neuron firing frequency, sorted"))
    out.append(_table(["block", "mean density", "neurons that ever fired",
                       "firings on the hottest 10%", "neurons carrying 80% of firings"], rows))
    return "\n".join(out)


def _placement_section(cm, names: dict[str, str]) -> str:
    p = cm.plan.placement
    out = ['<h2 id="placement">Hot / cold split against the GPU budget</h2>']
    if p.budget_bytes is None:
        return out[0] + _none(
            "No GPU budget was given (gpu_budget= / --gpu-budget): nothing was placed, every "
            "neuron runs on the CPU.")
    ffns = cm.ffns()
    blocks = cm.plan.blocks
    hot_bytes = sum(b.decided.hot_neurons * neuron_bytes(ffns[b.name]) for b in blocks if b.name in ffns)
    fixed = sum(p.fixed_bytes.values()) if p.fixed_on_gpu else 0
    running = any(f.hybrid is not None for f in ffns.values())
    out.append(f"<p>Budget {_mb(p.budget_bytes)}; the plan puts {_mb(p.gpu_bytes)} on the GPU: "
               f"{_mb(fixed)} of non-FFN parts and {_mb(hot_bytes)} of hot neurons. Expected share "
               f"of firing neurons served by the GPU: {p.expected_gpu_share:.1%}. "
               + ("Running hybrid now (hot neurons on the GPU)." if running else
                  "Planned only: this compiled model runs on the CPU.") + "</p>")
    if not p.fixed_on_gpu:
        out.append(_none("The non-FFN parts do not fit the budget: nothing is on the GPU."))
    elif p.host_layers:
        n = len(p.host_layers)
        out.append(f"<p>The attention of every layer does not fit the budget: the last {n} "
                   f"decoder layer{'s' if n > 1 else ''} ({html.escape(p.host_layers[0])} on) "
                   f"run{'' if n > 1 else 's'} wholly on the CPU, between the GPU's segments of "
                   "each step.</p>")
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, max(3.0, 0.28 * len(blocks) + 1.5)), layout="constrained")
    split, budget = fig.subplots(1, 2, width_ratios=(3, 2))
    labels = [names[b.name] for b in blocks]
    hot = np.array([b.decided.hot_neurons for b in blocks])
    cold = np.array([b.d_ff - b.decided.hot_neurons for b in blocks])
    y = np.arange(len(blocks))
    split.barh(y, hot, color="#d62728", label="hot (GPU)")
    split.barh(y, cold, left=hot, color="#1f77b4", label="cold (CPU)")
    split.set(yticks=y, yticklabels=labels, xlabel="neurons", title="neurons per block",
              xlim=(0, 1.3 * max(b.d_ff for b in blocks)))  # room for the legend
    split.invert_yaxis()
    split.legend(loc="lower right")
    parts = [(k, v) for k, v in p.fixed_bytes.items() if v and p.fixed_on_gpu]
    grays = colormaps["Greys"](np.linspace(0.25, 0.75, max(len(parts), 1)))
    left = 0.0
    for (item, n), color in [*zip(parts, grays), (("hot neurons", hot_bytes), "#d62728")]:
        budget.barh([0], [n / 1e6], left=left, color=color, edgecolor="white", label=item)
        left += n / 1e6
    budget.axvline(p.budget_bytes / 1e6, color="k", ls="--", lw=1.5, label="budget")
    budget.set(yticks=[], xlabel="MB", title="GPU bytes planned",
               xlim=(0, max(left, p.budget_bytes / 1e6) * 1.05 or 1))
    budget.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize="small")
    out.append(_img(fig, "hot and cold neurons per block, GPU bytes against the budget"))
    rows = [(item, f"{n:,}") for item, n in p.fixed_bytes.items()]
    rows += [("hot neurons", f"{hot_bytes:,}"), ("planned on the GPU", f"{p.gpu_bytes:,}"),
             ("budget", f"{p.budget_bytes:,}")]
    out.append(_table(["item", "bytes"], rows))
    out += [f"<p>note: {html.escape(n)}</p>" for n in p.notes]
    return "\n".join(out)


def _predictor_section(cm, names: dict[str, str]) -> str:
    out = ['<h2 id="predictors">Predictors</h2>']
    blocks = [b for b in cm.plan.blocks if b.decided.predictor_rank is not None]
    if not blocks:
        why = ("mode='exact' trains none (--mode predicted does)" if cm.plan.mode == "exact"
               else "no block has one")
        return out[0] + _none(f"No predictors: {why}.")
    ffns = cm.ffns()
    out.append("<p>Per block, on held-out calibration samples: recall (share of the neurons that "
               "fire which the predictor picks) and the share of neurons predicted to fire against "
               "the share that really fire. A predicted density close to the true one means few "
               "neurons computed for nothing.</p>")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 3.8), layout="constrained")
    recall, density = fig.subplots(1, 2)
    x = np.arange(len(blocks))
    labels = [names[b.name] for b in blocks]
    bars = recall.bar(x, [b.measured.predictor_recall for b in blocks], color="#2ca02c")
    if len(blocks) <= 12:
        recall.bar_label(bars, fmt="%.3f", fontsize="small")
    recall.set(ylim=(0, 1.05), ylabel="recall", title="predictor recall")
    density.bar(x - 0.2, [b.measured.predicted_density for b in blocks], 0.4, label="predicted", color="#ff7f0e")
    density.bar(x + 0.2, [b.measured.true_density for b in blocks], 0.4, label="true", color="#1f77b4")
    density.set(ylabel="share of neurons", title="predicted vs true density")
    density.legend()
    for ax in (recall, density):
        ax.set_xticks(x, labels, rotation=90 if len(blocks) > 8 else 0, fontsize="small")
    out.append(_img(fig, "predictor recall and predicted vs true density per block"))
    rows = []
    for b in blocks:
        ffn = ffns.get(b.name)
        used = ffn is not None and ffn.predictor is not None and ffn.predictor.enabled
        timed = (f"{b.measured.decode_us_exact:.0f} -> {b.measured.decode_us_predicted:.0f}"
                 if b.measured.decode_us_exact > 0 else "not timed")
        rows.append((names[b.name], str(b.decided.predictor_rank), f"{b.measured.predictor_recall:.1%}",
                     f"{b.measured.predicted_density:.1%}", f"{b.measured.true_density:.1%}",
                     f"{b.measured.predictor_bytes:,}", timed, "yes" if used else "no"))
    out.append(_table(["block", "rank", "recall", "predicted density", "true density",
                       "predictor bytes", "µs/token exact -> predicted", "runs"], rows))
    return "\n".join(out)


def _throughput_section(cm, names: dict[str, str], decode: dict | str) -> str:
    out = ['<h2 id="throughput">Bytes per token and tokens per second</h2>']
    ffns = cm.ffns()
    rows, totals = [], [0, 0, 0]  # dense, exact, runs
    bars = []  # (block, dense, runs) bytes per token, for the plot
    unknown = []
    for b in cm.plan.blocks:
        ffn = ffns.get(b.name)
        if ffn is None or b.measured.sparsity is None:
            unknown.append(names[b.name])
            continue
        density = 1.0 - b.measured.sparsity
        dense = exact_decode_bytes(ffn, 1.0)
        # compile's own figure where it made one (held-out samples; what explain() shows)
        exact = b.measured.decode_bytes_exact or exact_decode_bytes(ffn, density)
        uses = ffn.predictor is not None and ffn.predictor.enabled
        runs = b.measured.decode_bytes_predicted if uses else exact
        totals[0] += dense
        totals[1] += exact
        totals[2] += runs
        bars.append((names[b.name], dense, runs))
        rows.append((names[b.name], f"{density:.1%}", f"{dense:,}", f"{exact:,}",
                     f"{b.measured.decode_bytes_predicted:,}" if b.decided.predictor_rank is not None else "-",
                     f"{runs:,} ({'predicted' if uses else 'exact'})"))
    if rows:
        rows.append(("all blocks", "", f"{totals[0]:,}", f"{totals[1]:,}", "", f"{totals[2]:,}"))
        out.append("<p>FFN weight bytes the CPU decode kernel reads per token: every row for a "
                   "dense block; with sparsity, each neuron's first row(s) and the rest only for "
                   "neurons that fire, at the density measured on calibration data (for blocks "
                   "with a predictor, on compile's held-out samples, as explain() shows). "
                   "Attention and the LM head are not counted."
                   + (" In the hybrid runtime the hot neurons' rows are read on the GPU."
                      if cm.plan.placement.budget_bytes is not None else "") + "</p>")
        out.append(_bytes_plot(bars))
        out.append(_table(["block", "density (calibration)", "dense B/token", "exact B/token",
                           "predicted B/token", "runs B/token"], rows))
    if unknown:
        out.append(_none(f"No bytes per token for {', '.join(unknown)}: their density was not "
                         "measured (compile without calibration data)."))
    if isinstance(decode, str):
        out.append(_none(f"Tokens per second: {decode}."))
    else:
        sparsity = decode["sparsity"]
        out.append(_table(["decode", ""], [
            ("tokens per second", f"{decode['tps']:.1f}"),
            ("tokens generated", str(decode["tokens"])),
            ("prompt tokens", str(decode["prompt"])),
            ("FFN sparsity while decoding", "-" if sparsity is None else f"{sparsity:.1%}"),
            ("torch CPU threads", str(decode["threads"])),
        ]))
        out.append("<p>One greedy decode run here; the clock starts at the first new token, so "
                   "prefill is not counted (picompile.timing.timed_generate).</p>")
    return "\n".join(out)


# -- measuring ------------------------------------------------------------------------------------

def _bytes_plot(bars: list[tuple[str, int, int]]) -> str:
    """Per block, FFN weight bytes per token dense and as it runs (the table's first and last
    columns), in model order: where sparsity saves reads."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 3.6), layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(bars))
    ax.bar(x, [d / 1e6 for _, d, _ in bars], color="#bbb", label="dense")
    ax.bar(x, [r / 1e6 for _, _, r in bars], color="#3b75af", width=0.6, label="as it runs")
    ax.set(xlabel="FFN block (model order)", ylabel="MB of weights read per token",
           title="FFN weight bytes per decoded token")
    step = max(1, len(bars) // 16)  # at most 16 labels
    ax.set_xticks(x[::step], [name for name, _, _ in bars][::step], rotation=45, ha="right",
                  fontsize="small")
    ax.legend()
    return _img(fig, "FFN weight bytes per token per block, dense and as it runs")


def _measure_decode(cm, prompt_ids, n: int) -> dict | str:
    """A dict of what a short greedy decode measured, or why there was none."""
    from picompile.timing import timed_generate

    if n == 0:
        return "not measured (decode_tokens=0)"
    if not hasattr(cm._orig_mod, "generate"):
        return f"not measured: {type(cm._orig_mod).__name__} has no generate()"
    if prompt_ids is None:
        bos = getattr(getattr(cm._orig_mod, "config", None), "bos_token_id", None)
        prompt_ids = torch.tensor([[bos if isinstance(bos, int) else 0]])
    cm.reset_stats()
    tokens, tps = timed_generate(cm, prompt_ids, n, exact_length=True)
    return dict(tps=tps, tokens=len(tokens), prompt=prompt_ids.shape[-1],
                sparsity=cm.sparsity(), threads=torch.get_num_threads())


# -- HTML and PNG helpers -------------------------------------------------------------------------

def _short_names(blocks) -> list[str]:
    """Block names without their common prefix and the ".sparse_ffn" suffix ("3.mlp")."""
    names = [re.sub(r"\.?sparse_ffn(_\d+)?$", lambda m: m.group(1) or "", b.name) or b.name
             for b in blocks]
    if len(names) > 1:
        prefix = os.path.commonprefix(names)
        prefix = prefix[: prefix.rfind(".") + 1]
        if all(len(n) > len(prefix) for n in names):
            names = [n[len(prefix):] for n in names]
    return names


def _img(fig, alt: str) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _table(headers, rows, head: bool = True) -> str:
    cells = lambda tag, row: "".join(f"<{tag}>{html.escape(str(c))}</{tag}>" for c in row)  # noqa: E731
    lines = ["<table>"]
    if head:
        lines.append(f"<tr>{cells('th', headers)}</tr>")
    lines += [f"<tr>{cells('td', row)}</tr>" for row in rows]
    return "\n".join(lines + ["</table>"])


def _none(message: str) -> str:
    return f'<p class="none">{html.escape(message)}</p>'


def _mb(n: int) -> str:
    return f"{n / 1e6:,.2f} MB"


def _write_atomic(path: pathlib.Path, text: str) -> None:
    """Write to a new temporary file in the same directory (created with the usual
    permissions, unlike mkstemp's 0600), then rename it over `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
