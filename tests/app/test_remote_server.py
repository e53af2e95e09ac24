"""The app against a second Pagoda server process (app/remote.py for real): `python -m engine.serve` on the
bundled model, an OpenAI-compatible server over HTTP, not a mock."""

import pytest

from tests.app.app_process import AppProcess, reply_text
from tests.app.canned_server import GREEDY
from tests.processes import ServeProcess, free_port, wait_until

# These tests start a server and an app on the bundled model: minutes on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(900)


KEY = "remote-test-key"
MAX_MODEL_LEN = 1024  # the server's context: small, so a chat can outgrow it with the reply length alone
SYSTEM = (
    "You are Pagoda, a careful assistant that runs on the user's own computer. You answer briefly, "
    "you say so when you do not know, and you never make up facts about the user."
)


class ServerProcess(ServeProcess):
    """The second Pagoda: `python -m engine.serve` on the bundled model, with a key and a small context."""

    def __init__(self, model, home):
        super().__init__(
            model,
            home / "serve.log",
            "--host",
            "127.0.0.1",
            "--api-key",
            KEY,
            "--served-model-name",
            "smol",
            "--max-num-seqs",
            "4",
            "--max-model-len",
            str(MAX_MODEL_LEN),
        )

    def running(self) -> int:
        return int(self.metric("vllm:num_requests_running"))


@pytest.fixture(scope="module")
def setup(bundled_model, tmp_path_factory):
    """(server, app client): both start at once, which halves the wait on 2 cores."""
    home = tmp_path_factory.mktemp("remote_home")
    server = ServerProcess(bundled_model, home)
    app = AppProcess(bundled_model, home)
    try:
        client = app.start()
        server.wait_ready()
        yield server, client
    finally:
        app.kill()
        server.stop()


def status(client) -> dict:
    return client.predict(api_name="/model_status")


def reply(client, conv, text, max_tokens=16, system=SYSTEM):
    return client.submit(conv, text, system, *GREEDY, max_tokens, api_name="/respond")


def test_a_refused_key_says_so_and_the_local_model_keeps_serving(setup):
    server, client = setup
    for key, says in (("", "wants an API key"), ("wrong-key", "refused the API key")):
        st = client.predict(server.url, key, "", api_name="/connect_remote")
        assert says in st["message"] and "keeps serving" in st["message"]
        assert st["backend"] == "local" and client.predict(api_name="/engine_stats")["num_blocks"] > 0
    st = client.predict(f"http://127.0.0.1:{free_port()}", KEY, "", api_name="/connect_remote")
    assert "is the server running?" in st["message"] and st["backend"] == "local"


def test_connect_lists_the_servers_models_and_serves_the_chats_from_it(setup):
    server, client = setup
    st = client.predict(server.url.removesuffix("/v1"), KEY, "", api_name="/connect_remote")  # no /v1: fine too
    assert st["status"] == "ready" and st["backend"] == "remote", st
    assert st["models"] == ["smol"] and st["serving"] == "smol" and st["url"] == server.url
    assert client.predict(api_name="/engine_stats") == {}  # the local engine is gone

    conv = client.predict(SYSTEM, "", api_name="/new_chat")["value"]
    updates = list(reply(client, conv, "What is the capital of France?"))
    assert len(updates) > 2  # it streamed
    messages = client.predict(conv, api_name="/messages")
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[1]["content"].strip()
    final = updates[-1][0][-1]["content"][0]["text"]
    assert final.startswith(messages[1]["content"]) and "first token" in final
    meta = messages[1]["meta"]
    assert meta["finish_reason"] in ("stop", "length") and meta["prompt_tokens"] > 30 and meta["ttft_s"] > 0
    assert 0 < meta["output_tokens"] <= 16

    second = client.predict(SYSTEM, "", api_name="/new_chat")["value"]
    list(reply(client, second, "And of Italy?"))
    meta = client.predict(second, api_name="/messages")[-1]["meta"]
    assert meta["cached_tokens"] >= 32  # the shared system prompt, from the server's prefix cache (its usage says so)

    # The KV tab: no blocks from a remote server, but what its /metrics says.
    html = client.predict(api_name="/kv_panel")
    assert "not available" in html and "smol at " + server.url in html
    assert "prefix hits" in html and "running / waiting" in html and "KV cache in use" in html


def test_stop_aborts_the_request_on_the_server(setup):
    server, client = setup
    conv = client.predict(SYSTEM, "", api_name="/new_chat")["value"]
    job = reply(client, conv, "Write a very long story about a dragon, with many chapters.", max_tokens=900)
    assert wait_until(lambda: reply_text(job), timeout=120), "no token streamed"  # Stop once some text is there
    client.predict(conv, api_name="/stop")  # the Stop button
    assert wait_until(lambda: server.running() == 0, timeout=10)
    assert wait_until(lambda: client.predict(conv, api_name="/messages")[-1]["meta"].get("finish_reason") == "abort")
    saved = client.predict(conv, api_name="/messages")[-1]
    assert saved["role"] == "assistant" and saved["content"]  # what streamed before Stop is kept


def test_too_long_a_chat_shows_the_servers_message_in_the_chat(setup):
    _, client = setup
    conv = client.predict(SYSTEM, "", api_name="/new_chat")["value"]
    *_, last = reply(client, conv, "Hello", max_tokens=MAX_MODEL_LEN)  # with the prompt, more than the context holds
    overflow = last[2]
    assert "maximum context length is 1024" in overflow["value"] and "Drop the oldest" in overflow["value"]
    assert last[1] == "Hello"  # the message stays in the box, and out of the chat until it can be answered
    assert client.predict(conv, api_name="/messages") == []


def test_disconnect_then_loading_a_local_model_replaces_the_server(setup, bundled_model):
    server, client = setup
    st = client.predict(api_name="/disconnect_remote")
    assert st["backend"] is None and st["status"] == "idle"
    assert client.predict(server.url, KEY, "smol", api_name="/connect_remote")["backend"] == "remote"
    client.predict(str(bundled_model), api_name="/load_model")  # loading a model disconnects the server
    assert wait_until(lambda: status(client)["status"] == "ready", timeout=60)
    st = status(client)
    assert st["backend"] == "local" and st["url"] is None
    conv = client.predict(SYSTEM, "", api_name="/new_chat")["value"]
    list(reply(client, conv, "Hi"))
    assert client.predict(conv, api_name="/messages")[-1]["meta"]["prompt_tokens"] > 30  # the local engine answered
