"""Real models: the trained ReLU fixture (predictor targets on held-out text, golden greedy
output), the command line on it, and the default SmolLM2 model end to end."""

from __future__ import annotations

import copy
import pathlib

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import picompile
from picompile import cli, corpus, models
from picompile.evaluate import perplexity
from picompile.runtime.sparse_ffn import down_input

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "relu_llama"


@pytest.fixture(scope="module")
def fixture_model():
    model = AutoModelForCausalLM.from_pretrained(FIXTURE, local_files_only=True).eval()
    return model, AutoTokenizer.from_pretrained(FIXTURE, local_files_only=True)


@pytest.fixture(scope="module")
def heldout(fixture_model):
    return corpus.token_batches(fixture_model[1], "heldout", 32 * 256)


def test_fixture_exact_mode_is_lossless(fixture_model, heldout):
    dense, _ = fixture_model
    cm = picompile.compile(copy.deepcopy(dense), quiet=True)
    assert perplexity(cm, heldout[:8]) == pytest.approx(perplexity(dense, heldout[:8]), rel=1e-5)
    prompt = heldout[:1, :24]
    golden = dense.generate(prompt, max_new_tokens=32, do_sample=False)
    assert torch.equal(cm.generate(prompt, max_new_tokens=32, do_sample=False), golden)
    assert cm.sparsity() > 0.6  # the fixture's FFNs are about 79% sparse


def test_fixture_predictors_meet_targets_on_heldout_text(fixture_model, heldout):
    """recall >= 0.99 at predicted density <= 1.3x true, perplexity within +1%, on text the
    model was neither trained nor calibrated on."""
    dense, tok = fixture_model
    cm = picompile.compile(copy.deepcopy(dense), mode="predicted", tokenizer=tok,
                           calibration_tokens=51200, predictors="all", quiet=True)
    counts = {}

    def record(ffn, args, _out):
        x, predicted = args
        h = down_input(x.reshape(-1, ffn.d_model), ffn.w_up, w_gate=ffn.w_gate, act=ffn.act)
        fired = h.abs() > ffn.threshold
        c = counts.setdefault(ffn.block.name, torch.zeros(3))
        c += torch.tensor([float((predicted & fired).sum()), float(fired.sum()), float(predicted.sum())])

    for ffn in cm.ffns().values():
        ffn.register_forward_hook(record)
    ppl = perplexity(cm, heldout)
    for name, (caught, fired, predicted) in counts.items():
        assert caught / fired >= 0.99, (name, float(caught / fired))
        assert predicted / fired <= 1.3, (name, float(predicted / fired))
    assert ppl <= perplexity(dense, heldout) * 1.01


def test_cli_explain_on_a_local_model(capsys):
    assert cli.main(["explain", "--model", str(FIXTURE), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.3.mlp.sparse_ffn" in out and "exact zeros" in out


def test_cli_loads_the_model_in_the_dtype_asked_for(capsys):
    """--dtype reaches the loader (a GGUF file is dequantized straight to it), and the weights
    the kernels read are in it."""
    assert cli.main(["explain", "--model", str(FIXTURE), "--dtype", "bfloat16", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "FFN bfloat16" in out and "float32" not in out.split("weights:")[1].split("\n")[0]
    model, _ = models.load(FIXTURE, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_cli_reports_bad_input_without_a_traceback(capsys):
    assert cli.main(["run", "--gpu-budget", "lots"]) == 2
    assert "gpu_budget 'lots' is not a size" in capsys.readouterr().err
    assert cli.main(["run", "--model", "/nonexistent/model"]) == 2
    assert "no such file" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_answers_through_the_compiled_model():
    from picompile import models

    dense, tok = models.load(None)
    cm = picompile.compile(copy.deepcopy(dense), sparsity=0.5, tokenizer=tok,
                           calibration_tokens=4096, quiet=True)
    ids = cli._chat_ids(tok, cli.DEFAULT_PROMPT)
    want = dense.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
    got = cm.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
    assert "Paris" in tok.decode(want) and "Paris" in tok.decode(got)
    assert 0.4 < cm.sparsity() < 0.6
