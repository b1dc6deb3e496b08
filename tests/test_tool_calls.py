"""Tool calling in `serve` (picompile/tool_calls.py): the request's tools reach the model through
its chat template, and its calls come back as OpenAI's tool_calls. The fixture model has random
weights and no template of its own, so it gets a small Hermes-style one here, and what it writes
is held by grammars: tool_choice "required" / named (serve's own grammar), or a regular
expression that spells a call (to see "auto" read it)."""

from __future__ import annotations

import copy
import json
import pathlib

import httpx
import openai
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

import picompile
from picompile import tool_calls
from picompile.conversation import NoToolSupport, chat_prompt
from picompile.serve import make_app
from tests.test_serve import running

pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "relu_llama"
TEMPLATE = (
    "{% if tools %}<|system|>Tools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"enum": ["Paris", "Oslo"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def tokenizer():
    tok = AutoTokenizer.from_pretrained(FIXTURE, local_files_only=True)
    tok = copy.deepcopy(tok)
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def compiled():
    dense = AutoModelForCausalLM.from_pretrained(FIXTURE, local_files_only=True).eval()
    return picompile.compile(dense, quiet=True)


@pytest.fixture(scope="module")
def client(compiled, tokenizer):
    with running(make_app(compiled, tokenizer)) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def _check_call(call, names=("get_weather", "get_time")):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    args = json.loads(call.function.arguments)
    assert args in ({"city": "Paris"}, {"city": "Oslo"}, {"zone": "UTC"}, {"zone": "CET"})
    return call.function.name, args


def test_required_and_named_tool_choice_give_one_call_of_the_right_shape(client):
    kw = dict(model="m", messages=USER, tools=[WEATHER, TIME], max_tokens=60, temperature=0)
    r = client.chat.completions.create(tool_choice="required", **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    _check_call(call)
    r = client.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "get_time"}}, **kw)
    (call,) = r.choices[0].message.tool_calls
    assert _check_call(call)[0] == "get_time"
    chunks = list(client.chat.completions.create(tool_choice="required", stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0].tool_calls[0].index == 0
    _check_call(deltas[0].tool_calls[0])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_forced_calls_of_pydantic_style_schemas_and_bare_parameters(client):
    """A function's "$defs" (Pydantic's schemas refer to them) and one with no parameters."""
    units = {"type": "function", "function": {"name": "convert", "parameters": {
        "$defs": {"Unit": {"enum": ["C", "F"], "type": "string"}}, "type": "object",
        "additionalProperties": False, "required": ["unit"],
        "properties": {"unit": {"$ref": "#/$defs/Unit"}}}}}
    bare = {"type": "function", "function": {"name": "now", "parameters": {}}}
    kw = dict(model="m", messages=USER, max_tokens=60, temperature=0)
    for tools, want in (([units], "convert"), ([units, WEATHER], None), ([bare], "now")):
        r = client.chat.completions.create(tools=tools, tool_choice="required", **kw)
        assert r.choices[0].message.tool_calls, (tools, r.choices[0])
        (call,) = r.choices[0].message.tool_calls
        assert want in (None, call.function.name)
        args = json.loads(call.function.arguments)
        assert isinstance(args, dict)
        if call.function.name == "convert":
            assert args["unit"] in ("C", "F")


def test_auto_reads_the_calls_the_model_writes_and_the_text_around_them(client):
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    regex = "Checking\\. " + call.replace("{", "\\{").replace("}", "\\}")
    kw = dict(model="m", messages=USER, tools=[WEATHER], max_tokens=80, temperature=0,
              extra_body={"guided_regex": regex})
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content == "Checking."
    (got,) = message.tool_calls
    assert _check_call(got) == ("get_weather", {"city": "Oslo"})
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Checking."
    (got,) = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert _check_call(got) == ("get_weather", {"city": "Oslo"})
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    other = json.dumps({"name": "get_time", "arguments": {"zone": "UTC"}})  # not among tools
    r = client.chat.completions.create(**{**kw, "extra_body": {"guided_choice": [
        f"<tool_call>{other}</tool_call>"]}})
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(tool_choice="none", **kw)  # written, not read
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
    r = client.chat.completions.create(**{**kw, "extra_body": {"guided_choice": ["Sunny."]}})
    assert r.choices[0].message.content == "Sunny." and r.choices[0].finish_reason == "stop"


def test_parallel_calls_and_parallel_tool_calls_false(client):
    one = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    regex = (one + one.replace("UTC", "CET")).replace("{", "\\{").replace("}", "\\}")
    kw = dict(model="m", messages=USER, tools=[WEATHER, TIME], max_tokens=100, temperature=0,
              extra_body={"guided_regex": regex})
    calls = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["zone"] for c in calls] == ["UTC", "CET"]
    assert len({c.id for c in calls}) == 2
    calls = client.chat.completions.create(parallel_tool_calls=False, **kw).choices[0].message.tool_calls
    assert len(calls) == 1


def test_a_conversation_with_calls_and_results_reaches_the_template(tokenizer):
    """The assistant's earlier calls (arguments as OpenAI sends them: JSON text) and the
    tool's results go into the prompt as the template writes them."""
    messages = USER + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Snow, -3 C"}]
    ids, _ = chat_prompt(tokenizer, tool_calls.template_messages(messages), [WEATHER])
    text = tokenizer.decode(ids)
    assert '"name": "get_weather"' in text and '{"city": "Oslo"}' in text
    assert "<|tool|>Snow, -3 C" in text and text.count("get_weather") == 2  # tools + the call


def test_a_template_without_tools_takes_them_only_with_tool_choice_none(compiled, tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"  # no tools
    with running(make_app(compiled, plain)) as base:
        body = {"model": "m", "messages": USER, "tools": [WEATHER], "max_tokens": 2}
        r = httpx.post(f"{base}/v1/chat/completions", json={**body, "tool_choice": "none"})
        assert r.status_code == 200, r.text
        r = httpx.post(f"{base}/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_bad_tool_requests_get_400s_naming_the_field(client, tokenizer):
    base = client.base_url
    for body, field in [
            ({"messages": USER, "tools": [{"type": "function", "function": {}}]}, "tools"),
            ({"messages": USER, "tools": [WEATHER, WEATHER]}, "tools"),
            ({"messages": USER, "tools": [WEATHER],
              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
            ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
            ({"messages": USER, "tools": [WEATHER], "logprobs": True}, "logprobs"),
            ({"messages": USER, "tools": [WEATHER], "tool_choice": "required",
              "guided_regex": "a+"}, "guided_regex"),
            ({"messages": USER, "tools": [WEATHER], "parallel_tool_calls": "yes"},
             "parallel_tool_calls")]:
        r = httpx.post(f"{base}chat/completions", json={"model": "m", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
    r = httpx.post(f"{base}completions", json={"model": "m", "prompt": "x", "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    r = httpx.post(f"{base}chat/completions", json={"model": "m", "messages": USER,
                                                    "response_format": "json_object"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"  # no tools
    with pytest.raises(NoToolSupport, match="takes no tools"):
        chat_prompt(plain, USER, [WEATHER])
    plain.chat_template = None
    with pytest.raises(NoToolSupport, match="no chat template"):
        chat_prompt(plain, USER, [WEATHER])


def test_parse_calls():
    text = 'a <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> b'
    content, calls = tool_calls.parse_calls(text)
    assert content == "a b" and calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert tool_calls.parse_calls("<tool_call>{not json}</tool_call>") == (
        "<tool_call>{not json}</tool_call>", [])
    content, calls = tool_calls.parse_calls(
        '<tool_call>{"name": "g", "parameters": "{\\"y\\": 2}"}</tool_call>')  # Llama's key,
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"y": 2}  # text
    tricky = '<tool_call>{"name": "f", "arguments": {"s": "a}</tool_call>b"}}</tool_call>'
    assert json.loads(tool_calls.parse_calls(tricky)[1][0]["function"]["arguments"]) == {
        "s": "a}</tool_call>b"}
    for text in ('<tool_call>{"name": "", "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'):
        assert tool_calls.parse_calls(text) == (text, [])
    assert tool_calls.parse_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>',
                                  names=("g",))[1] == []
    _, calls = tool_calls.parse_calls('{"name": "f", "arguments": {}}', forced=True)
    assert calls[0]["function"] == {"name": "f", "arguments": "{}"}
    clash = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "$defs": {"U": {"const": n}}}}} for n in ("a", "b")]
    with pytest.raises(ValueError, match="define \\$defs/U differently"):
        tool_calls.forced_call_schema(tool_calls.check_tools(clash))
    schema = json.loads(tool_calls.forced_call_schema(
        tool_calls.check_tools([WEATHER, TIME]), "get_time"))
    assert schema["properties"]["name"] == {"const": "get_time"}


def test_a_streamed_reply_streams_its_text_until_a_call_could_start():
    text = 'Let me look. <tool_call>{"name": "f", "arguments": {}}</tool_call> done'
    reader = tool_calls.CallStream()
    streamed = "".join(reader.feed(ch) for ch in text)  # one character a delta
    assert streamed == "Let me look."
    content, calls = reader.finish()
    assert content == " done" and calls[0]["function"]["name"] == "f"
    reader = tool_calls.CallStream()
    assert reader.feed("a <tool") == "a" and reader.feed("box>") == " <toolbox>"
    assert reader.feed("\n<") == "" and reader.finish() == ("\n<", [])  # held back, then given


CALL = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'


@pytest.mark.parametrize("text", [
    f"Sure.\n\n{CALL}", f"  Let me check. {CALL}\n", f"\n{CALL}\n{CALL}\n", f"a {CALL} b {CALL} c ",
    f"{CALL}", "no call at all \n", "broken <tool_call>{not json}</tool_call> \n",
    f"x\n<tool_call>{{}}</tool_call> {CALL} y"])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_streamed_reply_has_the_content_of_the_whole_reply(text, step):
    """The streamed deltas and finish()'s rest join to parse_calls' content of the whole text,
    however the text is cut into deltas; the same calls."""
    reader = tool_calls.CallStream()
    streamed = "".join(reader.feed(text[i:i + step]) for i in range(0, len(text), step))
    rest, calls = reader.finish()
    content, want = tool_calls.parse_calls(text)
    assert ((streamed + (rest or "")) or None) == content
    assert [c["function"] for c in calls] == [c["function"] for c in want]
    forced = tool_calls.CallStream(forced=True)
    assert forced.feed('{"name": "f", ') == "" and forced.feed('"arguments": {}}') == ""
    assert forced.finish()[1][0]["function"] == {"name": "f", "arguments": "{}"}
