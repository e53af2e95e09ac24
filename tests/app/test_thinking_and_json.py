"""A chat with a thinking model (a tiny random-weight Qwen3 on Qwen3's real chat template) and a chat held to JSON:
what the store keeps, what the page draws, and what goes back to the model."""

import json
import re
import shutil

import jsonschema
import pytest

from app.chat_settings import ChatSettings
from app.model_host import ModelHost
from app.remote import RemoteBackend, RemoteClient
from app.store import ConversationStore
from app.ui import PagodaUI
from engine import StructuredOutputsParams
from tests.app.test_remote import answering, chunk, sse
from tests.chat_templates import real_chat_template

GREEDY = (0.0, 1.0, -1, 0.0, 1.0)  # temperature, top_p, top_k, min_p, repetition_penalty
THOUGHT, ANSWER = "[a-z]{3,6}( [a-z]{3,6}){2}", "[a-z]{3,8}( [a-z]{3,8}){1,2}"


@pytest.fixture(scope="module")
def qwen3_ui(tiny_models, tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("thinking") / "qwen3"
    shutil.copytree(tiny_models["qwen3"], folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = real_chat_template("Qwen-Qwen3-0.6B.jinja")
    tokenizer.save_pretrained(folder)
    host = ModelHost()
    host.load(str(folder), label="qwen3", wait=True, dtype="float32", num_kvcache_blocks=64, max_num_seqs=4)
    yield PagodaUI(ConversationStore(folder.parent / "chats.db"), host)
    host.unload()


@pytest.fixture
def forced(qwen3_ui, monkeypatch):
    """Hold the model's replies to a regex, as a trained model would write them; returns what it was asked."""
    engine = qwen3_ui.host.engine
    submit, encode = engine.submit, engine.encode_chat
    asked = {"regex": None, "prompts": []}

    def held(ids, params, priority=0):
        if asked["regex"] is not None:
            params.structured_outputs = StructuredOutputsParams(regex=asked["regex"])
        asked["prompts"].append(engine.tokenizer.decode(ids))
        return submit(ids, params, priority)

    monkeypatch.setattr(engine, "submit", held)
    monkeypatch.setattr(
        engine, "encode_chat", lambda messages, **kw: (asked.setdefault("kwargs", kw), encode(messages, **kw))[1]
    )
    return asked


def test_the_reasoning_is_kept_apart_shown_as_a_thought_and_not_sent_back(qwen3_ui, forced):
    ui = qwen3_ui
    assert ui.host.backend.thinks
    conv = ui.store.create().id
    forced["regex"] = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
    *_, last = ui.respond(conv, "What is two plus two?", "", *GREEDY, 60, None)
    reply = ui.store.messages(conv)[-1]
    assert re.fullmatch(ANSWER, reply.content), reply.content
    assert re.fullmatch(f"{THOUGHT}\n", reply.meta["reasoning"])
    assert reply.meta["reasoning_tokens"] > 0 and reply.meta["thought_s"] >= 0
    assert forced["kwargs"] == {"enable_thinking": True}

    rows = ui.history(conv)
    thought, answer = rows[-2], rows[-1]
    assert thought["metadata"]["title"].startswith("Thought for ") and thought["metadata"]["status"] == "done"
    assert thought["content"] == reply.meta["reasoning"] and answer["content"].startswith(reply.content)
    assert f"({reply.meta['reasoning_tokens']} reasoning)" in answer["content"]  # the stats line
    streamed = last[0]  # what the page drew at the end of the stream: the same two rows
    assert streamed[-2]["metadata"]["status"] == "done" and streamed[-1]["content"].startswith(reply.content)

    forced["regex"] = ANSWER
    ui.respond(conv, "And three plus three?", "", *GREEDY, 20, None).__next__()
    ui.replies.get(conv).done.wait(60)
    second_prompt = forced["prompts"][-1]
    assert reply.content in second_prompt and reply.meta["reasoning"].strip() not in second_prompt


def test_think_off_puts_qwen3s_empty_block_in_the_prompt(qwen3_ui, forced):
    ui = qwen3_ui
    conv = ui.store.create().id
    ui.set_chat_options(conv, False, False, "")
    assert ui.chat_options(conv) == (False, False, "")
    think, json_output, schema = ui.open(conv)[-3:]  # what the page's switches show on opening the chat
    assert (think["value"], think["visible"], json_output, schema) == (False, True, False, "")
    forced["regex"] = ANSWER
    *_, _ = ui.respond(conv, "Hi", "", *GREEDY, 20, None)
    assert forced["kwargs"] == {"enable_thinking": False}
    assert forced["prompts"][-1].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    reply = ui.store.messages(conv)[-1]
    assert "reasoning" not in reply.meta and re.fullmatch(ANSWER, reply.content)
    assert ui.store.get(conv).settings["temperature"] == 0.0  # the sliders' settings join the switches


def test_json_output_holds_replies_to_the_chats_schema(qwen3_ui, forced):
    ui = qwen3_ui
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "rank": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    conv = ui.store.create().id
    ui.set_chat_options(conv, True, True, json.dumps(schema))
    forced["regex"] = None
    *_, _ = ui.respond(conv, "Name a city.", "", 0.8, 1.0, -1, 0.0, 1.0, 80, None)
    reply = ui.store.messages(conv)[-1]
    jsonschema.validate(json.loads(reply.content), schema)
    assert "reasoning" not in reply.meta  # JSON from the first token: nothing to split

    ui.set_chat_options(conv, True, True, '{"type": "objekt"}')
    *_, refused = ui.respond(conv, "Another.", "", *GREEDY, 20, None)
    assert "JSON schema" in refused[2]["value"] and "objekt" in refused[2]["value"]
    ui.set_chat_options(conv, True, True, "{not json")
    *_, refused = ui.respond(conv, "Another.", "", *GREEDY, 20, None)
    assert "not valid JSON" in refused[2]["value"]


def test_a_remote_servers_reasoning_comes_through_and_the_switches_are_sent(tmp_path):
    body = sse(
        chunk(role="assistant", text=""),
        {"choices": [{"index": 0, "delta": {"reasoning_content": "Hm, "}}]},
        {"choices": [{"index": 0, "delta": {"reasoning": "sums."}}]},
        {"choices": [{"index": 0, "delta": {"thinking": " Four."}}]},
        chunk("It is 4."),
        chunk(finish="stop"),
        "[DONE]",
    )
    seen = []
    backend = RemoteBackend(
        RemoteClient("http://srv", transport=answering(body=body, content_type="text/event-stream", seen=seen)), "m"
    )
    settings = ChatSettings(think=False, json_output=True, json_schema='{"type": "object"}')
    deltas = list(backend.submit([{"role": "user", "content": "2+2?"}], settings)[0])
    assert "".join(d.reasoning for d in deltas) == "Hm, sums. Four." and "".join(d.text for d in deltas) == "It is 4."
    sent = json.loads(seen[-1].content)
    assert sent["chat_template_kwargs"] == {"enable_thinking": False}
    assert sent["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "reply", "schema": {"type": "object"}},
    }
