"""Tools in a chat, for real: the bundled SmolLM2-135M, held to the call's schema, calls the tests' MCP server (a
subprocess over stdio, tests/app/mcp_test_server.py) through the page's events. The user allows the call, sees the
result and the model's answer; a server that crashes mid-call, a tool that hangs past its time limit and Stop during
a call each end the call with the chat saying so, and the next call works."""

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.backend import LocalBackend
from app.chat_settings import ChatSettings
from app.model_host import ModelHost
from app.store import ConversationStore
from app.ui import PagodaUI, slider_values
from tests.processes import wait_until

SERVER = str(Path(__file__).with_name("mcp_test_server.py"))
PAGE = SimpleNamespace(session_hash="page")
SYSTEM = "You are a helpful assistant."

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def engine():
    from engine import EngineThread
    from entrypoints.cli import default_model

    gguf, name = default_model(None)
    thread = EngineThread.load(gguf, num_kvcache_blocks=256, max_model_len=2048)
    yield thread, name
    thread.shutdown()


@pytest.fixture
def ui(engine, tmp_path):
    folder = tmp_path / "files"
    folder.mkdir()
    (folder / "notes.txt").write_text("The lighthouse keeper is called Ada.")
    config = tmp_path / "mcp.json"
    spec = {"command": sys.executable, "args": [SERVER, str(folder)], "timeout": 3}
    config.write_text(json.dumps({"mcpServers": {"test": spec}}))
    host = ModelHost()
    host.backend = LocalBackend(*engine)
    ui = PagodaUI(ConversationStore(tmp_path / "chats.db"), host, mcp_config=config)
    yield ui
    for task in ui.replies.running():
        task.cancel()
        task.done.wait(10)
    ui.close_tools()


def chat_with(ui, tools: list[str]) -> int:
    conv = ui.store.create(system_prompt=SYSTEM).id
    ui.set_chat_tools(conv, tools, "first", 2)
    return conv


def ask(ui, conv, text: str):
    settings = ChatSettings(temperature=0, max_tokens=40)
    frames = ui.respond(conv, text, SYSTEM, *slider_values(settings), PAGE)
    next(frames)
    frames.close()
    return ui.replies.get(conv)


def answer_call(ui, conv, kind="allow") -> dict:
    def waiting():
        return [c for m in ui.store.messages(conv) for c in m.meta.get("tool_calls") or [] if c["status"] == "asking"]

    assert wait_until(lambda: waiting(), 120), "the model made no call"
    call = waiting()[0]
    ui.message_action(conv, f"{kind}-{call['token']}", PAGE)
    return call


def calls(ui, conv) -> list[dict]:
    return [c for m in ui.store.messages(conv) for c in m.meta.get("tool_calls") or []]


def test_the_bundled_model_calls_a_tool_the_user_allows_and_answers_with_its_result(ui):
    listed = ui.list_tools(None)
    assert ("test › add", "test/add") in listed[1]["choices"]  # the panel lists the server's tools
    conv = chat_with(ui, ["test/add"])
    task = ask(ui, conv, "What is 21 plus 21?")
    asked = answer_call(ui, conv)
    assert asked["tool"] == "add" and set(json.loads(asked["arguments"])) == {"a", "b"}  # held to the schema
    assert task.done.wait(120)
    (call,) = calls(ui, conv)
    a, b = json.loads(call["arguments"]).values()
    assert call["status"] == "done" and float(call["result"]) == a + b
    final = ui.store.messages(conv)[-1]
    assert final.role == "assistant" and final.content.strip() and final.meta["finish_reason"] in ("stop", "length")
    # The round after the call reads its prompt from the prefix cache, all but the call and its result
    assert final.meta["cached_tokens"] >= 0.7 * final.meta["prompt_tokens"]
    shown = ui.history(conv)
    assert any(r.get("metadata", {}).get("title", "").startswith("🔧 test › add · done") for r in shown)
    assert shown[-1]["content"].startswith(final.content[:20].replace("#pagoda-", "#pagoda\u200b-"))


def test_deny_runs_nothing_and_the_model_still_answers(ui):
    conv = chat_with(ui, ["test/add"])
    task = ask(ui, conv, "What is 2 plus 2?")
    answer_call(ui, conv, "deny")
    assert task.done.wait(120)
    (call,) = calls(ui, conv)
    assert call["status"] == "denied" and "result" not in call
    assert ui.mcp.restarts == {} and ui.store.messages(conv)[-1].role == "assistant"


def test_a_server_that_crashes_mid_call_says_so_and_starts_again_for_the_next(ui):
    conv = chat_with(ui, ["test/crash"])
    task = ask(ui, conv, "Crash the server.")
    answer_call(ui, conv)
    assert task.done.wait(120)
    (call,) = calls(ui, conv)
    assert call["status"] == "error" and "failed during crash" in call["result"] and "starts again" in call["result"]
    assert "test › crash · failed" in str(ui.history(conv))
    ui.set_chat_tools(conv, ["test/add"], "first", 2)
    task = ask(ui, conv, "What is 1 plus 1?")
    answer_call(ui, conv)
    assert task.done.wait(120)
    assert calls(ui, conv)[-1]["status"] == "done" and ui.mcp.restarts == {"test": 1}


def test_a_tool_that_hangs_past_its_time_limit_fails_and_the_server_stays(ui):
    conv = chat_with(ui, ["test/wait_for_ever"])
    task = ask(ui, conv, "Wait.")
    answer_call(ui, conv)
    assert task.done.wait(120)
    (call,) = calls(ui, conv)
    assert call["status"] == "error" and "did not finish within 3 s" in call["result"]
    assert ui.mcp.restarts == {}


def test_stop_during_a_call_ends_it_and_the_server_answers_the_next(ui):
    conv = chat_with(ui, ["test/wait_for_ever"])
    ui.mcp.servers["test"] = dataclasses.replace(ui.mcp.servers["test"], timeout=300.0)  # it would hang for minutes
    task = ask(ui, conv, "Wait.")
    answer_call(ui, conv)
    assert wait_until(lambda: calls(ui, conv) and calls(ui, conv)[0]["status"] == "running", 60)
    ui.stop_and_show(conv)
    assert task.done.wait(30)
    assert calls(ui, conv)[0]["status"] == "stopped"
    assert ui.mcp.call("test", "add", {"a": 1, "b": 2}).text == "3.0"
