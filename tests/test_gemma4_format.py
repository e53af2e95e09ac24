"""Gemma 4's reply format read back from a reply's tokens (entrypoints/gemma4_format.py): the thought channel apart as
reasoning, the rest as the answer, a <|tool_call> block as a tool call with its arguments turned into JSON, fed a
token at a time or in larger pieces, with Gemma 4's real chat template (from llama.cpp's source package,
tests/chat_templates.py) for the round trip."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from entrypoints.gemma4_format import Gemma4Stream, parse_arguments, template_speaks_gemma4
from tests.chat_templates import real_chat_template
from tests.test_harmony import FakeStream, SyncStream
from tests.test_harmony import feed as feed_parser

SPECIALS = ["<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>']
SPECIALS += ["<|tool_response>", "<tool_response|>", "<|tool>", "<tool|>", "<|think|>", "<bos>"]
# keys in order: the template writes arguments back sorted
CALL = '<|tool_call>call:get_weather{city:<|"|>Paris, France<|"|>,days:3,hours:[6,18],units:{metric:true}}<tool_call|>'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.conftest import build_tokenizer

    folder = tmp_path_factory.mktemp("gemma4-tokenizer")
    build_tokenizer(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS, "bos_token": "<bos>"})
    tok.chat_template = real_chat_template("google-gemma-4-31B-it.jinja")
    return tok


def feed(tokenizer, text: str, piece: int) -> tuple[Gemma4Stream, str, str, list[dict]]:
    return feed_parser(tokenizer, text, piece, Gemma4Stream)


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_the_thought_channel_is_reasoning_apart_from_the_answer(tokenizer, piece):
    reply = "<|channel>thought\nThe user greets. 你好.<channel|>\nHello world!<turn|>"
    stream, reasoning, content, calls = feed(tokenizer, reply, piece)
    assert (reasoning, content, calls) == ("The user greets. 你好.", "Hello world!", [])
    assert (stream.reasoning, stream.content) == (reasoning, content)
    # the empty channel the template opens when thinking is off, and a reply without one
    assert feed(tokenizer, "<|channel>thought\n<channel|>Hi there.", piece)[1:] == ("", "Hi there.", [])
    assert feed(tokenizer, "Just an answer.", piece)[1:] == ("", "Just an answer.", [])


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_a_tool_call_block_is_a_call_with_json_arguments(tokenizer, piece):
    reply = f"<|channel>thought\nNeed weather.<channel|>{CALL}{CALL.replace('Paris, France', 'Oslo')}<|tool_response>"
    stream, reasoning, content, calls = feed(tokenizer, reply, piece)
    assert (reasoning, content) == ("Need weather.", "")
    arguments = {"city": "Paris, France", "days": 3, "units": {"metric": True}, "hours": [6, 18]}
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", arguments),
        ("get_weather", {**arguments, "city": "Oslo"}),
    ]
    assert [c["index"] for c in calls] == [0, 1] and calls[0]["id"].startswith("call_") and len(stream.calls) == 2


def test_a_reply_cut_by_max_tokens_keeps_what_it_wrote_and_no_half_call(tokenizer):
    assert feed(tokenizer, "<|channel>thought\nStill thinking about", 2)[1:] == ("Still thinking about", "", [])
    assert feed(tokenizer, 'Let me look.<|tool_call>call:get_weather{city:<|"|>Pa', 2)[1:] == ("", "Let me look.", [])


def test_gemma_argument_notation_reads_as_json_values():
    assert parse_arguments('{a:<|"|>x:{y}, z<|"|>,b:-1.5e2,c:null,d:[],e:{},f:[true,false]}') == {
        "a": "x:{y}, z",
        "b": -150.0,
        "c": None,
        "d": [],
        "e": {},
        "f": [True, False],
    }
    for broken in ('{a:<|"|>open}', "{a:1,}", "{a:1} trailing", "{:1", "[1 2]"):
        with pytest.raises(ValueError):
            parse_arguments(broken)


def test_arguments_the_notation_cannot_read_reach_the_client_as_written(tokenizer):
    _, _, _, calls = feed(tokenizer, "<|tool_call>call:get_weather{city Paris}<tool_call|>", 1)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("get_weather", "{city Paris}")]


def test_the_real_template_takes_the_call_and_its_result_back(tokenizer):
    """The round trip: the call the parser returned (its arguments as the client sends them back: a JSON string,
    which the server turns into an object for the template), then the tool's result, as Gemma 4 expects them."""
    from entrypoints.openai.tool_calls import prompt_messages

    assert template_speaks_gemma4(tokenizer.chat_template) and not template_speaks_gemma4("{{ messages }}")
    _, _, _, calls = feed(tokenizer, CALL, 1)
    call = {k: v for k, v in calls[0].items() if k != "index"}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
    ]
    weather = {"name": "get_weather", "description": "The weather in a city", "parameters": {"type": "object"}}
    text = tokenizer.apply_chat_template(
        prompt_messages(messages, None, True), tools=[{"type": "function", "function": weather}], tokenize=False
    )
    assert "<|tool>declaration:get_weather{" in text
    assert CALL in text  # the same call, written back as the model wrote it
    assert '<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>' in text


@pytest.mark.parametrize("effort, thinks", [("high", True), ("none", False)])
def test_reasoning_effort_switches_gemma_4_thinking(tokenizer, effort, thinks):
    from entrypoints.openai.protocol import ChatCompletionBody
    from entrypoints.openai.serving import chat_prompt

    def encode_chat(messages, **kwargs):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)

    engine = SimpleNamespace(tokenizer=tokenizer, max_model_len=4096, encode_chat=encode_chat)
    body = ChatCompletionBody(messages=[{"role": "user", "content": "Hi"}], reasoning_effort=effort)
    prompt = asyncio.run(chat_prompt(engine, body))
    text = tokenizer.decode(prompt.token_ids)
    assert ("<|think|>" in text) == thinks and text.endswith("<|turn>model\n" if thinks else "<channel|>")
    assert not prompt.ignored


def test_a_gemma_4_reply_in_openai_shape(tokenizer):
    from entrypoints.openai.reply import Reply

    def whole(text: str) -> dict:
        reply = Reply("gemma-4", True, 10, channels=Gemma4Stream(tokenizer))
        for out in FakeStream(tokenizer, text).outputs:
            reply.count(out)
            reply.take(out)
        return reply.whole("")["choices"][0]

    choice = whole(f"<|channel>thought\nNeed the weather.<channel|>{CALL}<|tool_response>")
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == "Need the weather."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    answer = whole("<|channel>thought\nEasy.<channel|>Sunny.<turn|>")
    assert (answer["message"]["content"], answer["message"]["reasoning_content"]) == ("Sunny.", "Easy.")


def test_the_apps_chat_shows_gemma_4_reasoning_apart_and_offers_the_think_switch(tokenizer):
    from app.backend import LocalBackend, LocalReplyStream

    text = "<|channel>thought\nThink.<channel|>Answer.<turn|>"
    outputs = FakeStream(tokenizer, text).outputs
    deltas = list(LocalReplyStream(SyncStream(outputs), channels=Gemma4Stream(tokenizer)))
    assert "".join(d.reasoning for d in deltas) == "Think." and "".join(d.text for d in deltas) == "Answer."
    stats = SimpleNamespace(quantization="none")
    engine = SimpleNamespace(tokenizer=tokenizer, stats=lambda: stats, max_model_len=4096)
    backend = LocalBackend(engine, "gemma-4")
    assert backend.thinks and backend.token_format


def test_a_chat_with_tools_reads_gemma4s_calls_from_its_tokens(tokenizer):
    """The app's chat (app/tool_rounds.py) runs the calls a Gemma 4 reply frames in its own tokens: the tools go
    through the template, no Hermes grammar holds the reply, and the calls come whole with the reply's end."""
    from types import SimpleNamespace

    from app.backend import LocalBackend
    from app.chat_settings import ChatSettings
    from app.chat_tools import ChatTool, ToolPrompt
    from app.tool_rounds import ToolRounds
    from engine.front.outputs import RequestOutput

    ids = tokenizer.encode(CALL, add_special_tokens=False)

    class Replies:
        request_id = "r"

        def __iter__(self):
            for i, token in enumerate(ids):
                last = i == len(ids) - 1
                yield RequestOutput("r", "", [token], last, "stop" if last else None)

        def cancel(self):
            pass

        def prefill_progress(self):
            return None

    class Engine:
        max_model_len, device = 4096, "cpu"

        def __init__(self):
            self.tokenizer, self.kwargs, self.params = tokenizer, None, None

        def stats(self):
            return SimpleNamespace(quantization="none")

        def encode_chat(self, messages, **kwargs):
            self.kwargs = kwargs
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)

        def submit(self, prompt_ids, params):
            self.params = params
            return Replies()

    engine = Engine()
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = ToolPrompt((ChatTool("weather", "get_weather", "get_weather", "The weather.", schema),))
    stream, _ = LocalBackend(engine, "gemma4").submit([{"role": "user", "content": "Weather?"}], ChatSettings(), tools)
    text = "".join(delta.text for delta in stream)
    assert engine.kwargs["tools"][0]["function"]["name"] == "get_weather" and engine.params.structured_outputs is None
    assert text == "" and [c["function"]["name"] for c in stream.calls] == ["get_weather"]
    assert json.loads(stream.calls[0]["function"]["arguments"])["city"] == "Paris, France"
    assert ToolRounds.wrap(SimpleNamespace(prompt=tools), stream) is stream  # the rounds take these calls as they are
