"""gpt-oss's harmony format read back from a reply's tokens (entrypoints/harmony.py): the analysis channel apart as
reasoning, the final channel as the answer, a message to=functions.NAME as a tool call, fed a token at a time or in
larger pieces, with gpt-oss's real chat template (from llama.cpp's source package, tests/chat_templates.py)."""

import json

import pytest

from entrypoints.harmony import HarmonyStream, template_speaks_harmony
from tests.chat_templates import real_chat_template

HARMONY_SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.conftest import build_tokenizer

    folder = tmp_path_factory.mktemp("harmony-tokenizer")
    build_tokenizer(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"additional_special_tokens": HARMONY_SPECIALS})
    tok.chat_template = real_chat_template("openai-gpt-oss-120b.jinja")
    return tok


def feed(tokenizer, text: str, piece: int, parser=HarmonyStream) -> tuple[HarmonyStream, str, str, list[dict]]:
    """`text`'s tokens through a new `parser`, `piece` tokens a call, then its finish: (the parser, and all it
    gave: reasoning, content, calls)."""
    stream = parser(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    reasoning, content, calls = [], [], []
    for at in range(0, len(ids), piece):
        r, c, k = stream.feed(ids[at : at + piece])
        reasoning.append(r), content.append(c), calls.extend(k)
    r, c, k = stream.finish()
    reasoning.append(r), content.append(c), calls.extend(k)
    return stream, "".join(reasoning), "".join(content), calls


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_reasoning_apart_from_the_answer(tokenizer, piece):
    reply = (
        "<|channel|>analysis<|message|>The user greets. 你好.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello world!<|return|>"
    )
    stream, reasoning, content, calls = feed(tokenizer, reply, piece)
    assert (reasoning, content, calls) == ("The user greets. 你好.", "Hello world!", [])
    assert (stream.reasoning, stream.content) == (reasoning, content)


@pytest.mark.parametrize("piece", [1, 4, 1000])
@pytest.mark.parametrize("where", ["header", "channel"])
def test_a_message_to_a_function_is_a_tool_call(tokenizer, piece, where):
    """gpt-oss names the recipient in the header before the channel, or after it (with <|constrain|>json)."""
    head = (
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        if where == "header"
        else "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    )
    reply = f'<|channel|>analysis<|message|>Need weather.<|end|>{head}{{"city": "Paris"}}<|call|>'
    stream, reasoning, content, calls = feed(tokenizer, reply, piece)
    assert reasoning == "Need weather." and content == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert calls[0]["index"] == 0 and calls[0]["id"].startswith("call_") and stream.calls[0]["id"] == calls[0]["id"]


def test_a_reply_cut_by_max_tokens_keeps_what_it_wrote_and_no_half_call(tokenizer):
    _, reasoning, content, calls = feed(tokenizer, "<|channel|>analysis<|message|>Still thinking about", 2)
    assert (reasoning, content, calls) == ("Still thinking about", "", [])
    cut_call = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Pa'
    assert feed(tokenizer, cut_call, 2)[1:] == ("", "", [])


def test_the_real_template_speaks_harmony_and_takes_a_tool_result_back(tokenizer):
    """The round trip: the call the parser returned, then the tool's result, rendered by gpt-oss's template as
    harmony expects them; reasoning_effort is its `Reasoning:` line."""
    assert template_speaks_harmony(tokenizer.chat_template) and not template_speaks_harmony("{{ messages }}")
    _, _, _, calls = feed(
        tokenizer,
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
        1,
    )
    call = {
        **calls[0],
        "function": {**calls[0]["function"], "arguments": json.loads(calls[0]["function"]["arguments"])},
    }
    call.pop("index")
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
    ]
    weather = {"name": "get_weather", "description": "The weather in a city", "parameters": {"type": "object"}}
    tools = [{"type": "function", "function": weather}]
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, reasoning_effort="high"
    )
    assert "Reasoning: high" in text and "get_weather" in text.split("<|end|>")[1]  # the developer message's tools
    assert (
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        in text
    )
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>' in text
    assert text.endswith("<|start|>assistant")


class FakeStream:
    """The engine's increments of one reply, a token each, as serving reads a RequestStream."""

    def __init__(self, tokenizer, text: str):
        from engine.front.outputs import RequestOutput

        ids = tokenizer.encode(text, add_special_tokens=False)
        self.outputs = [
            RequestOutput(
                "r",
                tokenizer.decode([t], skip_special_tokens=True),
                [t],
                i == len(ids) - 1,
                "stop" if i == len(ids) - 1 else None,
            )
            for i, t in enumerate(ids)
        ]

    async def __aiter__(self):
        for out in self.outputs:
            yield out

    def cancel(self) -> None:
        pass


def test_a_harmony_reply_in_openai_shape_whole_and_streamed(tokenizer):
    """What /v1/chat/completions answers for gpt-oss: reasoning_content, then either content or tool_calls with
    finish_reason "tool_calls"; the stream's deltas add up to the same."""
    import asyncio

    from entrypoints.openai.reply import Reply

    call = (
        "<|channel|>analysis<|message|>Need the weather.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
    )

    def whole(text: str) -> dict:
        reply = Reply("gpt-oss", True, 10, channels=HarmonyStream(tokenizer))
        for out in FakeStream(tokenizer, text).outputs:
            reply.count(out)
            reply.take(out)
        return reply.whole("")["choices"][0]

    choice = whole(call)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == "Need the weather."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    answer = whole(
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"
    )
    assert answer["finish_reason"] == "stop" and answer["message"]["content"] == "Sunny."
    assert answer["message"]["reasoning_content"] == "Easy." and "tool_calls" not in answer["message"]

    async def streamed() -> list[dict]:
        reply = Reply("gpt-oss", True, 10, channels=HarmonyStream(tokenizer))
        events = [e async for e in reply.sse(FakeStream(tokenizer, call), include_usage=False)]
        assert events[-1] == "data: [DONE]\n\n"
        return [json.loads(e.removeprefix("data: "))["choices"][0] for e in events[:-1]]

    chunks = asyncio.run(streamed())
    deltas = [c["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need the weather."
    assert [t["function"]["name"] for d in deltas for t in d.get("tool_calls", [])] == ["get_weather"]
    assert not any(d.get("content") for d in deltas) and chunks[-1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    "effort, line, ignored", [("high", "Reasoning: high", ""), ("none", "Reasoning: low", "got low")]
)
def test_reasoning_effort_is_gpt_oss_reasoning_line(tokenizer, effort, line, ignored):
    """OpenAI's reasoning_effort goes to the template's own variable; gpt-oss cannot stop reasoning, so "none" gets
    "low" and the response says so (it was "this model does not think")."""
    import asyncio
    from types import SimpleNamespace

    from entrypoints.openai.protocol import ChatCompletionBody
    from entrypoints.openai.serving import chat_prompt

    def encode_chat(messages, **kwargs):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)

    engine = SimpleNamespace(tokenizer=tokenizer, max_model_len=4096, encode_chat=encode_chat)
    body = ChatCompletionBody(messages=[{"role": "user", "content": "Hi"}], reasoning_effort=effort)
    prompt = asyncio.run(chat_prompt(engine, body))
    assert line in tokenizer.decode(prompt.token_ids) and ignored in prompt.ignored


def test_the_apps_reply_stream_shows_gpt_oss_reasoning_apart(tokenizer):
    """The app's chats read the same channels: reasoning in its fold, the answer as the reply."""
    from app.backend import LocalReplyStream

    text = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Answer.<|return|>"
    outputs = FakeStream(tokenizer, text).outputs
    deltas = list(LocalReplyStream(SyncStream(outputs), channels=HarmonyStream(tokenizer)))
    assert "".join(d.reasoning for d in deltas) == "Think." and "".join(d.text for d in deltas) == "Answer."
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"


class SyncStream:
    """A RequestStream's increments, iterated as the app's engine thread gives them."""

    request_id = "r"

    def __init__(self, outputs):
        self.outputs = outputs

    def __iter__(self):
        return iter(self.outputs)
