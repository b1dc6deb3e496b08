"""An OpenAI-compatible HTTP server for a compiled model: `picompile serve`, picompile.serve().

    POST /v1/chat/completions   messages -> the assistant's reply
    POST /v1/completions        a prompt (text, or token ids), or a list of up to 64 of them
                                -> their continuations
    GET  /v1/models             the one model served
    GET  /health                {"status": "ok", "running": 0 or 1, "waiting": n, "max_queue": m}

Both completions endpoints stream with "stream": true: server-sent events in OpenAI's chunk
format, ending with `data: [DONE]`; "stream_options": {"include_usage": true} adds a usage chunk.

Requests. Sampling maps onto the model's generate(): temperature 0 is greedy, anything else
samples with temperature, top_p, and the extras top_k (0 or absent is off) and min_p (vLLM's and
llama.cpp's). Penalties act in both: OpenAI's frequency_penalty and presence_penalty (in [-2, 2],
over the reply's tokens), vLLM's repetition_penalty (HF's, over the prompt and reply) or
llama.cpp's repeat_penalty (the same over the last repeat_last_n tokens, 64 unless given; -1:
all); OpenAI's logit_bias adds to the listed tokens' scores before them; the model's
generation_config plays no part. seed seeds torch's global RNG, which is safe
because one request runs at a time. max_tokens (or max_completion_tokens) defaults to
DEFAULT_MAX_TOKENS, within the model's context; a prompt plus max_tokens past the context is a
400; 0 only with a completion's echo (the prompt scored with logprobs, nothing generated).
stop takes up to MAX_STOPS strings; vLLM's stop_token_ids end the reply too, its ignore_eos
lets it run past the model's end tokens, and its min_tokens holds end tokens back for that many
tokens (stop strings still apply). finish_reason is "stop" (an end token or a stop string) or
"length". Replies count prompt and completion tokens in "usage".
The "model" field is accepted whatever it names: the server serves one model, and replies carry
its name. Log-probabilities as OpenAI gives them: chat's logprobs with top_logprobs (at most
20), a completion's logprobs=N (the N likeliest, and the chosen token) and echo (the prompt, its
tokens' log-probabilities too); they are the model's own (a log-softmax of its logits, before
penalties, temperature and truncation: vLLM's default), and a token's text is its own decoding
(a piece of a character shows as U+FFFD). Structured output (runtime/grammar.py): OpenAI's
response_format (json_object, json_schema; llama.cpp's "schema" beside either), llama.cpp's
json_schema and grammar (GBNF), vLLM's guided_json / guided_regex / guided_choice /
guided_grammar and structured_outputs; one per request, compiled off the event loop; a reply
its parser cannot follow to the end is a 400, never a short reply. Tools (picompile/tool_calls.py):
chat's tools, tool_choice ("auto": the Hermes-style <tool_call> blocks the model writes are read;
"required" or a named function: a grammar holds the reply to one call's JSON) and
parallel_tool_calls, through the model's chat template (a 400 where it has none that describes
tools); calls come back as tool_calls with finish_reason "tool_calls" (streamed: the text
before a call streams as it comes, each call whole in one delta at the end). n (up to
MAX_CHOICES) asks for that many replies to one prompt: they run one after the other (the prompt
cache spares each the prompt's prefill), choice i seeded with seed + i where a seed is given;
streamed, each choice's chunks carry its index, choice after choice; usage counts the prompt
once and every choice's tokens. A completion's list of prompts (what batched evaluation
harnesses send) gives each prompt's n replies in turn: choices k * n to k * n + n - 1 are prompt
k's, each as that prompt alone would give them; at most 64 replies a request.
Parameters picompile cannot honour (best_of, suffix, ...)
get a 400 naming them rather than being silently ignored; fields OpenAI's client sends for
bookkeeping (user, metadata, ...) are ignored.

Chat prompts use the tokenizer's chat template. A tokenizer without one gets a plain format: one
"role: content" line per message, then "assistant:" for the model to continue, with "\\nuser:"
as an extra stop string so that the model does not write the user's next turn.

One request runs at a time: a worker thread runs generation, the others wait their turn in a
FIFO queue of at most max_queue requests, and a request that finds the queue full gets a 503.
A client that goes away (mid-stream, or while waiting) is cancelled: its generation stops at the
next token (the streamer checks a flag) and the next request starts.

Browsers: a web page on another origin may call the server only where `allowed_origins` (the
CLI's --allowed-origins) names its origin, or "*" for any (CORS, preflight requests answered);
none by default, and a request from a page elsewhere (its Origin header) gets a 403 before it
runs, even one a browser sends without asking first, so that a page the user happens to open
cannot make a server on localhost generate.

Errors are JSON in OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a bad
request, 401 for a missing or wrong API key (when one is set; /health needs none), 404 / 405 for
a wrong path or method, 503 when the queue is full, 500 if generation itself fails; never a stack
trace. Request bodies are checked here field by field, so that each 400 names its field.

Why FastAPI on uvicorn: a well-kept ASGI stack that routes, streams responses and notices
clients that disconnect, so there is no hand-written HTTP here. They are the `serve` extra
(pip install 'picompile[serve]') and imported only when a server is made: `import picompile`
does not need them. (No `from __future__ import annotations` in this module: FastAPI reads the
route functions' annotations, which name classes imported inside make_app.)
"""

import asyncio
import collections
import contextlib
import hmac
import importlib
import json
import logging
import math
import pathlib
import re
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import torch

from picompile import tool_calls
from picompile.conversation import (NoToolSupport, ReplyStreamer, StopString, TextDeltas,
                                    chat_prompt, end_tokens)
from picompile.runtime.grammar import GrammarComplete, GrammarError, Grammars
from picompile.runtime.sampling import (FrequencyPresencePenalty, LogitBias,
                                        RecentRepetitionPenalty)

DEFAULT_MAX_TOKENS = 512
DEFAULT_MAX_QUEUE = 16
MAX_STOPS = 16  # OpenAI takes 4; evaluation harnesses send more (vLLM and llama.cpp take any)
MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit (its completions': 5; vLLM's: 20)
MAX_CHOICES = 16  # n: replies to one prompt (OpenAI's limit is 128; each runs in turn here)
MAX_PROMPTS = 64  # prompts in one completion request, and their replies in all (each in turn)
ROLES = ("system", "developer", "user", "assistant", "tool")
# Parameters picompile cannot honour -> the value that means "off" besides null / false / 0 /
# empty (best_of=1 is the default, not "off": best_of=0 is refused like 2). Beside OpenAI's own,
# llama.cpp's and vLLM's names for samplers and constraints a client may send expecting them to
# act (other unknown fields are ignored, as both servers do).
_UNSUPPORTED = {"best_of": 1,
                "suffix": None, "functions": None, "function_call": "none",
                "typical_p": None, "tfs_z": None,
                "mirostat": None, "dry_multiplier": None, "xtc_probability": None,
                "guided_whitespace_pattern": None}
# Structured output: each field that asks for it -> its grammar format (runtime/grammar.py)
_GRAMMAR_FIELDS = {"json_schema": "json_schema", "guided_json": "json_schema",  # llama.cpp, vLLM
                   "guided_regex": "regex", "guided_choice": "choice",  # vLLM
                   "grammar": "grammar", "guided_grammar": "grammar"}  # GBNF or Lark
# vLLM's structured_outputs object: its keys -> their grammar format (and json_object: true)
_STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                       "grammar": "grammar"}
_DISCONNECT_POLL_S = 0.5  # how often a waiting non-streaming request checks for its client

log = logging.getLogger("picompile.serve")


def require() -> None:
    """Raise ImportError with the install command if the `serve` extra is missing."""
    for name in ("fastapi", "uvicorn"):
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ImportError(f"picompile's server needs FastAPI and uvicorn ({e}); install "
                              "them with: pip install 'picompile[serve]'") from None


def serve(cm, tokenizer, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          *, max_queue: int = DEFAULT_MAX_QUEUE, max_tokens: int = DEFAULT_MAX_TOKENS,
          model_name: str | None = None, log_level: str = "info",
          allowed_origins: Sequence[str] = ()) -> None:
    """Serve `cm` over an OpenAI-compatible HTTP API until interrupted (see the module doc).
    Binds 127.0.0.1 unless told otherwise: anyone who can reach the port can use the model, so
    set `api_key` (clients send it as a Bearer token) before binding a public address."""
    require()
    import uvicorn

    app = make_app(cm, tokenizer, api_key=api_key, max_queue=max_queue, max_tokens=max_tokens,
                   model_name=model_name, allowed_origins=allowed_origins)

    class StoppingServer(uvicorn.Server):
        """On Ctrl-C the requests running and waiting end at once (with an error), before
        uvicorn waits for their connections to close: else it waits for every generation."""

        async def shutdown(self, sockets=None):
            await asyncio.to_thread(app.state.engine.stop)
            await super().shutdown(sockets)

    with contextlib.suppress(KeyboardInterrupt):  # uvicorn raises the Ctrl-C again when done
        StoppingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level)).run()


def check_port_free(host: str, port: int) -> None:
    """Raise OSError (saying which address) where `host`:`port` cannot be bound now: checked
    before minutes of loading and compiling a model."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        try:
            s.bind(address)
        except OSError as e:
            raise OSError(e.errno, f"cannot listen on {host}:{port} ({e.strerror}): is another "
                                   "server running there? choose another --port") from None


def check_origin(origin: str) -> str:
    """origin, if it is a web origin as browsers send it (scheme://host[:port], no path or
    trailing slash, which would never match) or "*"; else ValueError saying so."""
    if origin != "*" and not re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/\s?#]+", origin):
        raise ValueError(f"{origin!r} is not a web origin: write scheme://host[:port] with no "
                         "path, e.g. http://localhost:3000, or * for any")
    return origin


class APIError(Exception):
    """An error reply in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _bad(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _failed(event: tuple) -> APIError:
    """An ("error", message, status) event as the error reply."""
    _, message, status = event
    return APIError(status, message, "invalid_request_error" if status < 500 else "server_error")


# ---- reading requests --------------------------------------------------------------------


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _field(body: dict, name: str, kind: type, default=None, low=None, high=None):
    """body[name] (default when absent or null), refused with a 400 naming it unless it is of
    `kind` (int, float: a finite number, bool, str; true is not 1 here) and in [low, high]."""
    value = body.get(name)
    if value is None:
        return default
    if kind is float:
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value))
    else:
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    ok = ok and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        what = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
        bounds = (f" in [{low}, {high}]" if low is not None and high is not None else
                  f" >= {low}" if low is not None else f" <= {high}" if high is not None else "")
        raise _bad(name, f"{name} must be {what[kind]}{bounds}, got {_show(value)}")
    return value


def _check_unsupported(body: dict) -> None:
    for name, off in _UNSUPPORTED.items():
        value = body.get(name)
        if not (value is None or value == off
                or off is None and value in (False, 0, "", [], {})):
            raise _bad(name, f"{name}={_show(value)} is not supported by picompile's server",
                       code="unsupported_parameter")


def _logprobs(body: dict, chat: bool) -> tuple[int | None, bool]:
    """-> (how many likeliest tokens to list beside each chosen one's log-probability, None
    for no log-probabilities; echo). Chat: logprobs true with top_logprobs; a completion:
    logprobs N, and echo."""
    if chat:
        if body.get("echo"):
            raise _bad("echo", "echo is a completion's field; chat replies do not repeat the "
                               "messages", code="unsupported_parameter")
        top = _field(body, "top_logprobs", int, None, 0, MAX_TOP_LOGPROBS)
        if not _field(body, "logprobs", bool, False):
            if top is not None:
                raise _bad("top_logprobs", "top_logprobs needs logprobs: true")
            return None, False
        return top or 0, False
    if body.get("top_logprobs") is not None:
        raise _bad("top_logprobs", "top_logprobs is chat's field; a completion asks with "
                                   "logprobs: N")
    return (_field(body, "logprobs", int, None, 0, MAX_TOP_LOGPROBS),
            _field(body, "echo", bool, False))


def _penalties(body: dict, prompt_tokens: int) -> tuple:
    """The logits processors of OpenAI's, vLLM's and llama.cpp's penalty fields, in vLLM's
    order: the repetition penalty (HF's arithmetic), then frequency and presence."""
    penalty = {name: _field(body, name, float, None, 0, 10)
               for name in ("repetition_penalty", "repeat_penalty")}
    for name, value in penalty.items():
        if value == 0:
            raise _bad(name, f"{name} must be > 0 (1 is off), got 0")
    if None not in penalty.values():
        raise _bad("repeat_penalty", "give repetition_penalty (vLLM's, over the whole prompt "
                                     "and reply) or repeat_penalty (llama.cpp's, over the last "
                                     "repeat_last_n tokens), not both")
    last_n = _field(body, "repeat_last_n", int, 64, -1)
    frequency = _field(body, "frequency_penalty", float, 0.0, -2, 2)
    presence = _field(body, "presence_penalty", float, 0.0, -2, 2)
    processors = []
    if penalty["repetition_penalty"] not in (None, 1.0):  # over the whole prompt and reply
        processors.append(RecentRepetitionPenalty(penalty["repetition_penalty"], -1))
    if penalty["repeat_penalty"] not in (None, 1.0) and last_n != 0:
        processors.append(RecentRepetitionPenalty(penalty["repeat_penalty"], last_n))
    if frequency or presence:
        processors.append(FrequencyPresencePenalty(prompt_tokens, frequency, presence))
    return tuple(processors)


def _grammar_request(body: dict) -> tuple[str, str, str] | None:
    """(field, format, text) of the request's structured-output field, or None: OpenAI's
    response_format (json_object: any JSON object; json_schema: its schema; llama.cpp's
    "schema" beside either type), llama.cpp's json_schema and grammar (GBNF), vLLM's
    guided_json / regex / choice / grammar and its newer structured_outputs object."""
    asked = []
    form = body.get("response_format")
    if form is not None:
        kind = form.get("type") if isinstance(form, dict) else None
        spec = form.get("json_schema") if isinstance(form, dict) else None
        schema = (spec.get("schema") if isinstance(spec, dict) else
                  form.get("schema") if isinstance(form, dict) else None)
        if kind == "json_object" and schema is None:
            asked.append(("response_format", "json_schema", '{"type": "object"}'))
        elif kind in ("json_object", "json_schema") and isinstance(schema, dict):
            asked.append(("response_format", "json_schema", json.dumps(schema)))
        elif not (kind == "text" and len(form) == 1):
            raise _bad("response_format", 'response_format must be {"type": "text"}, {"type": '
                                          '"json_object"} or {"type": "json_schema", '
                                          '"json_schema": {"name": ..., "schema": {...}}}, got '
                                          f"{_show(form)}")
    fields = [(name, format, body.get(name)) for name, format in _GRAMMAR_FIELDS.items()]
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict) or set(outputs) - {*_STRUCTURED_OUTPUTS, "json_object"}:
            raise _bad("structured_outputs", "structured_outputs must be an object with one of "
                                             f"{', '.join(_STRUCTURED_OUTPUTS)} or json_object, "
                                             f"got {_show(outputs)}")
        fields += [(f"structured_outputs.{key}", _STRUCTURED_OUTPUTS[key], value)
                   for key, value in outputs.items() if key != "json_object"]
        if outputs.get("json_object") not in (None, False):
            fields.append(("structured_outputs.json_object", "json_schema", {"type": "object"}))
    for name, format, value in fields:
        if value is None:
            continue
        if format == "json_schema" and isinstance(value, dict):
            value = json.dumps(value)
        elif format == "choice":
            if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
                raise _bad(name, f"{name} must be a non-empty list of strings, got {_show(value)}")
            value = json.dumps(value)
        elif not isinstance(value, str):
            what = ("a JSON schema (an object, or its text)" if format == "json_schema"
                    else "a string")
            raise _bad(name, f"{name} must be {what}, got {_show(value)}")
        asked.append((name, format, _unicode(value, name)))
    if len(asked) > 1:
        raise _bad(asked[1][0], "give one structured-output field, got "
                                f"{' and '.join(a[0] for a in asked)}")
    return asked[0] if asked else None


def _which(k: int | None) -> str:
    """How errors name a completion's prompt: "the prompt", or "prompt k" of several."""
    return "the prompt" if k is None else f"prompt {k}"


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and s for s in stops)):
        raise _bad("stop", f"stop must be a non-empty string or a list of at most {MAX_STOPS} "
                           f"non-empty strings, got {_show(stop)}")
    return [_unicode(s, "stop") for s in stops]


def _unicode(text: str, where: str) -> str:
    """`text`, if it is valid Unicode: JSON's escapes can carry half of a surrogate pair (a
    client that cut a string through an emoji), which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(where, f"{where} holds {text[e.start]!r} at character {e.start}, half of a "
                          "UTF-16 surrogate pair: not valid Unicode text") from None
    return text


def _text_content(content, where: str) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return _unicode(content, where)
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return _unicode("\n".join(p["text"] for p in content), where)
    raise _bad(where, f"{where} must be a string or a list of text parts "
                      f"({{\"type\": \"text\", \"text\": ...}}; picompile serves text only), "
                      f"got {_show(content)}")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "messages must be a non-empty list of {\"role\", \"content\"} "
                               f"objects, got {_show(messages)}")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, f"{where} must be an object, got {_show(m)}")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}, "
                                        f"got {_show(role)}")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        # "developer" is OpenAI's newer name for "system"; chat templates know "system"
        message = {"role": "system" if role == "developer" else role,
                   "content": _text_content(content, f"{where}.content")}
        if role == "assistant" and m.get("tool_calls"):  # the calls it made, for the template
            message["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        if role == "tool" and m.get("tool_call_id") is not None:
            message["tool_call_id"] = str(m["tool_call_id"])
        out.append(message)
    return tool_calls.template_messages(out)


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool_calls: [{"id", "type": "function", "function": {"name",
    "arguments"}}]."""
    if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str)
            and isinstance(c["function"].get("arguments", ""), (str, dict)) for c in calls):
        raise _bad(where, f"{where} must be a list of {{\"id\", \"type\": \"function\", "
                          f"\"function\": {{\"name\", \"arguments\"}}}}, got {_show(calls)}")
    return [{"id": c.get("id"), "type": "function", "function": dict(c["function"])}
            for c in calls]


def _tools(body: dict, chat: bool
           ) -> tuple[list[dict] | None, list[dict], str, str | None, bool]:
    """-> (the request's tools as sent, checked; their functions; tool_choice's mode; the
    function it names; parallel_tool_calls)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise _bad("tool_choice", f"tool_choice={_show(choice)} needs tools")
        return None, [], "none", None, True
    if not chat:
        raise _bad("tools", "tools are a chat request's field (POST /v1/chat/completions)",
                   code="unsupported_parameter")
    try:
        functions = tool_calls.check_tools(tools)
    except ValueError as e:
        raise _bad("tools", str(e)) from None
    try:
        mode, name = tool_calls.check_tool_choice(choice, functions)
    except ValueError as e:
        raise _bad("tool_choice", str(e)) from None
    return tools, functions, mode, name, _field(body, "parallel_tool_calls", bool, True)


@dataclass
class Prompt:
    """One prompt of a request (a completion may send several): its tokens, its replies' limit,
    and per reply (n of them) its HF logits processors: penalties, a grammar (after logprobs'
    recorder), a tuple each (a grammar's matcher keeps its reply's state)."""
    ids: list[int]
    max_tokens: int
    processors: tuple[tuple, ...] = ((),)
    text: str | None = None  # what echo repeats: the prompt as sent (None: its ids')


@dataclass
class Params:
    """One checked request: what the worker needs to run it. Its choices are each prompt's n
    replies in turn: choice c is reply c % n to prompt c // n."""
    prompts: tuple[Prompt, ...]
    n: int = 1  # replies per prompt (OpenAI's n)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stops: tuple[str, ...] = ()
    logprobs: int | None = None  # likeliest tokens listed with each chosen one; None: no logprobs
    echo: bool = False
    tools: str | None = None  # how the reply's calls are read: "auto", "forced" (a grammar's
    # one call), None: not at all
    parallel_tool_calls: bool = True  # False: the first call only
    tool_names: tuple[str, ...] = ()  # the functions a call may name
    min_tokens: int = 0  # end tokens held back before this many (vLLM's)
    ignore_eos: bool = False  # the model's end tokens do not end the reply (vLLM's)
    stop_token_ids: tuple[int, ...] = ()  # more tokens that end it (vLLM's)

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n


# A token's log-probability as the worker hands it on: (its text, logprob, the likeliest
# tokens' (text, logprob) or None where none are listed: a prompt's first token).
Entry = tuple[str, float | None, list[tuple[str, float]] | None]
LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for a log-probability too low to show (no -inf in JSON)


# ---- generation on the worker thread ---------------------------------------------------


class _Cancelled(Exception):
    """Raised from the streamer: the client went away."""


class Job:
    """A request on its way through the queue. The worker sends events to the request's event
    loop through `events`, per choice c in turn: ("text", c, delta, [Entry] of the tokens since
    the last), then ("done", c, finish_reason, completion_tokens); or ("error", message, HTTP
    status), which ends the job. `cancelled` is set when the client goes away."""

    def __init__(self, params: Params, chat: bool, stream: bool, include_usage: bool,
                 loop: asyncio.AbstractEventLoop):
        self.params, self.chat, self.stream, self.include_usage = (
            params, chat, stream, include_usage)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        # per choice, characters of the reply sent: a completion's logprobs count them
        self.text_offset = [0] * params.choices
        self.echo: dict[int, tuple] = {}  # prompt -> (its text, its Entries), made once for echo

    def emit(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed: the server is shutting down
            pass


class _Logprobs:
    """The first logits processor of a request that asks for log-probabilities: keeps the
    log-softmax of each step's logits (the model's, before any penalty or warper), which the
    streamer pairs with the token picked from them."""

    def __init__(self, top: int, tokenizer, lock: threading.Lock):
        self.top, self.tokenizer, self.lock = top, tokenizer, lock
        self.last: torch.Tensor | None = None  # [V]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.last = scores[0].float().log_softmax(-1)
        return scores

    def entry(self, token: int, logprobs: torch.Tensor | None = None) -> Entry:
        """token's Entry under logprobs [V] (the last step's when None)."""
        logprobs = self.last if logprobs is None else logprobs
        values, ids = logprobs.topk(self.top)
        with self.lock:
            return (self.text(token), _floor(logprobs[token]),
                    [(self.text(t), _floor(v)) for t, v in zip(ids.tolist(), values.tolist())])

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def prompt(self, model, ids: torch.Tensor) -> list[Entry]:
        """The prompt's tokens, each but the first with its log-probability after those
        before it (one forward over the prompt, every position's logits kept)."""
        with torch.no_grad():
            logprobs = model(ids).logits[0].float().log_softmax(-1)  # [S, V]
        tokens = ids[0].tolist()
        with self.lock:
            first = [(self.text(tokens[0]), None, None)]
        return first + [self.entry(t, logprobs[i]) for i, t in enumerate(tokens[1:])]


def _floor(value) -> float:
    return max(float(value), LOGPROB_FLOOR)


class _Streamer(ReplyStreamer):
    """The reply's text as events for the job, with its tokens' log-probabilities where asked;
    generation stops at the next token once the job is cancelled."""

    def __init__(self, job: Job, index: int, text: TextDeltas, ends: set[int],
                 logprobs: _Logprobs | None):
        super().__init__(text, ends)
        self.job, self.index, self.logprobs = job, index, logprobs
        self.entries: list[Entry] = []  # the tokens since the last text sent

    def put(self, value: torch.Tensor) -> None:
        if self.job.cancelled.is_set():
            raise _Cancelled
        token = int(value.reshape(-1)[0])
        # A completion lists an end token too (as OpenAI's legacy API and vLLM do: a harness
        # reading the last entry as the generated token needs it); chat's content does not.
        if self.logprobs is not None and self.prompt_seen and (
                not self.job.chat or token not in self.ends):
            self.entries.append(self.logprobs.entry(token))
        super().put(value)

    def on_text(self, delta: str) -> None:
        self.job.emit("text", self.index, delta, self.entries)
        self.entries = []


class Engine:
    """Runs one generation at a time on a worker thread, in the order requests came (FIFO); at
    most `max_queue` requests wait behind the running one, beyond that submit() raises a 503."""

    def __init__(self, model, tokenizer, max_queue: int = DEFAULT_MAX_QUEUE):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.model, self.tokenizer, self.max_queue = model, tokenizer, max_queue
        self.tokenizer_lock = threading.Lock()  # a fast tokenizer is not safe across threads
        self.eos, self.pad = end_tokens(model, tokenizer)
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: Job | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="picompile-serve-worker",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._closed = True
            for job in [*self._waiting, self._running]:
                if job is not None:
                    job.cancelled.set()
                    job.emit("error", "the server is shutting down", 503)
            self._waiting.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def stats(self) -> dict:
        with self._cond:
            return {"running": int(self._running is not None), "waiting": len(self._waiting),
                    "max_queue": self.max_queue}

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise APIError(503, "the server is shutting down", "server_error")
            if len(self._waiting) + (self._running is not None) > self.max_queue:
                raise APIError(503, f"the server is busy: one request is running and "
                                    f"{self.max_queue} are waiting, the most its queue holds; "
                                    "retry later", "server_error", code="queue_full")
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Stop `job`: out of the queue if it waits, at its next token if it runs; a finished
        job is left as it is."""
        job.cancelled.set()
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._running = self._waiting.popleft()
            try:
                self._run(job)
            finally:
                with self._cond:
                    self._running = None

    def _run(self, job: Job) -> None:
        """The job's choices, one after the other (the prompt cache spares each reply after a
        prompt's first that prompt's prefill)."""
        for c in range(job.params.choices):
            if job.cancelled.is_set() or not self._choice(job, c):
                return

    def _choice(self, job: Job, c: int) -> bool:
        """Generate the job's choice c (reply i of its prompt), its events emitted. -> False
        where the job ended (an error, sent as its event; or the client gone)."""
        p = job.params
        k, i = divmod(c, p.n)
        prompt = p.prompts[k]
        text = TextDeltas(self.tokenizer, p.stops, self.tokenizer_lock)
        logprobs = (None if p.logprobs is None
                    else _Logprobs(p.logprobs, self.tokenizer, self.tokenizer_lock))
        ends = (set() if p.ignore_eos else self.eos) | set(p.stop_token_ids)
        streamer = _Streamer(job, c, text, ends, logprobs)
        ids = torch.tensor([prompt.ids])
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=prompt.max_tokens,
                      min_new_tokens=p.min_tokens, eos_token_id=sorted(ends) or None,
                      pad_token_id=self.pad,
                      streamer=streamer, do_sample=p.temperature > 0,
                      repetition_penalty=1.0,  # the request's penalties only, not the model's
                      logits_processor=list(prompt.processors[i]))
        if logprobs is not None:  # first: it sees the model's own logits
            kwargs["logits_processor"].insert(0, logprobs)
        if p.temperature > 0:
            kwargs.update(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                          min_p=p.min_p)
        try:
            if p.echo:
                if k not in job.echo:  # once for its n replies (logprobs: a prompt's forward)
                    with self.tokenizer_lock:
                        echoed = prompt.text if prompt.text is not None else \
                            self.tokenizer.decode(prompt.ids, skip_special_tokens=True)
                    job.echo[k] = echoed, ([] if logprobs is None else
                                           logprobs.prompt(self.model, ids))
                job.emit("text", c, *job.echo[k])
            if p.seed is not None:  # choice i: seed + i (within torch's seeds)
                torch.manual_seed(p.seed if i == 0 else (p.seed + i) % 2**64)
            complete = False
            try:
                if prompt.max_tokens:  # (0: the echoed prompt scored, nothing generated)
                    self.model.generate(ids, **kwargs)
            except GrammarComplete:  # and the model has no end token to say so
                complete = True
            delta, stopped = streamer.text.flush()
            if delta or streamer.entries:
                streamer.on_text(delta)
            if stopped or complete:
                streamer.finish = "stop"
        except _Cancelled:
            return False
        except StopString:
            pass
        except GrammarError as e:  # the request's grammar, past what its parser can follow
            job.emit("error", f"the reply cannot be held to the grammar: {e}", 400)
            return False
        except Exception as e:  # the request fails, the server goes on
            log.exception("picompile serve: generation failed")
            job.emit("error", f"generation failed: {type(e).__name__}: {e}", 500)
            return False
        job.emit("done", c, streamer.finish, streamer.count)
        return True


# ---- the HTTP side (no FastAPI types: make_app wires these to routes) --------------------


class Server:
    """What the routes do: read a request into a Job and queue it, then give its result as one
    JSON body or as server-sent events."""

    def __init__(self, model, tokenizer, engine: Engine, model_name: str, max_tokens: int):
        self.tokenizer, self.engine, self.name, self.max_tokens = (
            tokenizer, engine, model_name, max_tokens)
        config = getattr(model, "config", None)
        self.context = getattr(config, "max_position_embeddings", None)
        self.vocab = getattr(config, "vocab_size", None) or len(tokenizer)
        self.grammars: Grammars | None = None  # made at the first request with a grammar
        self._grammars_lock = threading.Lock()
        self.created = int(time.time())

    def models(self) -> dict:
        return {"object": "list", "data": [self.model(self.name)]}

    def model(self, name: str) -> dict:
        """GET /v1/models/{name}: the served model's card (404 for any other name)."""
        if name != self.name:
            raise APIError(404, f"the model {name!r} does not exist: this server serves "
                                f"{self.name!r}", code="model_not_found")
        return {"id": self.name, "object": "model", "created": self.created,
                "owned_by": "picompile"}

    def health(self) -> dict:
        return {"status": "ok", **self.engine.stats()}

    def submit(self, body, chat: bool, loop: asyncio.AbstractEventLoop) -> Job:
        """Check the request, tokenize its prompt, compile its grammar and queue it (400 / 503
        as APIError). Runs off the event loop (a long prompt or a large grammar takes a while),
        and `loop` gets the job's events."""
        if not isinstance(body, dict):
            raise _bad(None, f"the request body must be a JSON object, got {_show(body)}")
        _field(body, "model", str)
        _check_unsupported(body)
        stream = _field(body, "stream", bool, False)
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise _bad("stream_options", "stream_options must be an object, "
                                         f"got {_show(options)}")
        include_usage = stream and _field(options or {}, "include_usage", bool, False)
        stops = _stops(body)
        logprobs, echo = _logprobs(body, chat)
        grammar = _grammar_request(body)
        tools, functions, tool_mode, tool_name, parallel = _tools(body, chat)
        if tool_mode in ("required", "named"):  # one call, held to its function's parameters
            if grammar is not None:
                raise _bad(grammar[0], f"{grammar[0]} and tool_choice={_show(body['tool_choice'])}"
                                       " both constrain the reply: send one of them")
            try:
                grammar = ("tool_choice", "json_schema",
                           tool_calls.forced_call_schema(functions, tool_name))
            except ValueError as e:  # two functions' $defs disagree
                raise _bad("tool_choice", str(e)) from None
        for name in ("min_tokens", "ignore_eos"):  # a complete grammar allows only an end token
            if grammar is not None and body.get(name):
                raise _bad(name, f"{name} cannot be combined with {grammar[0]}: once complete, "
                                 "the grammar allows only an end token",
                           code="unsupported_parameter")
        if tools is not None and tool_mode != "none" and logprobs is not None:
            raise _bad("logprobs", "logprobs with tools is not supported",
                       code="unsupported_parameter")
        extra_stops = []
        if chat:
            ids, extra_stops = self._chat_ids(_messages(body), tools,
                                              tools_optional=tool_mode == "none")
            given = [(ids, None)]
        else:
            given = self._prompts(body.get("prompt"))
        n = _field(body, "n", int, 1, 1, MAX_CHOICES)
        if len(given) * n > MAX_PROMPTS:
            raise _bad("n", f"{len(given)} prompts x n={n} replies: this server gives up to "
                            f"{MAX_PROMPTS} replies a request; send fewer")
        bias = self._logit_bias(body)  # stateless: one for all
        compiled = None if grammar is None else self._grammar(grammar)
        prompts = []
        for k, (ids, text) in enumerate(given):
            max_tokens = self._max_tokens(body, len(ids), k if len(given) > 1 else None, echo)
            shared = bias + _penalties(body, len(ids))  # stateless
            # one grammar matcher per reply: it keeps that reply's parser state
            grammars = [() if compiled is None else
                        (self.grammars.constraint(compiled, len(ids)),) for _ in range(n)]
            prompts.append(Prompt(ids, max_tokens, tuple(shared + g for g in grammars), text))
        params = Params(prompts=tuple(prompts), n=n,
                        temperature=_field(body, "temperature", float, 1.0, 0, 2),
                        top_p=_field(body, "top_p", float, 1.0, 0, 1),
                        top_k=_field(body, "top_k", int, 0, 0),
                        min_p=_field(body, "min_p", float, 0.0, 0, 1),
                        seed=_field(body, "seed", int, None, -2**63, 2**64 - 1),
                        stops=tuple(stops + extra_stops),
                        logprobs=logprobs, echo=echo,
                        tools={"auto": "auto", "required": "forced", "named": "forced"}.get(
                            tool_mode),
                        parallel_tool_calls=parallel,
                        tool_names=tuple(f["name"] for f in functions),
                        min_tokens=_field(body, "min_tokens", int, 0, 0,
                                          min(p.max_tokens for p in prompts)),
                        ignore_eos=_field(body, "ignore_eos", bool, False),
                        stop_token_ids=self._token_ids(body, "stop_token_ids"))
        job = Job(params, chat, stream, include_usage, loop)
        self.engine.submit(job)
        return job

    def _grammar(self, request: tuple[str, str, str]) -> str:
        """A request's grammar compiled (400 where it cannot be read), for Grammars.constraint.
        The tokenizer is wrapped for grammars at the first such request."""
        name, format, text = request
        try:
            with self._grammars_lock:
                if self.grammars is None:
                    with self.engine.tokenizer_lock:  # reads the tokenizer
                        self.grammars = Grammars(self.tokenizer, self.vocab,
                                                 sorted(self.engine.eos))
            return self.grammars.compile(format, text)
        except ImportError as e:
            raise _bad(name, str(e), code="unsupported_parameter") from None
        except GrammarError as e:
            raise _bad(name, f"{name} cannot be used: {e}") from None

    def _logit_bias(self, body: dict) -> tuple:
        """OpenAI's logit_bias {"token id": bias in [-100, 100]} as its logits processor."""
        bias = body.get("logit_bias")
        if not bias:
            return ()
        if not isinstance(bias, dict):
            raise _bad("logit_bias", f"logit_bias must be an object of token ids and biases, "
                                     f"got {_show(bias)}")
        out = {}
        for key, value in bias.items():
            token = (int(key) if isinstance(key, str) and key.isascii() and key.isdigit()
                     else None)  # ("²".isdigit(), but int() refuses it)
            if token is None or token >= self.vocab or isinstance(value, bool) or not (
                    isinstance(value, (int, float)) and -100 <= value <= 100):
                raise _bad("logit_bias", f"logit_bias maps token ids in [0, {self.vocab}) to "
                                         f"biases in [-100, 100], got {_show({key: value})}")
            out[token] = float(value)
        return (LogitBias(out),)

    def _token_ids(self, body: dict, name: str) -> tuple[int, ...]:
        """A list of token ids of the model's vocabulary (none where absent)."""
        ids = body.get(name)
        if ids is None:
            return ()
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab
                for t in ids):
            raise _bad(name, f"{name} must be a list of token ids in [0, {self.vocab}), got "
                             f"{_show(ids)}")
        return tuple(ids)

    def _chat_ids(self, messages: list[dict], tools: list[dict] | None = None,
                  tools_optional: bool = False) -> tuple[list[int], list[str]]:
        """The chat prompt's ids and stop strings; tools_optional (tool_choice "none"): a
        template that cannot describe the tools gets the messages alone."""
        with self.engine.tokenizer_lock:
            try:
                try:
                    return chat_prompt(self.tokenizer, messages, tools)
                except NoToolSupport as e:
                    if not tools_optional:
                        raise _bad("tools", str(e), code="unsupported_parameter") from None
                    return chat_prompt(self.tokenizer, messages)
            except ValueError as e:
                raise _bad("messages", str(e)) from None

    def _prompts(self, prompt) -> list[tuple[list[int], str | None]]:
        """A completion's prompt: a string or a list of token ids, or a list of up to
        MAX_PROMPTS of those -> [(its ids, the string or None)] per prompt."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) > MAX_PROMPTS:
                raise _bad("prompt", f"{len(prompt)} prompts: this server takes up to "
                                     f"{MAX_PROMPTS} a request")
            return [self._prompt_ids(p, k if len(prompt) > 1 else None)
                    for k, p in enumerate(prompt)]
        return [self._prompt_ids(prompt)]

    def _prompt_ids(self, prompt, k: int | None = None) -> tuple[list[int], str | None]:
        """One prompt (prompt k of several): a string or a list of token ids -> (its ids, the
        string or None)."""
        which = _which(k)
        if isinstance(prompt, str):
            _unicode(prompt, "prompt")
            with self.engine.tokenizer_lock:
                ids = list(self.tokenizer(prompt)["input_ids"])
            if not ids:
                raise _bad("prompt", f"{which} gives no tokens (it is empty and the tokenizer "
                                     "adds no start token); give a non-empty prompt")
            return ids, prompt
        if (isinstance(prompt, list) and prompt
                and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            if not all(0 <= t < self.vocab for t in prompt):
                raise _bad("prompt", f"{which}: token ids must be in [0, {self.vocab})")
            return prompt, None
        raise _bad("prompt", f"{which} must be a string, a non-empty list of token ids, or a "
                             f"list of those, got {_show(prompt)}")

    def _max_tokens(self, body: dict, n_prompt: int, k: int | None = None,
                    echo: bool = False) -> int:
        """The reply's token limit for a prompt of n_prompt tokens (prompt k of several); 0 only
        with echo (the prompt scored, nothing generated: what the legacy completions API and
        evaluation harnesses ask for; the prompt must still fit the context)."""
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
        asked = _field(body, name, int, None, 0 if echo else 1)
        if self.context is None:
            return self.max_tokens if asked is None else asked
        room = self.context - n_prompt
        least = 0 if asked == 0 else 1  # tokens the reply needs beside the prompt
        if room < least or (asked is not None and asked > room):  # the prompt's fault if full
            raise _bad(name if room >= least else "messages" if "messages" in body else "prompt",
                       f"the model's context is {self.context} tokens: {_which(k)} has "
                       f"{n_prompt} and {name} asks for "
                       f"{'at least 1' if asked is None else asked}; shorten the prompt or ask "
                       "for fewer tokens", code="context_length_exceeded")
        return min(self.max_tokens, room) if asked is None else asked

    # replies

    @staticmethod
    def _usage(job: Job, completion: int) -> dict:
        """Usage: each prompt's tokens once (whatever its n), every reply's tokens."""
        prompt = sum(len(p.ids) for p in job.params.prompts)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _chunk(self, job: Job, c: int, text: str | None, finish: str | None = None,
               role: bool = False, entries: list[Entry] | None = None,
               calls: list[dict] | None = None) -> dict:
        """A streamed chunk of choice c."""
        logprobs = self._logprobs(job, c, entries) if entries else None
        if job.chat:
            delta = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if calls:  # each whole, in one chunk
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            choice = {"index": c, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": c, "text": text or "", "logprobs": logprobs,
                      "finish_reason": finish}
        chunk = {"id": job.id, "object": "chat.completion.chunk" if job.chat else "text_completion",
                 "created": job.created, "model": self.name, "choices": [choice]}
        if job.include_usage:  # OpenAI's: null in every chunk but the last one's
            chunk["usage"] = None
        return chunk

    @staticmethod
    def _logprobs(job: Job, c: int, entries: list[Entry]) -> dict:
        """OpenAI's logprobs object of choice c's (or its chunk's) tokens: chat's content list,
        or a completion's parallel lists with each token's character offset in its text."""
        if job.chat:
            def one(text: str, logprob: float) -> dict:
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
            return {"content": [dict(one(text, logprob), top_logprobs=[one(*t) for t in top])
                                for text, logprob, top in entries]}
        tops, offsets = [], []
        for text, logprob, top in entries:
            offsets.append(job.text_offset[c])
            job.text_offset[c] += len(text)
            # the likeliest, and the chosen token (OpenAI: up to logprobs + 1 of them)
            tops.append(None if top is None else {**dict(top), text: logprob})
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": tops, "text_offset": offsets}

    async def events(self, job: Job) -> AsyncIterator[str]:
        """The job's reply as server-sent events, choice after choice (the caller cancels the
        job when done)."""
        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        p = job.params
        completion = 0
        for c in range(p.choices):
            calls = None if p.tools is None else tool_calls.CallStream(
                forced=p.tools == "forced", names=p.tool_names)
            if job.chat:
                yield sse(self._chunk(job, c, "", role=True))
            while True:
                event = await job.events.get()
                if event[0] == "text" and calls is not None:  # text before a call streams
                    text = calls.feed(event[2])
                    if text:
                        yield sse(self._chunk(job, c, text))
                elif event[0] == "text":
                    yield sse(self._chunk(job, c, event[2], entries=event[3]))
                elif event[0] == "done":
                    _, _, finish, tokens = event
                    completion += tokens
                    if calls is not None:
                        content, found, finish = self._finish_calls(job, calls, finish)
                        if content or found:
                            yield sse(self._chunk(job, c, content, calls=found))
                    yield sse(self._chunk(job, c, None if job.chat else "", finish))
                    break
                else:
                    yield sse(_failed(event).body())
                    yield "data: [DONE]\n\n"
                    return
        if job.include_usage:
            yield sse({"id": job.id, "object": self._chunk(job, 0, None)["object"],
                       "created": job.created, "model": self.name, "choices": [],
                       "usage": self._usage(job, completion)})
        yield "data: [DONE]\n\n"

    async def result(self, job: Job, disconnected: Callable[[], Awaitable[bool]]) -> dict | None:
        """The job's whole reply as one JSON body; None if the client went away meanwhile (the
        job is cancelled then)."""
        n = job.params.choices
        parts, entries = [[] for _ in range(n)], [[] for _ in range(n)]
        finished = {}  # choice -> (finish_reason, completion tokens)
        loop = asyncio.get_running_loop()
        checked = loop.time()
        try:
            while len(finished) < n:
                event = await self._next(job, disconnected)
                if event is None:
                    return None
                if loop.time() - checked >= _DISCONNECT_POLL_S:  # events keep coming: look too
                    checked = loop.time()
                    if await disconnected():
                        return None
                if event[0] == "text":
                    parts[event[1]].append(event[2])
                    entries[event[1]] += event[3]
                elif event[0] == "error":
                    raise _failed(event)
                else:
                    _, c, finish, completion = event
                    finished[c] = finish, completion
        finally:
            self.engine.cancel(job)
        choices = []
        for c in range(n):
            text = "".join(parts[c])
            logprobs = None if job.params.logprobs is None else self._logprobs(job, c, entries[c])
            content, calls, finish = self._calls(job, text, finished[c][0])
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choices.append({"index": c, "message": message, "logprobs": logprobs,
                            "finish_reason": finish} if job.chat else
                           {"index": c, "text": text, "logprobs": logprobs,
                            "finish_reason": finish})
        return {"id": job.id, "object": "chat.completion" if job.chat else "text_completion",
                "created": job.created, "model": self.name, "choices": choices,
                "usage": self._usage(job, sum(t for _, t in finished.values()))}

    @staticmethod
    def _calls(job: Job, text: str, finish: str) -> tuple[str | None, list[dict], str]:
        """A reply's (content, tool calls, finish_reason): with tools, the calls read from its
        text (then finish_reason "tool_calls")."""
        p = job.params
        if p.tools is None:
            return text, [], finish
        try:
            content, calls = tool_calls.parse_calls(text, p.tools == "forced", p.tool_names)
        except (ValueError, KeyError, TypeError):  # a forced call cut short by max_tokens
            return text, [], finish
        if not calls:
            return text, [], finish
        return content, calls if p.parallel_tool_calls else calls[:1], "tool_calls"

    @staticmethod
    def _finish_calls(job: Job, reader, finish: str) -> tuple[str | None, list[dict], str]:
        """The rest of a reply a CallStream read: (content not yet sent, calls, finish_reason);
        a forced call cut short by max_tokens is left as the text it is."""
        try:
            content, calls = reader.finish()
        except (ValueError, KeyError, TypeError):
            return reader.held or None, [], finish
        if not calls:
            return content, [], finish
        return content, calls if job.params.parallel_tool_calls else calls[:1], "tool_calls"

    @staticmethod
    async def _next(job: Job, disconnected) -> tuple | None:
        """The job's next event, or None once the client has gone (checked every so often)."""
        get = asyncio.ensure_future(job.events.get())
        try:
            while not (await asyncio.wait({get}, timeout=_DISCONNECT_POLL_S))[0]:
                if await disconnected():
                    return None
            return get.result()
        finally:
            get.cancel()  # no-op once done


def model_name_of(model) -> str:
    """The name replies carry: the model's directory name, else "picompile"."""
    path = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return pathlib.Path(path).name.removesuffix(".gguf") or "picompile"


class _OriginGuard:
    """ASGI middleware: a request that a web page on another origin sends (a browser adds
    Origin) runs only where that origin is allowed, or is the server's own (FastAPI's /docs):
    a "simple" cross-origin POST (text/plain, no preflight) would otherwise run, whatever CORS
    then lets the page read. Preflights (OPTIONS) are CORS's to answer. (Plain ASGI, not
    Starlette's BaseHTTPMiddleware, which hides a client's disconnect from the routes.)"""

    def __init__(self, app, allowed: tuple[str, ...]):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers") or ()) if scope["type"] == "http" else {}
        origin = headers.get(b"origin", b"").decode("latin-1")
        if (not origin or scope["method"] == "OPTIONS" or "*" in self.allowed
                or origin in self.allowed
                or origin.partition("://")[2] == headers.get(b"host", b"").decode("latin-1")):
            return await self.app(scope, receive, send)
        from fastapi.responses import JSONResponse

        e = APIError(403, f"requests from web pages at {origin} are refused: start the server "
                          f"with --allowed-origins {origin} to allow them",
                     code="origin_not_allowed")
        await JSONResponse(e.body(), status_code=e.status)(scope, receive, send)


class _InternalErrors:
    """ASGI middleware, inside the CORS layer: an unexpected exception (a bug) becomes OpenAI's
    500 JSON here, so a web page on an allowed origin can read it (Starlette answers exceptions
    in its outermost layer, outside CORS: the page would see a bare network error). The
    traceback goes to the log; a response already started is ended by the server."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        started = False

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as e:
            if scope["type"] != "http" or started:
                raise
            log.exception("picompile serve: internal error")
            from fastapi.responses import JSONResponse

            error = APIError(500, f"internal error: {type(e).__name__}", "server_error")
            await JSONResponse(error.body(), status_code=500)(scope, receive, send)


def make_app(cm, tokenizer, *, api_key: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
             max_tokens: int = DEFAULT_MAX_TOKENS, model_name: str | None = None,
             allowed_origins: Sequence[str] = ()):
    """The FastAPI app serving `cm` (a CompiledModel, or any model with Hugging Face's generate
    and config) with `tokenizer`. Run it with uvicorn (serve() does); its worker thread runs
    from the app's startup to its shutdown. max_queue: how many requests may wait behind the
    running one before a 503; max_tokens: the default for requests that set none;
    allowed_origins: the web origins ("*": any) whose pages may call it from a browser."""
    require()
    from fastapi import APIRouter, Depends, FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    engine = Engine(cm, tokenizer, max_queue)
    server = Server(cm, tokenizer, engine, model_name or model_name_of(cm), max_tokens)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="picompile", lifespan=lifespan)
    app.state.engine = engine
    for origin in allowed_origins:
        check_origin(origin)

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return error(e)

    @app.exception_handler(HTTPException)  # no such path (404), wrong method (405)
    async def http_error(request: Request, e: HTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return error(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                              kind))

    app.add_middleware(_InternalErrors)  # the innermost: its 500s pass the CORS layer
    app.add_middleware(_OriginGuard, allowed=tuple(allowed_origins))
    if allowed_origins:  # (added after: the outer layer, so preflights are answered first)
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"],
                           allow_private_network=True)

    @app.exception_handler(Exception)  # a bug outside _InternalErrors (a middleware's)
    async def internal_error(request: Request, e: Exception):
        return error(APIError(500, f"internal error: {type(e).__name__}", "server_error"))

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                  api_key.encode()):
            raise APIError(401, "missing or incorrect API key: send it as the header "
                                "'Authorization: Bearer KEY'", code="invalid_api_key")

    class JobStream(StreamingResponse):
        """Server-sent events that cancel their job however the response ends: finished, the
        client gone, or an error (even one before the stream started)."""

        def __init__(self, job: Job):
            super().__init__(server.events(job), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
            self.job = job

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                engine.cancel(self.job)

    async def complete(request: Request, chat: bool):
        raw = await request.body()
        try:
            body = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deep
            raise _bad(None, f"the request body is not valid JSON in UTF-8 "
                             f"({type(e).__name__}: {str(e)[:100]})") from None
        job = await asyncio.to_thread(server.submit, body, chat, asyncio.get_running_loop())
        if job.stream:
            return JobStream(job)
        reply = await server.result(job, request.is_disconnected)
        return Response(status_code=499) if reply is None else JSONResponse(reply)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @v1.post("/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @v1.get("/models")
    async def models():
        return server.models()

    @v1.get("/models/{name:path}")
    async def model(name: str):  # "/v1/models/" (a trailing slash): the list
        return server.model(name) if name else server.models()

    @app.get("/health")
    async def health():
        return server.health()

    app.include_router(v1)
    return app
