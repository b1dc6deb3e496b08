"""`picompile report` / cm.report(path) and `picompile bench` (issue 11, parts 3 and 4): the
report parses as HTML, every embedded image is a PNG that decodes, each section is there (with
its data, or saying why there is none); bench prints one table with the expected rows and
never builds llama.cpp unless asked."""

from __future__ import annotations

import base64
import html.parser
import io
import pathlib
import warnings

import pytest
import torch

import picompile
from picompile import bench, cli
from picompile.passes.predictors import exact_decode_bytes
from tests import zoo

matplotlib_image = pytest.importorskip("matplotlib.image")

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "relu_llama"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SECTIONS = ("firing", "placement", "predictors", "throughput")
NO_PROFILE = "No firing profile"
NO_BUDGET = "No GPU budget was given"
NO_PREDICTORS = "No predictors"


class Page(html.parser.HTMLParser):
    """What the tests look at: section ids, image sources, the visible text."""

    def __init__(self, text: str):
        super().__init__()
        self.ids, self.images, self.text = [], [], []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.append(attrs["id"])
        if tag == "img":
            self.images.append(attrs["src"])

    def handle_data(self, data):
        self.text.append(data)


def read_report(path: pathlib.Path) -> tuple[Page, str]:
    page = Page(path.read_text(encoding="utf-8"))
    return page, " ".join(page.text)


def decode_png(src: str):
    prefix = "data:image/png;base64,"
    assert src.startswith(prefix), src[:40]
    data = base64.b64decode(src[len(prefix):], validate=True)
    assert data.startswith(PNG_SIGNATURE)
    pixels = matplotlib_image.imread(io.BytesIO(data), format="png")
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    return pixels


def _calibration(n=8, seq=48, seed=0):
    return torch.randint(0, zoo.VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))


def _compile(arch, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no CUDA GPU": the placement is planned all the same
        return picompile.compile(zoo.make(arch, **kw.pop("sizes", {})), calibration=_calibration(),
                                 quiet=True, **kw)


def test_exact_mode_report_says_which_sections_have_no_data(tmp_path):
    cm = _compile("llama_relu", sparsity=0.5)  # ReLU blocks: exact, the target applies to none
    path = cm.report(tmp_path / "r.html", decode_tokens=4)
    assert path == tmp_path / "r.html"
    page, text = read_report(path)
    assert all(s in page.ids for s in SECTIONS)
    # no profile, no placement, no predictors: their sections say so; the bytes per token of
    # each block (measured on the calibration data) are plotted all the same
    assert len(page.images) == 1
    decode_png(page.images[0])
    assert NO_PROFILE in text and NO_BUDGET in text and NO_PREDICTORS in text
    assert "tokens per second" in text and "dense B/token" in text
    # the decode ran: sparsity of ReLU blocks on the decode's tokens
    assert cm.sparsity() is not None and f"{cm.sparsity():.1%}" in text
    assert "target sparsity none" in text


def test_threshold_mode_report(tmp_path):
    cm = _compile("llama_silu", sparsity=0.5)
    page, text = read_report(cm.report(tmp_path / "r.html", decode_tokens=4))
    assert all(s in page.ids for s in SECTIONS)
    assert "target sparsity 50%" in text
    assert NO_PROFILE in text and NO_BUDGET in text and NO_PREDICTORS in text
    # bytes per token: every block read at about half its neurons, fewer bytes than dense
    for ffn in cm.ffns().values():
        dense = exact_decode_bytes(ffn, 1.0)
        exact = exact_decode_bytes(ffn, 1 - ffn.block.measured.sparsity)
        assert exact < dense and f"{exact:,}" in text and f"{dense:,}" in text


def test_predicted_mode_report_plots_every_section(tmp_path):
    cm = _compile("llama_silu", mode="predicted", sparsity=0.5, gpu_budget="1GB",
                  predictors="all", sizes=dict(n_ff=128))
    assert cm.firing and all(f.shape == (128,) for f in cm.firing.values())
    page, text = read_report(cm.report(tmp_path / "r.html", decode_tokens=4))
    assert all(s in page.ids for s in SECTIONS)
    assert NO_PROFILE not in text and NO_BUDGET not in text and NO_PREDICTORS not in text
    assert len(page.images) == 4  # firing, placement, predictors, bytes per token
    for src in page.images:
        decode_png(src)
    for b in cm.plan.blocks:  # the numbers compile measured are the ones shown
        assert f"{b.measured.predictor_recall:.1%}" in text and f"{b.measured.true_density:.1%}" in text
        assert f"{b.measured.decode_bytes_predicted:,}" in text
    assert f"{cm.plan.placement.budget_bytes:,}" in text
    # the skew the text states is the one measured, not a claim
    from picompile.report import _top10_share
    top10 = [_top10_share(f.double().numpy()) for f in cm.firing.values()]
    assert (f"the most frequent 10% of a block's neurons carry {min(top10):.0%} to "
            f"{max(top10):.0%} of its firings") in " ".join(text.split())


def test_plain_module_without_generate_states_tok_s_not_measured(tmp_path):
    cm = _compile("tiny_gated_relu", gpu_budget=0)
    page, text = read_report(cm.report(tmp_path / "r.html"))
    assert "not measured: TinyLM has no generate()" in text
    assert "gpu_budget is 0" in text  # the placement's own note
    for src in page.images:  # firing, placement, bytes per token
        decode_png(src)
    assert len(page.images) == 3


@pytest.mark.parametrize("where, error", [
    ("missing/r.html", FileNotFoundError),  # no such directory
    (".", IsADirectoryError),
    ("file.txt/r.html", NotADirectoryError),
    ("kept.html", PermissionError),  # a file its owner made read-only is not replaced
])
def test_bad_output_path_is_a_clear_error(tmp_path, where, error):
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "kept.html").write_text("precious")
    (tmp_path / "kept.html").chmod(0o444)
    cm = _compile("llama_relu")
    with pytest.raises(error, match="report|read-only"):
        cm.report(tmp_path / where)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "kept.html"]
    assert (tmp_path / "kept.html").read_text() == "precious"  # nothing half-written


def test_report_replaces_an_old_file_and_leaves_no_temporary(tmp_path):
    out = tmp_path / "r.html"
    out.write_text("old")
    _compile("llama_relu").report(out, decode_tokens=1)
    assert out.read_text().startswith("<!DOCTYPE html>")
    assert [p.name for p in tmp_path.iterdir()] == ["r.html"]


def test_cli_report_refuses_a_bad_output_before_loading(tmp_path, capsys):
    code = cli.main(["report", "--model", "/nonexistent/model", "--output",
                     str(tmp_path / "missing" / "r.html")])
    err = capsys.readouterr().err
    assert code == 2 and "--output" in err and "does not exist" in err
    assert "nonexistent" not in err  # the model was not looked at


def test_cli_report_on_the_fixture_model(tmp_path, capsys):
    out = tmp_path / "report.html"
    code = cli.main(["report", "--model", str(FIXTURE), "--mode", "predicted",
                     "--calibration-tokens", "512", "--decode-tokens", "4", "--quiet",
                     "--output", str(out)])
    assert code == 0 and str(out) in capsys.readouterr().err
    page, text = read_report(out)
    # no budget: no placement plot (firing, predictors, bytes per token)
    assert all(s in page.ids for s in SECTIONS) and len(page.images) == 3
    for src in page.images:
        decode_png(src)
    assert NO_BUDGET in text and "LlamaForCausalLM" in text


# -- bench --------------------------------------------------------------------------------------

def test_bench_prints_one_table_with_the_expected_rows(capsys):
    code = cli.main(["bench", "--model", str(FIXTURE), "--new-tokens", "4", "--repeats", "1",
                     "--calibration-tokens", "512", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| system | tok/s | vs dense, Hugging Face eager, float32 |")
    systems = [r.split("|")[1].strip() for r in rows[1:]]
    assert systems == ["llama.cpp", "dense, Hugging Face eager, float32", "picompile, exact, float32"]
    llama, dense, ours = rows[1:]
    assert "not run: llama.cpp reads GGUF files" in llama  # an HF directory: nothing to run
    assert dense.split("|")[3].strip() == "1.00x"
    for row in (dense, ours):
        assert float(row.split("|")[2]) > 0
    assert "FFN sparsity" in ours


def test_bench_never_builds_llama_cpp_unless_asked(tmp_path):
    build = tmp_path / "peers"
    rows = bench.llama_cpp_rows(tmp_path / "model.gguf", torch.float32, 1, 4, build=build)
    assert [(r.system, r.tps) for r in rows] == [("llama.cpp", None)]
    assert "not built" in rows[0].notes and "--build-llama-cpp" in rows[0].notes
    assert not build.exists()  # nothing downloaded or built


@pytest.mark.parametrize("weights, want", [
    ("gguf", [("llama.cpp m.gguf", True)]),  # picompile runs the file's blocks: the file itself
    ("q4_0", [("llama.cpp m.gguf", False), ("llama.cpp Q4_0", True)]),
    (None, [("llama.cpp m.gguf", False), ("llama.cpp F32", True)]),  # float32 weights
])
def test_bench_compares_with_llama_cpp_on_the_weights_picompile_runs(weights, want, tmp_path,
                                                                     monkeypatch):
    """The reference llama.cpp row is the one on picompile's weights (llama-bench and
    llama-quantize replaced by stand-ins: nothing is built or run)."""
    monkeypatch.setattr(bench, "llama_cpp_bins", lambda build: tmp_path)
    monkeypatch.setattr(bench, "llama_bench", lambda bins, path, threads, n, repeats: 1.0)
    monkeypatch.setattr(bench, "requantized", lambda bins, src, kind, out: out)
    rows = bench.llama_cpp_rows(tmp_path / "m.gguf", torch.float32, 1, 4, weights=weights,
                                build=tmp_path)
    assert [(r.system, r.ref) for r in rows] == want


def test_llama_bench_gives_the_best_of_its_repetitions_as_picompile_rows_do(monkeypatch):
    """picompile's rows are the best of N runs: llama-bench's is too, not its mean."""
    import json
    import subprocess

    seen = []

    def run(cmd, **kwargs):
        seen.append(cmd)
        out = [{"avg_ts": 58.4, "samples_ts": [57.1, 59.6, 58.5]}]
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(out), stderr="")

    monkeypatch.setattr(bench.subprocess, "run", run)
    assert bench.llama_bench(pathlib.Path("bin"), pathlib.Path("m.gguf"), 2, 32, 5) == 59.6
    assert seen[0][seen[0].index("-r") + 1] == "5"


def test_bench_table_ratios_to_reference_rows():
    rows = [bench.Row("a", 50.0, ref=True), bench.Row("b", 100.0, "fast"), bench.Row("c", None, "why")]
    lines = bench.table(rows).splitlines()
    assert lines[0] == "| system | tok/s | vs a | notes |"
    assert lines[2:] == ["| a | 50.0 | 1.00x |  |", "| b | 100.0 | 2.00x | fast |",
                         "| c | - | - | why |"]


def test_runs_that_varied_widely_are_noted():
    """The best run is kept; when another was more than 15% slower the row says so (a machine
    busy part of the time gave rows 20x slower, unsaid)."""
    assert bench.spread_note([50.0, 48.0, 45.0]) == []
    assert bench.spread_note([50.0, 20.0]) == ["runs varied: the slowest 60% under the best "
                                               "(a busy machine?)"]
