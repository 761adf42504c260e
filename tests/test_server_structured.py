"""Structured outputs and tool calls through the HTTP server, with the official openai client."""

from __future__ import annotations

import json

import jsonschema
import pytest

from test_server import ENGINE_ARGS, client, live_server, request

openai = pytest.importorskip("openai")

from qrun.async_llm import AsyncLLM  # noqa: E402
from qrun.server import build_app  # noqa: E402

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
# Small tools: the tiny model's tokenizer spends a token per byte of its 512-token context.
WEATHER = {"type": "function", "function": {
    "name": "weather", "parameters": {"type": "object", "properties": {"c": {"type": "string", "maxLength": 3}},
                                      "required": ["c"]}}}
TIME = {"type": "function", "function": {
    "name": "time", "parameters": {"type": "object", "properties": {"z": {"enum": ["u", "c"]}}, "required": ["z"]}}}
MESSAGES = [{"role": "user", "content": "Weather in Rome?"}]


@pytest.fixture(scope="module")
def url(tiny_llama_dir):
    engine = AsyncLLM(str(tiny_llama_dir), **ENGINE_ARGS)
    with live_server(build_app(engine, model_name="tiny")) as base:
        yield base
    engine.shutdown()


def _arguments_valid(call, tools) -> None:
    function = {t["function"]["name"]: t["function"] for t in tools}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), function["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_output_validates(url, stream):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA,
                                                                           "strict": True}})
    if stream:
        chunks = list(client(url).chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    else:
        reply = client(url).chat.completions.create(**kwargs)
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    if finish == "stop":
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert finish == "length" and text.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "time"}}])
def test_required_and_named_tool_calls_have_valid_arguments(url, stream, tool_choice):
    tools = [WEATHER, TIME]
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0, tools=tools, tool_choice=tool_choice)
    if stream:
        chunks = list(client(url).chat.completions.create(stream=True, **kwargs))
        deltas = [c.choices[0] for c in chunks if c.choices]
        finish = deltas[-1].finish_reason
        calls = [call for d in deltas for call in (d.delta.tool_calls or [])]
        if calls:
            assert [call.index for call in calls] == list(range(len(calls))) and all(call.id for call in calls)
    else:
        reply = client(url).chat.completions.create(**kwargs)
        finish, calls = reply.choices[0].finish_reason, reply.choices[0].message.tool_calls or []
        assert (reply.choices[0].message.content is None) == bool(calls)
    if finish == "length":  # the tiny random model may ramble inside a string until max_tokens
        return
    assert finish == "tool_calls" and calls
    for call in calls:
        _arguments_valid(call, tools)
        if isinstance(tool_choice, dict):
            assert call.function.name == "time"


def test_guided_aliases_and_vllm_structured_outputs(url):
    for extra in ({"guided_choice": ["yes", "no"]}, {"structured_outputs": {"choice": ["yes", "no"]}}):
        status, _, reply = request(url, "/v1/completions", {"prompt": "ok?", "max_tokens": 5, "temperature": 0,
                                                            **extra})
        assert status == 200 and reply["choices"][0]["text"] in ("yes", "no")
    status, _, reply = request(url, "/v1/completions", {"prompt": "n:", "max_tokens": 8, "temperature": 0,
                                                        "guided_regex": "[0-9]{3}"})
    assert status == 200 and reply["choices"][0]["text"].isdigit() and len(reply["choices"][0]["text"]) == 3


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, "json"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "[^\\s\\S]"}, "regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strng"}}}],
      "tool_choice": "required"}, "json"),
])
def test_bad_constraints_are_400_naming_the_field_and_the_server_goes_on(url, body, param):
    status, _, reply = request(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **body})
    assert status == 400, reply
    assert reply["error"]["param"] == param and reply["error"]["type"] == "invalid_request_error"
    status, _, _ = request(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert status == 200


def test_auto_tool_choice_parses_a_bare_json_call(url):
    # A grammar stands in for a model that calls the tool by itself, in Llama 3's JSON form.
    status, _, reply = request(url, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 60, "temperature": 0, "tools": [TIME],
        "guided_choice": ['{"name": "time", "parameters": {"z": "u"}}']})
    assert status == 200
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "time" and json.loads(call["function"]["arguments"]) == {"z": "u"}
