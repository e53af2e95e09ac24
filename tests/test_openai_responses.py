"""OpenAI's Responses API (/v1/responses) through the openai SDK itself, as Codex CLI and the OpenAI Agents SDK
reach Pagoda: a response whole and streamed (the stream read by the SDK's own event types and accumulator), a
function tool round trip, previous_response_id and its store, and an agent of the Agents SDK run to completion."""

import json

import pytest

openai = pytest.importorskip("openai")

from tests.bundled_server import KEY, MODEL, running_server  # noqa: E402

pytestmark = pytest.mark.timeout(600)
GREEDY = dict(temperature=0, max_output_tokens=12)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def server(bundled_model, tmp_path_factory):
    yield from running_server(bundled_model, tmp_path_factory)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def test_a_response_whole_and_streamed_give_the_chat_reply(client):
    whole = client.responses.create(model=MODEL, input="Say hello to the world.", instructions="Be brief.", **GREEDY)
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert 0 < whole.usage.output_tokens <= 12 and whole.usage.input_tokens > 5
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello to the world."}],
        temperature=0,
        max_tokens=12,
    )
    assert whole.output_text == chat.choices[0].message.content  # one request path
    with client.responses.stream(model=MODEL, input="Say hello to the world.", instructions="Be brief.", **GREEDY) as s:
        kinds = [event.type for event in s]
        streamed = s.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and streamed.output_text == whole.output_text
    assert streamed.status == whole.status


def test_a_function_tool_round_trip(client):
    """tool_choice names the function (the bundled model's template knows no tools: the call is held to the
    schema); its output goes back as a function_call_output item."""
    first = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    answer = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
        tools=[WEATHER],
        **GREEDY,
    )
    assert answer.output_text and answer.previous_response_id == first.id
    with client.responses.stream(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
    ) as s:
        streamed = s.get_final_response()
    (streamed_call,) = [item for item in streamed.output if item.type == "function_call"]
    assert json.loads(streamed_call.arguments) == json.loads(call.arguments)


def test_previous_response_id_brings_the_earlier_turns_along(client):
    first = client.responses.create(model=MODEL, input="My name is Ada.", instructions="Be brief.", **GREEDY)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id, **GREEDY)
    alone = client.responses.create(model=MODEL, input="What is my name?", **GREEDY)
    # the first turn's question and answer come before the new one (its instructions do not, as OpenAI's API has it)
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens


def test_stored_responses_are_read_deleted_and_not_kept_when_asked(client):
    kept = client.responses.create(model=MODEL, input="Hi", **GREEDY)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError, match="send the whole conversation"):
        client.responses.retrieve(kept.id)
    unkept = client.responses.create(model=MODEL, input="Hi", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="And?", previous_response_id=unkept.id, **GREEDY)


def test_hosted_tools_are_left_out_and_images_refused(client):
    """Codex CLI sends web_search and a namespace of functions beside its functions: the hosted tool is left out
    (and the response says so), the namespace's functions go in."""
    namespace = {"type": "namespace", "name": "weather", "description": "Weather tools.", "tools": [WEATHER]}
    tools = [{"type": "web_search"}, namespace]
    reply = client.responses.with_raw_response.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
    )
    assert "web_search: OpenAI's hosted tools" in reply.headers["x-pagoda-ignored"]
    assert [item.name for item in reply.parse().output if item.type == "function_call"] == ["get_weather"]
    with pytest.raises(openai.BadRequestError, match="hosted tools"):
        client.responses.create(model=MODEL, input="News?", tools=tools, tool_choice={"type": "web_search"})
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    with pytest.raises(openai.BadRequestError, match="input_image is not supported"):
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [image]}])


def test_an_agents_sdk_agent_with_a_function_tool_runs_to_completion(server):
    agents = pytest.importorskip("agents")
    called = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        called.append(city)
        return "Sunny, 21 C"

    client = openai.AsyncOpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    settings = agents.ModelSettings(tool_choice="get_weather", max_tokens=40, temperature=0)
    agent = agents.Agent(
        name="weather",
        instructions="Answer briefly.",
        model=model,
        tools=[get_weather],
        model_settings=settings,
        tool_use_behavior="stop_on_first_tool",
    )
    agents.set_tracing_disabled(True)
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert len(called) == 1 and result.final_output == "Sunny, 21 C"
