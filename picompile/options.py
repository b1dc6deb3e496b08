"""compile()'s arguments, checked before the model is touched, as one typed value.

Every check that can fail runs here, so a bad argument never leaves a model half rewritten."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import torch
from torch import nn

from picompile import gguf_weights, models
from picompile.budget import parse_budget
from picompile.compiled_model import CompiledModel, check_predictor_policy
from picompile.passes import calibrate as calibrate_pass
from picompile.plan import QUANT_FORMATS, Mode, PredictorPolicy
from picompile.runtime.sparse_ffn import SparseFFN
from picompile.runtime.generate import learned_positions

WEIGHT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Options:
    mode: Mode
    sparsity: float | None  # target share of neurons skipped by threshold (SiLU / GELU blocks)
    budget: int | None  # GPU bytes; None: no placement
    predictors: PredictorPolicy
    dtype: torch.dtype | None  # convert the weights first; None: the model's own
    quantize: str | None  # one of QUANT_FORMATS, or None: float weights
    gptq: bool  # with calibration data, round blocks by GPTQ (else to nearest)
    gguf: str | pathlib.Path | None  # the GGUF file the model was loaded from
    target_recall: float
    max_context: int
    kv_cache: torch.dtype | None  # the C decoder's KV cache dtype; None: the model's
    quiet: bool

    @property
    def needs_profile(self) -> bool:
        """Predictors train on the profile's samples, placement ranks neurons by its counts."""
        return self.mode == Mode.PREDICTED or self.budget is not None


def check_options(model, *, mode, sparsity, gpu_budget, predictors, dtype, quantize, gptq,
                  gguf, target_recall, max_context, kv_cache, quiet) -> Options:
    if not isinstance(model, nn.Module):
        raise TypeError(f"picompile.compile needs a torch.nn.Module, got {type(model).__name__}")
    if mode not in Mode.values():
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(map(repr, Mode.values()))}")
    if sparsity is not None:
        if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0 <= sparsity < 1:
            raise ValueError(f"sparsity must be a number in [0, 1), got {sparsity!r}")
    budget = parse_budget(gpu_budget)
    if isinstance(target_recall, bool) or not isinstance(target_recall, (int, float)) or \
            not 0 < target_recall <= 1:
        raise ValueError(f"target_recall (the share of firing neurons a predictor must catch) "
                         f"must be in (0, 1], got {target_recall!r}")
    if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 1:
        raise ValueError(f"max_context (the longest context placement plans for, in tokens) "
                         f"must be a positive integer, got {max_context!r}")
    if not isinstance(gptq, bool):
        raise ValueError(f"gptq must be True (GPTQ rounding with calibration data) or False "
                         f"(round to nearest), got {gptq!r}")
    if gguf is not None and quantize is None:
        quantize = "gguf"
    _check_quantize(quantize, gguf)
    if quantize == "gguf":
        gguf_weights.check_model(gguf, getattr(model, "config", None))
    check_not_compiled(model, "compile")
    return Options(mode=Mode(mode), sparsity=sparsity, budget=budget,
                   predictors=check_predictor_policy(predictors), dtype=check_dtype(dtype),
                   quantize=quantize, gptq=gptq, gguf=gguf, target_recall=target_recall,
                   max_context=max_context, kv_cache=check_kv_cache(kv_cache), quiet=quiet)


def check_dtype(dtype) -> torch.dtype | None:
    if dtype is None:
        return None
    name = dtype.removeprefix("torch.") if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in WEIGHT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {dtype!r}")
    return WEIGHT_DTYPES[name]


def check_kv_cache(kv_cache) -> torch.dtype | None:
    """The KV cache dtype asked for (a name or torch dtype of WEIGHT_DTYPES), or None."""
    if kv_cache is None:
        return None
    try:
        return check_dtype(kv_cache)
    except ValueError:
        raise ValueError(f"kv_cache must be one of {', '.join(WEIGHT_DTYPES)} or None (the "
                         f"model's dtype), got {kv_cache!r}") from None


def _check_quantize(quantize, gguf) -> None:
    check_gguf(gguf)
    if quantize is None:
        return
    if quantize not in QUANT_FORMATS:
        raise ValueError(f"quantize must be one of {', '.join(QUANT_FORMATS)} (GGUF's block "
                         f"formats, or the GGUF file's own) or None for float weights, got "
                         f"{quantize!r}")
    if quantize == "gguf" and gguf is None:
        raise ValueError("quantize='gguf' keeps the tensors of the GGUF file the model was "
                         "loaded from: pass gguf=<that file>")


def check_gguf(gguf) -> None:
    """gguf= must be a whole GGUF file (models.check_gguf's clear errors: not GGUF, truncated,
    no tensors), or None."""
    if gguf is None:
        return
    if not pathlib.Path(gguf).is_file():
        raise ValueError(f"gguf={str(gguf)!r} is not a file: pass the GGUF file the model was "
                         "loaded from, or leave gguf= out")
    models.check_gguf(pathlib.Path(gguf))


def check_not_compiled(model, what: str) -> None:
    if isinstance(model, CompiledModel) or any(isinstance(m, SparseFFN) for m in model.modules()):
        raise ValueError(
            f"picompile.{what}: this model is already compiled by picompile (its FFN blocks are "
            "rewritten in place). Start from a fresh model: load it again, or keep "
            "copy.deepcopy(model) before the first compile")


def calibration_ids(model, calibration, tokenizer, n_tokens: int, opts: Options):
    """Token ids [batch, seq] to calibrate on: the user's, or the built-in corpus when only a
    tokenizer is given (its calibration split, topped up from its train split when more tokens
    are asked for; never its held-out split); None when neither is given and none is needed."""
    if tokenizer is not None and not callable(tokenizer):
        raise ValueError(f"tokenizer= takes the model's Hugging Face tokenizer (called on text), "
                         f"got {type(tokenizer).__name__}")
    if calibration is not None:
        ids = calibrate_pass.calibration_ids(calibration, tokenizer)
    elif tokenizer is not None:
        ids = _corpus_ids(tokenizer, n_tokens)
    else:
        ids = None
    _check_ids_in_vocab(model, ids)
    _check_rows_in_positions(model, ids)
    if ids is None and (opts.sparsity or opts.needs_profile):
        what = f"sparsity={opts.sparsity}" if opts.sparsity else (
            "mode='predicted'" if opts.mode == Mode.PREDICTED else "gpu_budget (placement)")
        raise ValueError(
            f"{what} needs calibration data: pass calibration= (a LongTensor of token ids "
            "[batch, seq], or strings with tokenizer=), or just tokenizer= to calibrate on the "
            "built-in English corpus"
        )
    return ids


def _corpus_ids(tokenizer, n_tokens: int) -> torch.Tensor:
    from picompile import corpus

    seq = 256
    rows = max(1, n_tokens // seq)
    parts = []
    for split in ("calibration", "train"):  # the calibration split first, then train's
        take = min(rows, corpus.available_tokens(tokenizer, split) // seq)
        if take:
            parts.append(corpus.token_batches(tokenizer, split, take * seq, seq))
            rows -= take
        if not rows:
            break
    if not parts:
        raise ValueError(f"the built-in corpus gives fewer than {seq} tokens per split with this "
                         "tokenizer, not one calibration row: pass calibration= (token ids "
                         "[batch, seq]) or a tokenizer with a real vocabulary")
    return torch.cat(parts)


def _check_rows_in_positions(model, ids) -> None:
    """Calibration rows must fit a learned position table (GPT-2's, OPT's): past its last row
    profiling would fail in the embedding."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if ids is None or not isinstance(limit, int) or ids.shape[1] <= limit:
        return
    if learned_positions(model, limit):
        raise ValueError(f"calibration rows of {ids.shape[1]} tokens are longer than the model's "
                         f"{limit} learned positions: pass rows of at most {limit} tokens "
                         "(calibration= [batch, seq])")


def _check_ids_in_vocab(model, ids) -> None:
    """Calibration ids must index the model's embedding (a bad id fails deep in profiling)."""
    if ids is None or not hasattr(model, "get_input_embeddings"):
        return
    emb = model.get_input_embeddings()
    vocab = getattr(emb, "num_embeddings", None)
    if vocab is None:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"calibration token ids must be in [0, {vocab}) for this model's "
                         f"vocabulary; got ids from {lo} to {hi}. Tokenize with the model's own "
                         "tokenizer (or pass tokenizer=)")
