"""picompile.corpus (offline text, splits, token batches) and the committed ReLU Llama fixture."""

from __future__ import annotations

import importlib.util
import math
import pathlib

import pytest
import torch

FIXTURE = pathlib.Path(__file__).resolve().parent / "fixtures" / "relu_llama"
REPO = pathlib.Path(__file__).resolve().parent.parent

# Measured by tests/fixtures/train_relu_llama.py (see fixtures/relu_llama/README.md), with margin.
HELDOUT_PPL_MEASURED = 24.36
HELDOUT_PPL_BOUND = 26.8  # measured * 1.1
SPARSITY_MEASURED = 0.7874  # per layer 0.5881, 0.8818, 0.8696, 0.8101
SPARSITY_BOUND = 0.757  # overall, measured - 0.03
LAYER_SPARSITY_BOUND = 0.538  # every layer, min measured layer - 0.05


def _load_corpus():
    try:
        from picompile import corpus

        return corpus
    except ImportError:  # the package __init__ may import modules still being written
        spec = importlib.util.spec_from_file_location("picompile_corpus", REPO / "picompile" / "corpus.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


corpus = _load_corpus()


def _shingles(docs, n=10):
    out = set()
    for d in docs:
        w = d.split()
        out.update(" ".join(w[i : i + n]) for i in range(len(w) - n + 1))
    return out


# ---------------------------------------------------------------- corpus


def test_corpus_source_is_one_line():
    assert isinstance(corpus.CORPUS_SOURCE, str) and "\n" not in corpus.CORPUS_SOURCE
    assert "PSF" in corpus.CORPUS_SOURCE and "pydoc_data" in corpus.CORPUS_SOURCE


def test_splits_deterministic_nonempty_and_sized():
    sizes = {}
    for split in corpus.SPLITS:
        a = corpus.default_texts(split)
        b = corpus.default_texts(split)
        assert a == b and a is not b
        assert all(isinstance(t, str) and t.strip() for t in a)
        sizes[split] = sum(map(len, a))
    assert corpus.default_texts() == corpus.default_texts("calibration")
    assert sizes["heldout"] > 50_000 and sizes["calibration"] > 100_000
    assert sizes["train"] > sizes["calibration"] + sizes["heldout"]


def test_splits_disjoint():
    texts = {s: corpus.default_texts(s) for s in corpus.SPLITS}
    docs = {s: set(t) for s, t in texts.items()}
    sh = {s: _shingles(t) for s, t in texts.items()}
    for a, b in [("train", "calibration"), ("train", "heldout"), ("calibration", "heldout")]:
        assert not docs[a] & docs[b], (a, b)
        # No run of 10 words is shared between two splits.
        common = sh[a] & sh[b]
        assert not common, (a, b, sorted(common)[:5])


def test_unknown_split():
    with pytest.raises(ValueError, match="unknown split"):
        corpus.default_texts("test")


# ---------------------------------------------------------------- fixture


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(FIXTURE, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(FIXTURE, local_files_only=True)
    return m.eval()


def test_token_batches_shape_and_content(tok):
    x = corpus.token_batches(tok, "calibration", 1000, seq_len=128)
    assert x.dtype == torch.long and tuple(x.shape) == (8, 128)  # ceil(1000 / 128) rows
    assert tuple(corpus.token_batches(tok, "calibration", 1024, seq_len=128).shape) == (8, 128)
    assert tuple(corpus.token_batches(tok, "heldout", 1, seq_len=256).shape) == (1, 256)
    # Rows are consecutive chunks of one stream: the documents in order, EOS between them.
    stream = []
    for doc in corpus.default_texts("calibration"):
        if stream:
            stream.append(tok.eos_token_id)
        stream += tok(doc, add_special_tokens=False)["input_ids"]
        if len(stream) >= 1024:
            break
    assert x.flatten().tolist() == stream[:1024]
    y = corpus.token_batches(tok, "calibration", 2000, seq_len=256)
    assert torch.equal(y.flatten()[:1024], x.flatten())
    assert torch.equal(corpus.token_batches(tok, "calibration", 1000, seq_len=128), x)


def test_token_batches_too_small(tok):
    avail = corpus.available_tokens(tok, "heldout")
    rows = avail // 256
    assert tuple(corpus.token_batches(tok, "heldout", rows * 256).shape) == (rows, 256)
    with pytest.raises(ValueError, match=rf"has only {avail} tokens") as e:
        corpus.token_batches(tok, "heldout", rows * 256 + 1)
    assert f"{rows} full rows" in str(e.value)
    with pytest.raises(ValueError):
        corpus.token_batches(tok, "heldout", 0)


def test_fixture_files_and_config():
    names = {p.name for p in FIXTURE.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} <= names
    assert (FIXTURE / "model.safetensors").stat().st_size < 8.5e6


def test_fixture_is_relu_llama(model, tok):
    from transformers import LlamaForCausalLM

    assert isinstance(model, LlamaForCausalLM)
    cfg = model.config
    assert cfg.model_type == "llama" and cfg.hidden_act == "relu"
    assert cfg.tie_word_embeddings and cfg.num_hidden_layers == 4
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(isinstance(layer.mlp.act_fn, torch.nn.ReLU) for layer in model.model.layers)
    assert len(tok) == cfg.vocab_size == 1024
    text = "The for statement is used to iterate over the elements of a sequence."
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token_id == cfg.eos_token_id


@pytest.fixture(scope="module")
def heldout_eval(model, tok):
    """Held-out NLL and act_fn zero fractions, over all full 256-token rows (as in the README)."""
    rows = corpus.token_batches(tok, "heldout", corpus.available_tokens(tok, "heldout") // 256 * 256)
    layers = model.model.layers
    zeros = [0] * len(layers)
    total = [0] * len(layers)

    def make_hook(j):
        def hook(_m, _i, out):
            zeros[j] += int((out == 0).sum())
            total[j] += out.numel()

        return hook

    handles = [layer.mlp.act_fn.register_forward_hook(make_hook(j)) for j, layer in enumerate(layers)]
    nll, cnt = 0.0, 0
    try:
        with torch.no_grad():
            for i in range(0, rows.shape[0], 32):
                x = rows[i : i + 32]
                logits = model(input_ids=x).logits[:, :-1]
                nll += torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
                ).item()
                cnt += x[:, 1:].numel()
    finally:
        for h in handles:
            h.remove()
    return math.exp(nll / cnt), [z / t for z, t in zip(zeros, total)], sum(zeros) / sum(total)


def test_fixture_heldout_perplexity(heldout_eval):
    ppl, _, _ = heldout_eval
    assert ppl < HELDOUT_PPL_BOUND, f"held-out perplexity {ppl:.2f} (measured {HELDOUT_PPL_MEASURED})"


def test_fixture_ffn_sparsity(heldout_eval):
    _, per_layer, overall = heldout_eval
    assert overall >= SPARSITY_BOUND, f"overall FFN sparsity {overall:.4f} (measured {SPARSITY_MEASURED})"
    assert min(per_layer) >= LAYER_SPARSITY_BOUND, per_layer
    assert overall < 1.0  # not dead


def test_a_tokenizer_too_coarse_for_one_calibration_row_is_a_clear_error(monkeypatch):
    """Where neither split gives 256 tokens (a tokenizer of very long tokens), compile's corpus
    calibration says so and what to pass, not "n_tokens must be positive"."""
    from picompile import options

    monkeypatch.setattr(corpus, "available_tokens", lambda tokenizer, split: 200)
    with pytest.raises(ValueError, match="fewer than 256 tokens per split.*pass calibration="):
        options._corpus_ids(object(), 4096)
