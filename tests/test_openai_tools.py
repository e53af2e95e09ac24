"""Tools and structured output through /v1, on the bundled SmolLM2 served from its GGUF, driven by the official
`openai` client, LangChain, instructor and pydantic-ai. The model is far too small to follow a schema or call a
tool unaided, so every valid reply here is constrained decoding's doing."""

import json

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

openai = pytest.importorskip("openai")

from engine.loader.bundled import bundled_gguf_path  # noqa: E402
from tests.processes import ServeProcess  # noqa: E402

pytestmark = pytest.mark.timeout(900)

MODEL = "smollm2"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServeProcess(
        bundled_gguf_path(),
        tmp_path_factory.mktemp("tools") / "server.log",
        "--served-model-name",
        MODEL,
        "--max-num-seqs",
        "8",
        "--max-model-len",
        "2048",
        "--default-max-tokens",
        "200",
    )
    yield srv.wait_ready(300)
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300)


def check_calls(calls, names=None):
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_json_schema_replies_validate_at_temperature_0_8(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(6):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Invent a person."}],
            response_format=fmt,
            temperature=0.8,
            seed=seed,
            max_tokens=120,
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_the_clients_parse_helper_gets_its_pydantic_model(client):
    class City(BaseModel):
        name: str = Field(max_length=30)
        population: int = Field(ge=0, le=40_000_000)

    r = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a big city."}],
        response_format=City,
        temperature=0.8,
        max_tokens=60,
    )
    assert isinstance(r.choices[0].message.parsed, City)


def test_json_object_gives_an_object(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Reply in JSON."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=60,
        extra_body={"structured_outputs": None},
    )
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_required_and_named_tool_calls_have_valid_arguments(client, choice):
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER, ADD],
            tool_choice=choice,
            temperature=0.8,
            seed=seed,
            max_tokens=300,
        )  # room for 8 calls
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and not message.content
        check_calls(message.tool_calls, ["add"] if isinstance(choice, dict) else None)


def test_a_tool_without_parameters_is_called_with_no_arguments(client):
    """It got `{"type": "object", "properties": {}}` back as its arguments: the schema, written out."""
    now = {"type": "function", "function": {"name": "now", "description": "The time now"}}
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What time is it?"}],
            tools=[now],
            tool_choice={"type": "function", "function": {"name": "now"}},
            temperature=1.0,
            seed=seed,
            max_tokens=60,
        )
        assert r.choices[0].finish_reason == "tool_calls"
        assert r.choices[0].message.tool_calls[0].function.arguments == "{}"


def test_parallel_tool_calls_false_gives_one_call(client):
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER, ADD],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=120,
        )
        assert len(r.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_call_deltas_rebuild_the_calls(client, choice):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, ADD],
        tool_choice=choice,
        temperature=0.5,
        seed=1,
        max_tokens=300,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls
    for call in calls.values():
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_a_tool_result_goes_back_in_and_the_model_answers(client):
    first = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, ADD],
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny and 24 degrees."},
    ]
    second = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, tools=[WEATHER, ADD], temperature=0, max_tokens=40
    )
    assert second.parse().choices[0].message.content
    # tool_choice auto on a template without tools: served without them (tests/test_openwebui_requests.py)
    assert "no tool support" in second.headers["x-pagoda-tools-dropped"]


@pytest.mark.parametrize(
    "body, message",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
            "objekt",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "must be a JSON schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type must be"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "send_email"}}},
            "'send_email', which is not in",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "none"}}]},
            "must be a JSON schema of an object",
        ),
        ({"tool_choice": "required"}, "no tools"),
        ({"structured_outputs": {"grammar": 'start: "a" missing_rule'}}, "missing_rule"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
        ({"guided_regex": "(unclosed"}, "unclosed group"),
        ({"functions": [{"name": "f"}]}, "send `tools` instead"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "send one of them"),
        ({"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}}, "send one of them"),
        ({"chat_template_kwargs": {"tokenize": True}}, "may not set tokenize"),
    ],
)
def test_bad_constraints_and_tools_get_a_400_that_names_the_problem(server, body, message):
    r = httpx.post(
        f"{server.url}/chat/completions", timeout=60, json={"model": MODEL, "messages": ASK, "max_tokens": 5, **body}
    )
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "body, field",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
            "response_format",
        ),
        ({"structured_outputs": {"grammar": 'start: "a" missing_rule'}}, "structured_outputs"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
    ],
)
def test_a_constraint_that_does_not_compile_names_the_field_it_came_in(server, body, field):
    """`param` was null: a client with several constraint fields could not tell which one was wrong."""
    r = httpx.post(
        f"{server.url}/chat/completions", timeout=60, json={"model": MODEL, "messages": ASK, "max_tokens": 5, **body}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_a_constraint_that_fails_mid_reply_is_the_requests_error_not_a_stop(server):
    """It ended with finish_reason "stop" and output that broke it; then (the fuzz suite found) with a 500. One that
    allows no reply at all is refused before it is queued."""
    never = {"model": MODEL, "messages": ASK, "max_tokens": 20, "structured_outputs": {"grammar": "start: start"}}
    r = httpx.post(f"{server.url}/chat/completions", timeout=60, json=never)
    assert r.status_code == 400 and "from its first token" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "structured_outputs"
    body = {"model": MODEL, "messages": ASK, "max_tokens": 30, "structured_outputs": {"grammar": 'start: "a" start'}}
    r = httpx.post(f"{server.url}/chat/completions", timeout=60, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    assert r.json()["error"]["message"].startswith("the reply could not follow its constraint")
    streamed = httpx.post(f"{server.url}/chat/completions", timeout=60, json={**body, "stream": True}).text
    assert '"type": "invalid_request_error"' in streamed and "could not follow its constraint" in streamed
    assert streamed.rstrip().endswith("data: [DONE]")


def test_models_retrieve_and_an_unknown_model(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_langchain_bind_tools_and_with_structured_output(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    llm = langchain_openai.ChatOpenAI(
        base_url=server.url, api_key="none", model=MODEL, temperature=0.7, max_tokens=120, max_retries=0, timeout=300
    )

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "sunny"

    for choice in ("add", "any"):
        reply = llm.bind_tools([add, get_weather], tool_choice=choice).invoke("What is 2 + 3?")
        assert reply.tool_calls and reply.tool_calls[0]["name"] in (
            {"add"} if choice == "add" else {"add", "get_weather"}
        )
        call = reply.tool_calls[0]
        (add if call["name"] == "add" else get_weather).invoke(call["args"])  # LangChain validates the arguments

    class Person(BaseModel):
        name: str = Field(max_length=24)
        age: int = Field(ge=0, le=130)

    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke("Invent a person.")
        assert isinstance(person, Person)


def test_a_required_reply_stops_at_a_repeated_call(client):
    """The bundled model called add(2, 3) again and again, up to the cap of 8, and the reply ran to max_tokens."""
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is 2 + 3?"}],
        tools=[ADD],
        tool_choice="required",
        temperature=0,
        max_tokens=150,
    )
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and [json.loads(c.function.arguments) for c in calls] == [
        {"a": 2, "b": 3}
    ]
    assert r.usage.completion_tokens < 60  # the call, and the repeat that stopped it


def test_a_required_reply_cut_after_complete_calls_gives_those_calls(client):
    """max_tokens ends the reply inside a call: the complete calls come back, with finish_reason "tool_calls"."""
    for stream in (False, True):
        kwargs = dict(
            model=MODEL,
            messages=[{"role": "user", "content": "Add 1 and 2, and 3 and 4."}],
            tools=[ADD],
            tool_choice="required",
            temperature=0,
            max_tokens=60,
        )
        if stream:
            events = list(client.chat.completions.create(**kwargs, stream=True))
            finish = [e.choices[0].finish_reason for e in events if e.choices and e.choices[0].finish_reason]
            calls = [
                c for e in events if e.choices and e.choices[0].delta.tool_calls for c in e.choices[0].delta.tool_calls
            ]
            assert finish == ["tool_calls"] and len(calls) >= 2
        else:
            r = client.chat.completions.create(**kwargs)
            assert r.usage.completion_tokens == 60 and r.choices[0].finish_reason == "tool_calls"
            calls = r.choices[0].message.tool_calls
            assert len(calls) >= 2
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["add"])


def test_instructor_extracts_through_a_named_tool_and_a_json_schema(server):
    """instructor's TOOLS mode names its tool; a float field once ran to max_tokens as 9.99999..."""
    import instructor

    class User(BaseModel):
        name: str
        age: int

    class Rating(BaseModel):
        value: float

    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        patched = instructor.from_openai(openai.OpenAI(base_url=server.url, api_key="none", timeout=300), mode=mode)
        ask = dict(model=MODEL, temperature=0, max_tokens=100, max_retries=0)
        user = patched.chat.completions.create(
            response_model=User,
            messages=[{"role": "user", "content": "John Smith is 31 years old. Extract the user."}],
            **ask,
        )
        assert isinstance(user, User) and user.age == 31, (mode, user)
        rating = patched.chat.completions.create(
            response_model=Rating, messages=[{"role": "user", "content": "Rate the movie Titanic from 0 to 10."}], **ask
        )
        assert isinstance(rating, Rating), (mode, rating)


def test_pydantic_ai_calls_the_tool_then_gives_its_output(server):
    """pydantic-ai holds the reply to tool calls (tool_choice "required", its output as a `final_result` tool)."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    provider = OpenAIProvider(base_url=server.url, api_key="none")
    agent = Agent(OpenAIChatModel(MODEL, provider=provider), output_type=int)
    calls = []

    @agent.tool_plain
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    result = agent.run_sync(
        "Add 2 and 3 with the add tool, then report the sum with final_result.",
        model_settings={"max_tokens": 200, "temperature": 0},
        usage_limits=UsageLimits(request_limit=5),
    )
    assert result.output == 5 and calls == [(2, 3)]


def test_openapi_documents_the_request_bodies(server):
    """Schema-driven clients and fuzzers read /openapi.json: the bodies the routes read must be there."""
    spec = httpx.get(f"{server.base}/openapi.json", timeout=30).json()
    for path, field in (("/v1/chat/completions", "tools"), ("/v1/completions", "prompt")):
        body = spec["paths"][path]["post"]["requestBody"]
        schema = body["content"]["application/json"]["schema"]
        assert body["required"] and field in schema["properties"] and "$ref" not in json.dumps(schema)
    chat = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat["required"] == ["messages"] and "response_format" in chat["properties"]
