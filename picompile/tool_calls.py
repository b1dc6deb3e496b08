"""Tool calling for `serve`'s chat endpoint, as OpenAI's API has it (and vLLM's and llama.cpp's
servers offer it): the request's `tools` (functions with JSON-schema parameters) go to the model
through its chat template, and the reply's calls come back as `tool_calls`.

    tools = check_tools(body["tools"])                  # ValueError naming what is wrong
    mode, name = check_tool_choice(body.get("tool_choice"), tools)
    schema = forced_call_schema(tools, name)            # "required" / a named function
    content, calls = parse_calls(text, forced=...)      # the reply -> (text or None, calls)

How a model calls a tool is its chat template's business; most instruction-tuned models with
tool support (Qwen2.5, Hermes, and others with Hermes' format) write each call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, which is what `parse_calls` reads
with tool_choice "auto". With tool_choice "required" or a named function, the reply is held by
a grammar (runtime/grammar.py) to one JSON object {"name": ..., "arguments": ...} matching a
tool's parameters, whatever format the model was trained on (vLLM does the same).
"""

from __future__ import annotations

import json
import re
import uuid

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's rule for function names


def check_tools(tools) -> list[dict]:
    """OpenAI's `tools`: a non-empty list of {"type": "function", "function": {"name",
    "description"?, "parameters"?}} with distinct names -> the functions ({"name",
    "description", "parameters"}), as chat templates take them. ValueError otherwise."""
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"tools must be a non-empty list of {{\"type\": \"function\", "
                         f"\"function\": {{...}}}} objects, got {_show(tools)}")
    functions, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f"{where} must be {{\"type\": \"function\", \"function\": "
                             f"{{...}}}}, got {_show(tool)}")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                not _NAME.fullmatch(fn["name"]):
            raise ValueError(f"{where}.function must have a name of 1 to 64 letters, digits, "
                             f"_ . or -, got {_show(fn)}")
        if fn["name"] in names:
            raise ValueError(f"{where}.function.name {fn['name']!r} is given twice")
        names.add(fn["name"])
        # none (or {}): a function of no arguments, as OpenAI reads an omitted schema
        parameters = fn.get("parameters") or {"type": "object", "properties": {},
                                              "additionalProperties": False}
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ValueError(f"{where}.function.parameters must be the JSON schema of an object "
                             f"(\"type\": \"object\"), got {_show(parameters)}")
        parameters = {"type": "object", **parameters}
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"{where}.function.description must be a string")
        functions.append({"name": fn["name"], "description": description or "",
                          "parameters": parameters})
    return functions


def check_tool_choice(choice, functions: list[dict]) -> tuple[str, str | None]:
    """OpenAI's `tool_choice` -> (mode, function name): "auto" (the default with tools: the
    model decides), "none" (it may not call), "required" (one call, any function), or
    ("named", name): a call of that function. ValueError for anything else."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto", None
    names = [f["name"] for f in functions]
    if isinstance(choice, dict) and choice.get("type") == "function" and \
            isinstance(choice.get("function"), dict) and choice["function"].get("name") in names:
        return "named", choice["function"]["name"]
    raise ValueError(f"tool_choice must be \"auto\", \"none\", \"required\" or {{\"type\": "
                     f"\"function\", \"function\": {{\"name\": one of {names}}}}}, got "
                     f"{_show(choice)}")


def forced_call_schema(functions: list[dict], name: str | None = None) -> str:
    """The JSON schema (text) of one call, {"name": ..., "arguments": {...}}, of the function
    `name`, or of any of `functions`. Each function's shared definitions ($defs, definitions:
    what Pydantic's schemas refer to as "#/$defs/...") move to the root, where those references
    point; ValueError where two functions define one name differently."""
    root: dict[str, dict] = {}

    def call(fn: dict) -> dict:
        parameters = dict(fn["parameters"])
        for key in ("$defs", "definitions"):
            for def_name, definition in (parameters.pop(key, None) or {}).items():
                if root.setdefault(key, {}).setdefault(def_name, definition) != definition:
                    raise ValueError(f"the functions define {key}/{def_name} differently: "
                                     "force a call of one of them (a named tool_choice)")
        return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": fn["name"]}, "arguments": parameters}}

    chosen = [fn for fn in functions if name is None or fn["name"] == name]
    schema = call(chosen[0]) if len(chosen) == 1 else {"anyOf": [call(fn) for fn in chosen]}
    return json.dumps({**schema, **root})


def parse_calls(text: str, forced: bool = False, names=None) -> tuple[str | None, list[dict]]:
    """A reply's text -> (its content, None where nothing but calls; the calls, OpenAI's
    tool_calls entries). forced: the whole text is one call's JSON (a grammar held it so);
    else each Hermes-style <tool_call> block holding one JSON object with a name (of `names`,
    where given) and object arguments is a call, and the text outside them the content (any
    other block stays in the content): its pieces without the whitespace next to a call,
    joined by a space. CallStream streams the same content."""
    if forced:
        value = json.loads(text)
        return None, [_call(value["name"], value["arguments"])]
    calls, kept, end = [], [], 0
    decoder = json.JSONDecoder()
    for start in (m.start() for m in re.finditer(re.escape(CallStream.MARK), text)):
        if start < end:
            continue
        body = start + len(CallStream.MARK)
        body += len(text[body:]) - len(text[body:].lstrip())
        try:
            value, stop = decoder.raw_decode(text, body)
        except ValueError:
            continue
        close = re.match(r"\s*</tool_call>", text[stop:])
        if close is None or not isinstance(value, dict):
            continue
        name, arguments = value.get("name"), value.get("arguments", value.get("parameters", {}))
        arguments = _arguments(arguments)
        if not (isinstance(name, str) and name and (names is None or name in names)
                and isinstance(arguments, dict)):
            continue
        calls.append(_call(name, arguments))
        kept.append(text[end:start])
        end = stop + close.end()
    if not calls:
        return text, []
    pieces = [kept[0].rstrip(), *(p.strip() for p in kept[1:]), text[end:].lstrip()]
    return " ".join(p for p in pieces if p) or None, calls


class CallStream:
    """A streamed reply read for calls: feed() each text delta, and stream what it returns (the
    text before a call could start: a tail that may begin "<tool_call>" is held back, and
    trailing whitespace, which parse_calls drops before a call), then finish() -> (the rest of
    the content, None where none; the calls). What streams and the rest join to parse_calls'
    content of the whole reply. forced: the whole reply is one call, nothing streams."""

    MARK = "<tool_call>"

    def __init__(self, forced: bool = False, names=None):
        self.forced, self.names, self.held, self.calling = forced, names, "", forced
        self.sent = ""  # the text streamed so far

    def feed(self, delta: str) -> str:
        self.held += delta
        if self.calling:
            return ""
        at = self.held.find(self.MARK)
        if at >= 0:
            self.calling = True
            cut = at
        else:  # hold back a tail that may be the mark's beginning
            cut = len(self.held) - next((k for k in range(min(len(self.MARK) - 1,
                                                               len(self.held)), 0, -1)
                                         if self.MARK.startswith(self.held[-k:])), 0)
        cut = len(self.held[:cut].rstrip())
        out, self.held = self.held[:cut], self.held[cut:]
        self.sent += out
        return out

    def finish(self) -> tuple[str | None, list[dict]]:
        content, calls = parse_calls(self.sent + self.held, self.forced, self.names)
        if not calls:
            return self.held or None, calls
        # the content begins with what streamed: the text before the first call, rstripped
        return (content or "")[len(self.sent):] or None, calls


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates take them: an assistant's tool_calls with their arguments
    as objects (OpenAI sends them as JSON text; templates write them with `tojson`)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [
                {**c, "function": {**c["function"],
                                   "arguments": _arguments(c["function"].get("arguments"))}}
                for c in calls]}
        out.append(m)
    return out


def _arguments(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _call(name: str, arguments) -> dict:
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        arguments = _arguments(arguments)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def _show(value) -> str:
    text = json.dumps(value)  # JSON's quoting, as the client wrote it (serve's messages too)
    return text if len(text) <= 80 else text[:77] + "..."
