"""End to end through gradio_client against the real app process on the bundled model."""

import sqlite3

import pytest

from tests.app.app_process import AppProcess, reply_text
from tests.processes import wait_until

# Starting the app on the bundled model (built once per session) takes minutes on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(900)

SYSTEM = (
    "You are Pagoda, a careful assistant that runs on the user's own computer. You answer briefly, "
    "you say so when you do not know, and you never make up facts about the user."
)
GREEDY = [0.0, 1.0, -1, 0.0, 1.0]  # temperature, top_p, top_k, min_p, repetition_penalty


@pytest.fixture(scope="module")
def app(bundled_model, tmp_path_factory):
    proc = AppProcess(bundled_model, tmp_path_factory.mktemp("app_home"))
    client = proc.start()
    yield proc, client
    proc.kill()


def new_chat(client, system=SYSTEM) -> int:
    return client.predict(system, "", api_name="/new_chat")["value"]


def reply(client, conv, text, max_tokens=48, system=SYSTEM):
    return client.submit(conv, text, system, *GREEDY, max_tokens, api_name="/respond")


def test_a_reply_streams_and_is_stored_with_its_measurements(app):
    _, client = app
    conv = new_chat(client)
    updates = list(reply(client, conv, "What is the capital of France?"))
    assert len(updates) > 2  # it streamed: several partial chat states, not one answer at the end
    final = updates[-1][0][-1]["content"][0]["text"]
    messages = client.predict(conv, api_name="/messages")
    assert [m["role"] for m in messages] == ["user", "assistant"]
    text, summary = final.split("\n\n<sub>")
    assert text == messages[1]["content"] and text.strip()
    assert "first token" in summary and "from the prefix cache" in summary
    assert messages[1]["meta"]["finish_reason"] in ("stop", "length") and messages[1]["meta"]["ttft_s"] > 0


def test_stop_mid_stream_aborts_the_request_in_the_engine(app):
    _, client = app
    conv = new_chat(client)
    job = reply(client, conv, "Write a very long story about a dragon, with many chapters.", max_tokens=2000)
    assert wait_until(lambda: reply_text(job), timeout=120), "no token streamed"  # Stop once some text is there
    client.predict(conv, api_name="/stop")  # the Stop button
    assert wait_until(lambda: client.predict(api_name="/engine_stats")["num_running"] == 0, timeout=60)
    stats = client.predict(api_name="/engine_stats")
    assert stats["used_blocks"] == 0  # its blocks went back (full ones stay cached for reuse)
    saved = client.predict(conv, api_name="/messages")[-1]
    assert saved["role"] == "assistant" and saved["content"]  # what streamed before Stop is kept


def test_regenerate_replaces_the_last_reply(app):
    _, client = app
    conv = new_chat(client)
    list(reply(client, conv, "Name a colour."))
    before = client.predict(conv, api_name="/messages")
    list(client.submit(conv, SYSTEM, *GREEDY, 48, api_name="/regenerate"))
    after = client.predict(conv, api_name="/messages")
    assert [m["role"] for m in after] == ["user", "assistant"]
    assert after[1]["id"] != before[1]["id"] and after[1]["content"] == before[1]["content"]  # greedy: same text


def test_two_chats_with_one_preset_share_the_system_prompt_blocks(app):
    _, client = app
    first = new_chat(client)
    list(reply(client, first, "Hello!", max_tokens=16))
    second = new_chat(client)  # made once the first has a message: New chat reuses an empty chat
    assert second != first
    list(reply(client, second, "What can you do?", max_tokens=16))
    meta = client.predict(second, api_name="/messages")[-1]["meta"]
    assert meta["cached_tokens"] >= 32  # the system prompt's full blocks came from the prefix cache


def test_a_model_too_big_for_memory_is_refused_and_the_previous_one_keeps_serving(app):
    proc, client = app
    before = client.predict(api_name="/model_status")
    # The Models tab's Load button, with a KV cache far larger than this machine's memory.
    client.predict(str(proc.model), "auto", 2048, 100_000, "none", "auto", api_name="/load")
    assert wait_until(lambda: client.predict(api_name="/model_status")["status"] != "loading", timeout=60)
    status = client.predict(api_name="/model_status")
    assert status["status"] == "error"
    assert "the KV cache would take" in status["message"] and "GiB of memory is available" in status["message"]
    assert status["message"].endswith(f"{before['serving']} keeps serving.")
    conv = new_chat(client)
    list(reply(client, conv, "Say hello.", max_tokens=16))
    assert client.predict(conv, api_name="/messages")[-1]["content"]  # the previous model still answers


def test_a_killed_app_loses_no_saved_message(app):
    proc, client = app
    conv = new_chat(client)
    list(reply(client, conv, "Remember the word pagoda.", max_tokens=16))
    reply(client, conv, "Now write a long poem about it.", max_tokens=2000)

    def partial_reply_saved() -> bool:  # a store write of the streaming reply has happened
        messages = client.predict(conv, api_name="/messages")
        return len(messages) == 4 and bool(messages[3]["content"])

    assert wait_until(partial_reply_saved, timeout=120)
    proc.kill()  # kill -9 while the reply streams
    client = proc.start()
    titles = {c["id"]: c["title"] for c in client.predict("", api_name="/conversations")}
    assert conv in titles
    messages = client.predict(conv, api_name="/messages")
    assert [m["content"] for m in messages[:3]][::2] == ["Remember the word pagoda.", "Now write a long poem about it."]
    # The finished reply, and the partial one as far as it was saved.
    assert messages[1]["content"] and len(messages) == 4
    # The cut reply is known as cut (the page marks it "interrupted"), the finished one as finished.
    assert messages[1]["meta"]["finished"] is True and messages[3]["meta"]["finished"] is False
    with sqlite3.connect(proc.home / "pagoda.db") as db:  # beside the restarted app, as a reader
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
