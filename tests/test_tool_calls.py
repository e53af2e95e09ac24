"""Tool calls without a model: the plan a request's tools make, the prompt they go into, and the parsing of a
reply's text into content and OpenAI's tool calls, whole and streamed in pieces of every size."""

import json

import pytest

from entrypoints.openai.errors import APIError
from entrypoints.openai.tool_calls import (
    MAX_INTEGER,
    NUMBER_STEP,
    ToolCallStream,
    closed_arguments,
    plan_tools,
    prompt_messages,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


def run(plan, text: str, piece: int) -> tuple[str, list[dict], list[dict]]:
    """Content, calls, and the calls rebuilt from the stream's deltas (as OpenAI's clients merge them)."""
    stream = ToolCallStream(plan)
    content, deltas = [], []
    for i in range(0, len(text), piece):
        c, d = stream.feed(text[i : i + piece])
        content.append(c)
        deltas += d
    c, d = stream.finish()
    content.append(c)
    deltas += d
    merged: dict[int, dict] = {}
    for delta in deltas:
        call = merged.setdefault(delta["index"], {"id": None, "name": "", "arguments": ""})
        call["id"] = delta.get("id") or call["id"]
        call["name"] += delta.get("function", {}).get("name") or ""
        call["arguments"] += delta.get("function", {}).get("arguments") or ""
    return "".join(content), stream.calls, [merged[i] for i in sorted(merged)]


PIECES = [1, 2, 3, 7, 1000]


@pytest.mark.parametrize("piece", PIECES)
def test_hermes_calls_in_an_auto_reply_become_tool_calls_and_the_rest_content(piece):
    plan = plan_tools([WEATHER, ADD], "auto", True)
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    )
    content, calls, streamed = run(plan, text, piece)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("add", {"a": 1, "b": 2}),
    ]
    assert [(s["id"], s["name"], s["arguments"]) for s in streamed] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize("piece", PIECES)
def test_llama_bare_json_call(piece):
    plan = plan_tools([WEATHER], "auto", True)
    content, calls, streamed = run(plan, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', piece)
    assert content == "" and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert streamed[0]["name"] == "get_weather"


@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize(
    "text",
    [
        "Plain answer, with < and <tool and {braces}.",
        '{"not": "a call"}',
        '<tool_call>\n{"name": "unknown_tool", "arguments": {}}\n</tool_call>',
        "<tool_call>cut short by max_tok",
    ],
)
def test_text_that_is_not_a_call_stays_content(text, piece):
    content, calls, _ = run(plan_tools([WEATHER], "auto", True), text, piece)
    assert (content, calls) == (text, [])


@pytest.mark.parametrize("piece", PIECES)
def test_a_named_call_streams_its_arguments_as_written(piece):
    plan = plan_tools([WEATHER, ADD], {"type": "function", "function": {"name": "add"}}, True)
    content, calls, streamed = run(plan, '{"a": 4, "b": 5}', piece)
    assert content == "" and len(calls) == 1
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a": 4, "b": 5}'}
    assert streamed == [{"id": calls[0]["id"], "name": "add", "arguments": '{"a": 4, "b": 5}'}]
    bounded = {"type": "integer", "minimum": -MAX_INTEGER, "maximum": MAX_INTEGER}
    assert plan.constraint().json == {
        "type": "object",
        "properties": {"a": bounded, "b": bounded},
        "additionalProperties": False,
    }


def test_call_arguments_take_only_the_declared_properties_and_integers_end():
    """A model invented properties, a parameterless tool got a schema back as its arguments, and an unbounded
    integer ran to max_tokens. What the schema says itself stays."""
    schema = {
        "type": "object",
        "properties": {
            "when": {"type": "object", "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 31}}},
            "tags": {"type": "array", "items": {"type": "object", "properties": {"n": {"type": "integer"}}}},
            "extra": {"type": "object", "additionalProperties": {"type": "string"}},
            "pick": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        },
    }
    closed = closed_arguments(schema)
    assert closed["additionalProperties"] is False and schema.get("additionalProperties") is None  # a copy
    assert closed["properties"]["when"]["additionalProperties"] is False
    assert closed["properties"]["when"]["properties"]["day"] == {"type": "integer", "minimum": 1, "maximum": 31}
    assert closed["properties"]["tags"]["items"]["additionalProperties"] is False
    assert closed["properties"]["tags"]["items"]["properties"]["n"]["maximum"] == MAX_INTEGER
    assert closed["properties"]["extra"]["additionalProperties"] == {"type": "string"}
    assert closed["properties"]["pick"]["anyOf"][0]["minimum"] == -MAX_INTEGER
    # a decimal number ends too (instructor's `value: float` ran to max_tokens as 9.99999...), and a bound the
    # schema sets on one side stays while the other side gets one
    number = closed_arguments({"type": "number", "minimum": 0})
    assert number == {"type": "number", "minimum": 0, "maximum": MAX_INTEGER, "multipleOf": NUMBER_STEP}
    assert closed_arguments({"type": "number", "multipleOf": 0.5})["multipleOf"] == 0.5
    now = plan_tools(
        [{"type": "function", "function": {"name": "now"}}], {"type": "function", "function": {"name": "now"}}, True
    )
    assert now.constraint().json == {"type": "object", "properties": {}, "additionalProperties": False}  # only {}
    # parameters without "type" are still an object (JSON Schema would let a bare number through: one ran on)
    untyped = {"type": "function", "function": {"name": "m", "parameters": {"properties": {"x": {"type": "number"}}}}}
    held = plan_tools([untyped], {"type": "function", "function": {"name": "m"}}, True).constraint().json
    assert held["type"] == "object" and held["additionalProperties"] is False
    assert plan_tools([untyped], "required", True).constraint().json["items"]["properties"]["parameters"] == held


def test_required_calls_come_from_the_constrained_array_and_parallel_false_keeps_one():
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]'
    _, calls, streamed = run(plan_tools([WEATHER, ADD], "required", True), text, 5)
    assert [c["function"]["name"] for c in calls] == ["add", "get_weather"] and len(streamed) == 2
    cut = text[: text.index('{"name": "get_weather"') + 12]  # max_tokens ended the reply inside the second call
    _, calls, _ = run(plan_tools([WEATHER, ADD], "required", True), cut, 5)
    assert [c["function"]["name"] for c in calls] == ["add"]
    assert plan_tools([ADD], "required", True).constraint().json["maxItems"] == 8
    one = plan_tools([WEATHER, ADD], "required", False)
    assert one.constraint().json["maxItems"] == 1
    _, calls, _ = run(one, text, 5)
    assert [c["function"]["name"] for c in calls] == ["add"]
    names = [item["properties"]["name"]["const"] for item in one.constraint().json["items"]["anyOf"]]
    assert names == ["get_weather", "add"]


@pytest.mark.parametrize("piece", [1, 7, 1000])
def test_a_required_reply_that_repeats_a_call_is_complete_and_the_repeat_is_left_out(piece):
    """The bundled model called add(2, 3) again and again up to the cap, so the reply ran to max_tokens."""
    stream = ToolCallStream(plan_tools([WEATHER, ADD], "required", True))
    add, weather = (
        '{"name": "add", "parameters": {"a": 2, "b": 3}}',
        '{"name": "get_weather", "parameters": {"city": "Rome"}}',
    )
    text = f"[{add}, {weather}, {add}, "
    fed = ""
    for at in range(0, len(text), piece):
        stream.feed(text[at : at + piece])
        fed += text[at : at + piece]
        # known as soon as the repeat is whole, not before
        assert stream.repeating == (fed.count(add) == 2)
    assert stream.repeating
    _, deltas = stream.finish()
    assert [c["function"]["name"] for c in stream.calls] == ["add", "get_weather"] and len(deltas) == 2


@pytest.mark.parametrize(
    "tools, choice, message",
    [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "names the tool 'nope', which is not in"),
        (None, "required", "the request has no tools"),
        (
            [{"type": "function", "function": {"name": "x", "parameters": {"type": "string"}}}],
            "auto",
            "must be a JSON schema of an object",
        ),
        ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "1 to 64 letters"),
        ([{"type": "retrieval"}], "auto", "each tool must be"),
        ([WEATHER, WEATHER], "auto", "same name"),
        ([WEATHER], "sometimes", "tool_choice must be"),
    ],
)
def test_bad_tools_are_refused_with_a_message_that_names_the_problem(tools, choice, message):
    with pytest.raises(APIError, match=message) as e:
        plan_tools(tools, choice, True)
    assert e.value.status == 400


def test_a_tool_without_parameters_takes_none():
    plan = plan_tools([{"type": "function", "function": {"name": "now"}}], "required", True)
    assert plan.tools[0].parameters == {"type": "object", "properties": {}}


def test_a_template_without_tools_gets_them_in_the_system_message_and_calls_as_text():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    ]
    out = prompt_messages(messages, [WEATHER], knows_tools=False)
    assert out[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in out[0]["content"]
    assert out[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    }
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny, 24 C\n</tool_response>"}
    native = prompt_messages(messages, [WEATHER], knows_tools=True)
    assert native[0]["content"] == "Be brief." and native[3]["role"] == "tool"
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}  # templates `tojson` it
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'  # the request is untouched
