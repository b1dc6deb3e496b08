"""picompile's own generate loop for Hugging Face decoder-only models (gpt-fast shape).

    prefill: the whole prompt through the model once, into a transformers StaticCache sized
             prompt + max_new_tokens, keeping the last position's logits only (with a
             whole-step decoder, only the prompt's tokens after those its prompt cache holds);
    decode:  one token per step; per step there is a model call, the pick (argmax or sampling)
             and a few in-place tensor updates. Nothing is reallocated per step: the output
             ids, the position ids and the 2D attention mask are preallocated.

`generate(model, input_ids, ...)` is the loop with explicit arguments. `generate_hf(model, *args,
**kwargs)` takes Hugging Face `generate` arguments (and `model.generation_config` defaults, as HF
does); `supported(model, kwargs, args)` says whether the loop handles a given call: None, or the
name of the first argument / property it does not handle, so the caller can fall back to HF.

Host syncs: greedy / sampling need none. With EOS tokens, checking whether every row has
finished is one sync per step (`bool(unfinished.any())`), as in HF; a streamer's `.cpu()` copy
is another. On the CPU a sync costs nothing.

Output: like HF's, prompt + new tokens, [B, S + n]; a row that has produced an EOS token is
padded with pad_token_id after it, and the loop stops when every row has finished, or after
max_new_tokens.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence

import torch
from torch import nn

from picompile.progress import note, quiet_transformers
from picompile.runtime.lookup import PromptLookup
from picompile.runtime.sampling import LogitsProcessor, Picker

# GenerationConfig fields the loop implements.
_HANDLED = frozenset({"max_length", "max_new_tokens", "min_length", "min_new_tokens", "do_sample",
                      "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                      "eos_token_id", "pad_token_id", "prompt_lookup_num_tokens"})
# Fields without effect on a decoder-only greedy / sampling run (beam-only, assistant-only
# settings, bookkeeping, the cache kind: the tokens are the same with any full cache).
_IGNORED = frozenset({
    "bos_token_id", "decoder_start_token_id", "use_cache", "cache_implementation", "cache_config",
    "max_cache_len", "compile_config", "disable_compile", "transformers_version", "early_stopping",
    "length_penalty", "low_memory", "num_assistant_tokens", "num_assistant_tokens_schedule",
    "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind",
    "max_matching_ngram_size", "is_assistant", "output_attentions", "output_hidden_states",
})
# HF processors that HF's generate builds from the config before the caller's logits_processor:
# one of these kinds passed in takes the built one's place there, so HF's generate runs it.
_BUILT_BY_HF = frozenset({"RepetitionPenaltyLogitsProcessor", "MinLengthLogitsProcessor",
                          "MinNewTokensLengthLogitsProcessor"})
_CACHES = (None, "static", "dynamic", "dynamic_full", "hybrid", "sliding_window")
# generate() parameters other than the inputs, generation_config and streamer: each must be
# left at None (or False) for the loop to take the call.
_HF_ONLY = ("stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus",
            "assistant_model", "negative_prompt_ids", "negative_prompt_attention_mask",
            "custom_generate", "assistant_tokenizer", "use_model_defaults")


class _Unsupported(Exception):
    pass


def model_reason(model) -> str | None:
    """None if `generate` can run `model`, else why not (a short phrase)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        return "transformers is not installed"
    if not isinstance(model, PreTrainedModel) or not hasattr(model, "generate"):
        return f"{type(model).__name__} is not a Hugging Face generative model"
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return f"{type(model).__name__} is an encoder-decoder model"
    if not getattr(model, "_can_compile_fullgraph", False) or getattr(model, "_is_stateful", False):
        return f"{type(model).__name__} does not support transformers' StaticCache"
    params = _forward_params(model)
    for name in ("attention_mask", "position_ids"):
        if name not in params:
            return f"{type(model).__name__}.forward takes no {name}"
    if cache_kwarg(model) not in params:
        return f"{type(model).__name__}.forward takes no cache (nor past_key_values)"
    try:
        _new_cache(model, 1)  # lazily allocated: this checks the config and the signature only
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        return f"transformers' StaticCache does not take {type(model).__name__} ({e})"
    return None


def _forward_params(model) -> frozenset[str]:
    return frozenset(inspect.signature(model.forward).parameters)


def cache_kwarg(model) -> str:
    """The forward's keyword for the KV cache: `cache` since transformers 5.24 (which still
    takes `past_key_values` with a deprecation warning), `past_key_values` before."""
    return "cache" if "cache" in _forward_params(model) else "past_key_values"


def _new_cache(model, max_cache_len: int):
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_cache_len)


@torch.no_grad()  # as HF's generate (inference_mode would return an inference tensor)
def generate(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             *, max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
             repetition_penalty: float = 1.0, logits_processor: Sequence[LogitsProcessor] = (),
             seed: int | None = None, eos_token_id: int | Sequence[int] | None = None,
             pad_token_id: int | None = None,
             streamer=None, callback: Callable[[torch.Tensor], None] | None = None,
             min_new_tokens: int = 0, prompt_lookup: int = 0, decoder=None,
             steps=None) -> torch.Tensor:
    """Prompt + up to max_new_tokens new tokens, [B, S + n]: HF's output for the same options
    (sampled: tokens from HF's distribution, drawn picompile's way, runtime/sampling.py).

    input_ids [B, S]; attention_mask [B, S] with left padding (zeros first) or None.
    Greedy (argmax) unless do_sample. Each step's logits go through HF's processors in HF's
    order (runtime/sampling.py): repetition_penalty, EOS held back before min_new_tokens,
    logits_processor (HF's protocol), then when sampling temperature, top_k, top_p, min_p, and a
    draw from a torch.Generator seeded by `seed` (the global RNG when None). A row stops at any of
    eos_token_id (after min_new_tokens new tokens) and is padded with pad_token_id
    (eos_token_id's first when None). streamer: HF protocol (put(prompt ids, on the CPU), put(each
    new token [B]), end()). callback(tokens [B]) per new token, on the model's device.
    decoder: a decoder bound to `model` (runtime/decoder.py's C one, or device_decoder.py's for
    a model split across a GPU): it runs the decode steps of a single unpadded row after the
    model's own prefill (or its own, where it has one).
    steps: a capture_whole.StepGraphs of `model`: its exported prefill and decode steps run a
    single unpadded row within their max_len (the decoder, when given, takes precedence).
    prompt_lookup: draft up to this many tokens a step from the text so far (runtime/lookup.py)
    where the decoder checks several tokens a step (the C one); 0, or elsewhere: one at a time.
    The tokens are those of one at a time (bit for bit with quantized weights; with float ones
    a step of several tokens sums in another order, which can tip a near-tie).
    """
    reason = model_reason(model)
    if reason is not None:
        raise TypeError(f"picompile generate: {reason}; use the model's own generate()")
    if (input_ids.ndim != 2 or input_ids.dtype not in (torch.long, torch.int)
            or 0 in input_ids.shape):
        raise ValueError(f"input_ids must be a non-empty [batch, length] integer tensor, "
                         f"got {tuple(input_ids.shape)} {input_ids.dtype}")
    if max_new_tokens < 0 or min_new_tokens < 0 or prompt_lookup < 0:
        raise ValueError("max_new_tokens, min_new_tokens and prompt_lookup must be >= 0")
    device = next(model.parameters()).device
    input_ids = input_ids.to(device=device, dtype=torch.long)
    b, s = input_ids.shape
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} does not match "
                             f"input_ids {tuple(input_ids.shape)}")
    eos = None
    if eos_token_id is not None:
        eos_list = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        if eos_list:
            eos = torch.tensor(eos_list, dtype=torch.long, device=device)
            if pad_token_id is None:
                pad_token_id = eos_list[0]
    pick = Picker(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                  min_p=min_p, repetition_penalty=repetition_penalty,
                  logits_processor=logits_processor, eos=eos, min_new_tokens=min_new_tokens,
                  prompt_pad=None if attention_mask is None
                  else (attention_mask != 0).int().argmax(1),  # HF's: the leading zeros
                  seed=seed, device=device)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    if max_new_tokens == 0:
        if streamer is not None:
            streamer.end()
        return input_ids.clone()
    total = s + max_new_tokens
    params = _forward_params(model)

    # The 2D mask covers the whole cache: the prompt's, then ones. Future columns are hidden by
    # causality, so the same tensor serves every step. No mask when nothing is padded (as HF).
    mask = None
    if attention_mask is not None:
        flash = "flash" in str(getattr(model.config, "_attn_implementation", ""))
        if flash or not bool(attention_mask.all()):
            mask = attention_mask.new_ones(b, total)
            mask[:, :s] = attention_mask
    if mask is None:
        pos = torch.arange(s, device=device).unsqueeze(0)  # [1, S], broadcast over rows
    else:
        m = mask[:, :s].long()
        pos = (m.cumsum(-1) - 1).masked_fill(m == 0, 0)  # as HF: positions of left-padded rows
    next_pos = pos[:, -1:] + 1

    cache = _new_cache(model, total)
    if decoder is not None and not (b == 1 and mask is None and decoder.reserve(total)):
        decoder.prompt_reused = 0  # its cache untouched: what it holds stays
        decoder = None  # batches, padding, past its learned positions: the model's own steps
    if steps is not None and (decoder is not None or not steps.fits(b, total, mask is not None)):
        steps = None
    common = {"attention_mask": mask, cache_kwarg(model): cache, "use_cache": True}
    cache_pos = "cache_position" in params  # transformers 4.x models want it
    prefill = dict(common, input_ids=input_ids, position_ids=pos)
    if "logits_to_keep" in params:
        prefill["logits_to_keep"] = 1
    if cache_pos:
        prefill["cache_position"] = torch.arange(s, device=device)
        step_cache_pos = torch.tensor([s], device=device)
    # The prompt's leading positions whose keys and values the decoder's cache holds from the
    # last call (a chat's earlier turns): only the rest is prefilled.
    reused = 0 if decoder is None else decoder.cached_prefix(input_ids[0], total)
    if decoder is not None and decoder.prefills(s - reused):  # into its own cache, not the model's
        logits = decoder.prefill(input_ids, start=reused)
    elif steps is not None:
        logits = steps.prefill(input_ids)
    else:
        if reused:
            decoder.prefix_into(cache, reused)
            prefill.update(input_ids=input_ids[:, reused:], position_ids=pos[:, reused:])
            if cache_pos:
                prefill["cache_position"] = torch.arange(reused, s, device=device)
        logits = model(**prefill).logits[:, -1]
        if decoder is not None:
            decoder.load_cache(cache, s, start=reused)
    if decoder is not None:
        decoder.set_threads()
    lookup = None  # drafts: the token after the last picked comes with the step's row `row`
    if prompt_lookup and decoder is not None and getattr(decoder, "step_max", 1) > 1:
        lookup = PromptLookup(input_ids[0].tolist(), min(prompt_lookup, decoder.step_max - 1))
    draft: list[int] = []
    row = 0

    out = input_ids.new_empty(b, total)
    out[:, :s] = input_ids
    unfinished = torch.ones(b, dtype=torch.bool, device=device) if eos is not None else None
    pad = torch.tensor(pad_token_id if pad_token_id is not None else 0, device=device)
    n = max_new_tokens
    cached = s  # the decoder's cache holds the keys and values of out[:, :cached]
    computed = 0  # tokens the decoder's steps ran (drafted ones the model did not take too)
    try:
        for i in range(max_new_tokens):
            scores = logits if lookup is None else logits[row:row + 1]
            tokens = pick(out[:, :s + i], scores.float(), i)
            if unfinished is not None:
                tokens = torch.where(unfinished, tokens, pad)
            out[:, s + i] = tokens
            if streamer is not None:
                streamer.put(tokens.cpu())
            if callback is not None:
                callback(tokens)
            if unfinished is not None:
                unfinished &= ~torch.isin(tokens, eos)
                if not bool(unfinished.any()):  # the one host sync per step (EOS only)
                    n = i + 1
                    break
            if i + 1 == max_new_tokens:
                break
            if decoder is not None:
                run = tokens
                if lookup is not None:
                    lookup.extend(tokens.tolist())
                    if row < len(draft) and int(tokens[0]) == draft[row]:
                        row += 1  # a drafted token: its keys, values and the next token's
                        cached = s + i + 1  # logits came with the step that drafted it
                        continue
                    lookup.accepted(len(draft), row)
                    draft, row = lookup.draft(max_new_tokens - i - 1, decoder.step_seconds), 0
                    if draft:
                        run = torch.cat([tokens, tokens.new_tensor(draft)])
                logits = decoder.step(run, s + i)
                computed += run.shape[0]
                cached = s + i + 1
                continue
            if steps is not None:
                logits = steps.decode(tokens, s + i)
                continue
            step = dict(common, input_ids=tokens.unsqueeze(1), position_ids=next_pos)
            if cache_pos:
                step["cache_position"] = step_cache_pos
                step_cache_pos = step_cache_pos + 1
            logits = model(**step).logits[:, -1]
            next_pos = next_pos + 1
    finally:  # also where a streamer ends the reply (a stop string, Ctrl-C): what is cached
        if decoder is not None:  # stays for the next call, what was counted goes to this one's
            decoder.hold(out[0, :cached], total)
            decoder.flush_stats(computed)  # the tokens its steps ran
    if streamer is not None:
        streamer.end()
    return out if n == max_new_tokens else out[:, : s + n].clone()


# ---- Hugging Face generate() arguments ------------------------------------------------------


INVALID = "invalid arguments"  # a reason that is the call's fault: HF's generate says what


def _resolve(model, args: tuple, kwargs: dict, quiet: bool) -> dict:
    """HF generate arguments -> generate()'s keyword arguments; raises _Unsupported(name)."""
    reason = model_reason(model)
    if reason is not None:
        raise _Unsupported(reason)
    try:
        bound = inspect.signature(model.generate).bind(*args, **kwargs)
    except TypeError as e:
        raise _Unsupported(f"arguments generate() rejects ({e})") from None
    named = dict(bound.arguments)
    extra = dict(named.pop("kwargs", {}))
    inputs = named.pop("inputs", None)
    if "input_ids" in extra:
        if inputs is not None:
            raise _Unsupported("both inputs and input_ids")
        inputs = extra.pop("input_ids")
    user_config = named.pop("generation_config", None)
    streamer = named.pop("streamer", None)
    extra.pop("tokenizer", None)  # HF takes it for stop_strings only, checked below
    processors = named.pop("logits_processor", extra.pop("logits_processor", None)) or ()
    for process in processors:  # HF's generate puts such a one in place of its own
        if type(process).__name__ in _BUILT_BY_HF:
            raise _Unsupported(f"a logits_processor of a kind generate builds ({process!r})")
    for name in _HF_ONLY:
        value = named.pop(name, extra.pop(name, None))
        if value is not None and value is not False:
            raise _Unsupported(name)
    for name, value in named.items():  # a generate() parameter this module does not know
        if value is not None and value is not False:
            raise _Unsupported(name)
    if not isinstance(inputs, torch.Tensor):
        raise _Unsupported("inputs_embeds" if "inputs_embeds" in extra else "input_ids missing")
    if inputs.ndim == 2 and inputs.shape[0] > 0 and inputs.shape[1] == 0:
        raise ValueError(f"input_ids of shape {tuple(inputs.shape)} has no tokens: generation "
                         "needs at least one to start from")
    if inputs.dtype.is_floating_point or inputs.dtype.is_complex:
        raise _Unsupported(f"{INVALID} (input_ids of dtype {inputs.dtype})")
    if inputs.ndim != 2 or inputs.dtype not in (torch.long, torch.int) or 0 in inputs.shape:
        raise _Unsupported(f"input_ids of shape {tuple(inputs.shape)} {inputs.dtype}")

    prepare = getattr(model, "_prepare_generation_config", None)
    if prepare is None:
        raise _Unsupported("this transformers version (no _prepare_generation_config)")
    try:
        # GenerationConfig.update warns about odd combinations; HF generate says it again if
        # the call falls back, so nothing is said while checking
        with quiet_transformers() if quiet else contextlib.nullcontext():
            gc, model_kwargs = prepare(user_config, **extra)
    except (TypeError, ValueError) as e:
        raise _Unsupported(f"{INVALID} ({type(e).__name__}: {e})") from None
    validate = getattr(model, "_validate_model_kwargs", None)
    if validate is not None:  # a misspelt argument (max_new_token=5) is HF's error to raise
        try:
            validate(dict(model_kwargs))
        except ValueError as e:
            raise _Unsupported(f"{INVALID} ({e})") from None
    attention_mask = model_kwargs.pop("attention_mask", None)
    for name, value in model_kwargs.items():
        if value is not None and name != "use_cache":
            raise _Unsupported(name)
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or attention_mask.shape != inputs.shape):
        raise _Unsupported("attention_mask not of input_ids' shape")

    get_defaults = getattr(gc, "_get_default_generation_params", dict)
    defaults = get_defaults()
    for name, value in vars(gc).items():
        if name.startswith("_") or name in _HANDLED or name in _IGNORED:
            continue
        if value != defaults.get(name) and not (value is None and not defaults.get(name)):
            raise _Unsupported(f"{name}={value!r}")
    if gc.cache_implementation not in _CACHES:
        raise _Unsupported(f"cache_implementation={gc.cache_implementation!r}")

    eos = gc.eos_token_id
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    eos_list = [] if eos is None else [eos] if not isinstance(eos, (list, tuple)) else list(eos)
    # counts and token ids are ints in this loop; HF decides about anything else (5.0 it takes,
    # 2.5 it refuses), so such a call is HF's
    for name, value in (("max_new_tokens", gc.max_new_tokens), ("max_length", gc.max_length),
                        ("min_new_tokens", gc.min_new_tokens), ("min_length", gc.min_length),
                        ("top_k", gc.top_k), ("pad_token_id", gc.pad_token_id),
                        ("prompt_lookup_num_tokens", gc.prompt_lookup_num_tokens),
                        *(("eos_token_id", e) for e in eos_list)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise _Unsupported(f"{INVALID} ({name}={value!r} is not an int)")

    s = inputs.shape[1]
    if gc.max_new_tokens is not None:
        max_new = gc.max_new_tokens
    else:
        has_default = (kwargs.get("max_length") is None
                       and (user_config is None or user_config.max_length is None)
                       and model.generation_config.max_length is None)
        max_length = gc.max_length
        if has_default:  # HF: 20 new tokens, within the model's positions
            max_length += s
            limit = getattr(model.config, "max_position_embeddings", None)
            if limit is not None:
                max_length = min(max_length, limit)
        max_new = max_length - s
    if max_new <= 0:  # HF says what is wrong
        raise _Unsupported(f"{INVALID} (max_length {s + max_new} <= the prompt's {s} tokens)")
    if getattr(model.config, "alibi", False) is True:
        raise _Unsupported("ALiBi attention (Falcon's takes its biases' length from a dynamic "
                           "cache; picompile's loop keeps a static one)")
    switch = _long_rope_switch(model.config)
    if switch is not None and s <= switch < s + max_new:
        raise _Unsupported(f"a LongRoPE model crossing its original context of {switch} tokens "
                           "(its generate computes the cache again there, with the long factors)")
    min_new = (gc.min_new_tokens if gc.min_new_tokens is not None
               else max(0, (gc.min_length or 0) - s))

    pad = gc.pad_token_id
    if pad is None and eos_list:
        pad = eos_list[0]
    if not quiet and inputs.shape[0] > 1:
        for line in _padding_notes(inputs, attention_mask, gc.pad_token_id, pad, eos_list):
            note(line)
    if attention_mask is None and pad is not None and pad not in eos_list:
        # HF infers the mask from pad tokens in the prompt when pad differs from EOS.
        if bool((inputs == pad).any()):
            attention_mask = inputs.ne(pad).long()
    sample = bool(gc.do_sample)
    penalty = 1.0 if gc.repetition_penalty is None else gc.repetition_penalty
    # values HF's processors refuse (their errors, from HF's generate); a top_p >= 1 is no warper
    if (not isinstance(penalty, float) or not penalty > 0
            or sample and gc.top_k is not None and gc.top_k < 0
            or sample and gc.min_p is not None and not 0 <= gc.min_p <= 1):
        raise _Unsupported(f"{INVALID} (repetition_penalty={penalty!r}, top_k={gc.top_k!r}, "
                           f"min_p={gc.min_p!r})")
    return dict(input_ids=inputs, attention_mask=attention_mask, max_new_tokens=max_new,
                min_new_tokens=min_new, do_sample=sample,
                temperature=gc.temperature if sample and gc.temperature is not None else 1.0,
                top_k=gc.top_k if sample and gc.top_k else None,
                top_p=gc.top_p if sample and gc.top_p is not None and gc.top_p < 1 else None,
                min_p=gc.min_p if sample else None,
                repetition_penalty=penalty, logits_processor=processors,
                eos_token_id=eos_list or None, pad_token_id=pad, streamer=streamer,
                prompt_lookup=gc.prompt_lookup_num_tokens)


def _padding_notes(inputs: torch.Tensor, mask: torch.Tensor | None, pad_given: int | None,
                   pad: int | None, eos: list[int]) -> list[str]:
    """What HF's generate warns of in a batch (inputs [B > 1, S]), as it decides it: a pad token
    that cannot be told from the text (none given, or the EOS token) without an attention mask,
    and right padding (a decoder-only model continues each row after its last position)."""
    out = []
    if mask is None and eos and (pad_given is None or pad in eos):
        out.append("generate: a batch without attention_mask, and its pad token is "
                   f"{'not set' if pad_given is None else 'the EOS token'}: padding cannot be told "
                   "from text; pass the tokenizer's attention_mask for reliable results")
    if mask is not None:
        right_padded = bool((mask[:, -1] == 0).any())
    else:  # as HF: a row ending in the pad token
        right_padded = pad is not None and bool((inputs[:, -1] == pad).any())
    if right_padded:
        out.append("generate: right padding in the batch: a decoder-only model needs its rows "
                   "padded on the left (the tokenizer's padding_side='left')")
    return out


def learned_positions(model: nn.Module, limit: int) -> bool:
    """Whether the model embeds positions by a learned table of `limit` rows (GPT-2's wpe, OPT's
    embed_positions, which has 2 more): it cannot run a position past them."""
    tokens = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return any(isinstance(m, nn.Embedding) and m is not tokens
               and m.num_embeddings - getattr(m, "offset", 0) == limit for m in model.modules())


def rope_scaling(config) -> tuple[str | None, dict]:
    """(rope type, its parameters) of a config's RoPE (rope_parameters, or rope_scaling as older
    configs name it): ("longrope", {...}), ("dynamic", {...}); (None, {}) where it says none."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return None, {}
    return params.get("rope_type", params.get("type")), params


def _long_rope_switch(config) -> int | None:
    """The length past which a LongRoPE model (Phi-3 128k and the like) rotates with its long
    factors, or None: keys cached before it were rotated with the short ones."""
    kind, params = rope_scaling(config)
    if kind != "longrope":
        return None
    return (getattr(config, "original_max_position_embeddings", None)
            or params.get("original_max_position_embeddings"))


def supported(model, kwargs: dict, args: tuple = ()) -> str | None:
    """None if generate_hf(model, *args, **kwargs) runs picompile's loop with HF's result, else
    the first argument (or model property) it does not handle, for a one-line note."""
    try:
        _resolve(model, tuple(args), dict(kwargs), quiet=True)
    except _Unsupported as e:
        return str(e)
    return None


def generate_hf(model, *args, decoder=None, steps=None, prompt_lookup: int = 0,
                **kwargs) -> torch.Tensor:
    """picompile's loop called with Hugging Face generate() arguments (check supported() first:
    raises TypeError naming what it does not handle); `decoder`, `steps` as generate() takes
    them, `prompt_lookup` where the arguments set no prompt_lookup_num_tokens."""
    try:
        call = _resolve(model, args, kwargs, quiet=False)
    except _Unsupported as e:
        raise TypeError(f"picompile generate does not handle {e}; "
                        "use the model's own generate()") from None
    limit = getattr(model.config, "max_position_embeddings", None)
    total = call["input_ids"].shape[1] + call["max_new_tokens"]
    if isinstance(limit, int) and total > limit and learned_positions(model, limit):
        room = limit - call["input_ids"].shape[1]
        raise ValueError(f"generate: {total} tokens in all is more than the model's {limit} "
                         "learned positions, past which it has no position embedding: " +
                         (f"ask for at most {room} new tokens" if room > 0 else
                          f"the prompt alone has {call['input_ids'].shape[1]} tokens"))
    if isinstance(limit, int) and total > limit:  # as HF's generate warns
        note(f"generate: {total} tokens in all is more than the model's context of {limit}: "
             "its tokens past there may mean little")
    if call["prompt_lookup"] is None:  # the call's own, 0 too, before the model's default
        call["prompt_lookup"] = prompt_lookup
    return generate(model, **call, decoder=decoder, steps=steps)
