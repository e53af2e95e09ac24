"""Anthropic's Messages API (/v1/messages) through the anthropic SDK itself, as Claude Code's requests reach
Pagoda: a message whole and streamed (the stream read by the SDK's own event types and accumulator), a tool-use
round trip, stop sequences, count_tokens, the SDK's x-api-key, and refusals in Anthropic's error shape. Thinking
blocks come from a tiny Qwen3 with Qwen3's real template, held to the shape a trained one writes."""

import pytest

anthropic = pytest.importorskip("anthropic")

from tests.bundled_server import KEY, MODEL, running_server  # noqa: E402
from tests.test_openai_reasoning import thinking_server  # noqa: E402

pytestmark = pytest.mark.timeout(600)
GREEDY = {"temperature": 0}  # the SDK sends no temperature (Claude's models take none now); older SDKs did
HELLO = [{"role": "user", "content": "Say hello to the world."}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city now.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def server(bundled_model, tmp_path_factory):
    yield from running_server(bundled_model, tmp_path_factory)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0, timeout=120)


def test_a_message_whole_and_streamed_say_the_same(client):
    whole = client.messages.create(model=MODEL, max_tokens=12, messages=HELLO, extra_body=GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0) > 5
    assert 0 < whole.usage.output_tokens <= 12
    with client.messages.stream(model=MODEL, max_tokens=12, messages=HELLO, extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert streamed.content[0].text == whole.content[0].text
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)


def test_a_stop_sequence_ends_the_reply_and_is_named(client):
    free = client.messages.create(model=MODEL, max_tokens=16, messages=HELLO, extra_body=GREEDY)
    stop = free.content[0].text.strip()[:3]  # something greedy decoding is about to write
    cut = client.messages.create(model=MODEL, max_tokens=16, messages=HELLO, stop_sequences=[stop], extra_body=GREEDY)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert stop not in cut.content[0].text if cut.content else True


def test_a_tool_use_round_trip(client):
    """tool_choice names the tool (the bundled model's template knows no tools: the call is held to the schema);
    the result goes back as a tool_result block and the model answers in text."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(
        model=MODEL, max_tokens=40, messages=ask, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}
    )
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input.get("city"), str) and call.id
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}
    answer = client.messages.create(
        model=MODEL,
        max_tokens=12,
        tools=[WEATHER],
        messages=[*ask, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}],
    )
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(
        model=MODEL, max_tokens=40, messages=ask, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}
    ) as stream:
        streamed = stream.get_final_message()
    (streamed_call,) = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed_call.input == call.input  # the SDK put it together from input_json_delta events


def test_count_tokens_counts_the_prompt_the_message_is_given(client):
    counted = client.messages.count_tokens(model=MODEL, messages=HELLO, system="Be brief.")
    message = client.messages.create(model=MODEL, max_tokens=1, messages=HELLO, system="Be brief.")
    assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    with_tools = client.messages.count_tokens(
        model=MODEL, messages=HELLO, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}
    )
    assert with_tools.input_tokens > counted.input_tokens  # the tool's description is in the prompt


def test_claude_names_are_served_by_the_loaded_model_and_others_are_not(client):
    reply = client.messages.with_raw_response.create(model="claude-haiku-4-5", max_tokens=4, messages=HELLO)
    assert reply.headers["x-pagoda-model"] == MODEL
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="llama-9000", max_tokens=4, messages=HELLO)
    assert e.value.body["error"]["type"] == "not_found_error" and MODEL in e.value.body["error"]["message"]


def test_refusals_come_in_anthropics_error_shape(client, server):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [image]}])
    assert e.value.body["type"] == "error" and "image blocks are not supported" in e.value.body["error"]["message"]
    search = {"type": "web_search_20250305", "name": "web_search"}
    with pytest.raises(anthropic.BadRequestError, match="server tools"):
        client.messages.create(model=MODEL, max_tokens=4, messages=HELLO, tools=[search])
    wrong_key = anthropic.Anthropic(base_url=server.base, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong_key.messages.create(model=MODEL, max_tokens=4, messages=HELLO)
    assert e.value.body["error"]["type"] == "authentication_error"


@pytest.fixture(scope="module")
def qwen3(tiny_models, tmp_path_factory):
    yield from thinking_server(tiny_models, tmp_path_factory)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_thinking_model_replies_with_a_thinking_block_then_text(qwen3, stream):
    client = anthropic.Anthropic(base_url=qwen3.base, api_key="none", max_retries=0, timeout=120)
    shape = {"structured_outputs": {"regex": "<think>\nhmm yes\n</think>\n\nhello there"}}
    kwargs = dict(model="qwen3", max_tokens=30, messages=HELLO, extra_body={**GREEDY, **shape})
    kwargs["thinking"] = {"type": "enabled", "budget_tokens": 1024}
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking.strip() == "hmm yes" and message.content[1].text.strip() == "hello there"


def test_claude_codes_requests_are_taken_as_it_sends_them(client):
    """Claude Code asks for 32,000 tokens whatever the model, and sends system messages between the turns: the
    reply is bounded by the context instead (and the response says so), and the system message goes in."""
    turns = [*HELLO, {"role": "system", "content": "Answer in English."}]
    reply = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=32000, messages=turns, extra_body={**GREEDY, "context_management": {"edits": []}}
    )
    assert "max_tokens: 32000 is more than the context has room for" in reply.headers["x-pagoda-ignored"]
    assert reply.parse().stop_reason in ("end_turn", "max_tokens")
