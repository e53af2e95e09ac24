"""The app's remote backend (app/remote.py).

First the client's parsing and error wording on canned answers (httpx.MockTransport, and a tiny
streaming HTTP server for Stop); then the app against a second Pagoda server process: a real
OpenAI-compatible server over HTTP (`python -m engine.serve`), not a mock.
"""

import json
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from app.chat import stream_reply
from app.chat_settings import ChatSettings
from app.remote import RemoteClient, RemoteError, connect, parse_usage, split_base_url
from app.remote_metrics import parse_prometheus, summarize_metrics
from tests.app.app_process import AppProcess, reply_text
from tests.processes import ServeProcess, free_port, wait_until

# The last tests start a server and an app on the bundled model: minutes on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(900)


# ---- canned answers ---------------------------------------------------------------------------------
def sse(*events) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def chunk(text=None, finish=None, role=None, usage=None, choices=True) -> dict:
    delta = {k: v for k, v in (("role", role), ("content", text)) if v is not None}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if choices else [],
        "usage": usage,
    }


USAGE = {
    "prompt_tokens": 40,
    "completion_tokens": 3,
    "total_tokens": 43,
    "prompt_tokens_details": {"cached_tokens": 32},
}
REPLY = sse(
    chunk(role="assistant", text=""),
    chunk("Hel"),
    chunk("lo"),
    chunk("!"),
    chunk(finish="stop"),
    chunk(usage=USAGE, choices=False),
    "[DONE]",
)


def mock(handler) -> httpx.MockTransport:
    return httpx.MockTransport(handler)


def answering(status=200, body=b"", content_type="application/json", seen=None):
    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.Response(status, content=data, headers={"content-type": content_type})

    return mock(handler)


def test_the_base_url_works_with_or_without_v1():
    assert split_base_url("http://h:8000/v1/") == ("http://h:8000", "http://h:8000/v1")
    assert split_base_url(" http://h:8000 ") == ("http://h:8000", "http://h:8000/v1")
    assert split_base_url("localhost:11434/v1") == ("http://localhost:11434", "http://localhost:11434/v1")
    assert split_base_url("https://proxy.example/openai/v1") == (
        "https://proxy.example/openai",
        "https://proxy.example/openai/v1",
    )
    with pytest.raises(RemoteError, match="URL"):
        split_base_url("  ")


def test_a_streamed_reply_becomes_increments_with_the_servers_counts():
    seen = []
    client = RemoteClient(
        "http://srv/v1", "sk-test", transport=answering(body=REPLY, content_type="text/event-stream", seen=seen)
    )
    outs = list(client.chat("m", [{"role": "user", "content": "Hi"}], temperature=0.0, top_p=1.0, max_tokens=8))
    assert "".join(o.text for o in outs) == "Hello!"
    assert [o.finished for o in outs] == [False, False, False, True]
    last = outs[-1]
    assert last.finish_reason == "stop"
    assert (last.prompt_tokens, last.completion_tokens, last.cached_tokens) == (40, 3, 32)  # the server's usage
    request = seen[0]
    assert request.url == "http://srv/v1/chat/completions" and request.headers["authorization"] == "Bearer sk-test"
    body = json.loads(request.content)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0 and body["max_tokens"] == 8 and "seed" not in body


def test_only_standard_fields_unless_the_nonstandard_ones_are_switched_on():
    from app.remote import RemoteBackend

    seen = []
    backend = RemoteBackend(RemoteClient("http://srv", transport=answering(body=REPLY, seen=seen)), "m")
    stream, num_prompt_tokens = backend.submit([{"role": "user", "content": "Hi"}], ChatSettings())
    assert num_prompt_tokens == 0  # only the server knows, and says so in its usage
    list(stream)
    body = json.loads(seen[-1].content)
    assert set(body) == {"model", "messages", "stream", "stream_options", "temperature", "top_p", "max_tokens"}
    assert "authorization" not in seen[-1].headers
    list(
        backend.submit(
            [{"role": "user", "content": "Hi"}], ChatSettings(top_k=40, min_p=0.05, repetition_penalty=1.1, seed=7)
        )[0]
    )
    body = json.loads(seen[-1].content)
    assert (body["top_k"], body["min_p"], body["repetition_penalty"], body["seed"]) == (40, 0.05, 1.1, 7)


def test_usage_may_lack_cached_tokens_and_a_stream_may_lack_usage():
    assert parse_usage({"prompt_tokens": 5, "completion_tokens": 2}) == {"prompt_tokens": 5, "completion_tokens": 2}
    assert parse_usage({"prompt_tokens": 5, "prompt_tokens_details": None}) == {"prompt_tokens": 5}
    assert parse_usage(None) == {}
    body = b": keep-alive\n\n" + sse(chunk("Hi", finish="length"), "[DONE]")  # no usage chunk at all
    outs = list(RemoteClient("http://srv", transport=answering(body=body)).chat("m", []))
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert (outs[-1].prompt_tokens, outs[-1].completion_tokens, outs[-1].cached_tokens) == (None, None, None)


class FakeStore:
    def __init__(self):
        self.saved = {}

    def update_message(self, message_id, text, meta):
        self.saved[message_id] = (text, meta)


def test_the_chat_flow_stores_a_remote_reply_with_its_measurements():
    store = FakeStore()
    stream = RemoteClient("http://srv", transport=answering(body=REPLY)).chat("m", [])
    turns = list(stream_reply(stream, store, 7, 0))
    text, meta = store.saved[7]
    assert text == "Hello!" and turns[-1].finished
    assert meta["prompt_tokens"] == 40 and meta["cached_tokens"] == 32 and meta["output_tokens"] == 3
    assert meta["finish_reason"] == "stop" and meta["ttft_s"] is not None


@pytest.mark.parametrize(
    "status,body,key,expected",
    [
        (401, {"error": {"message": "Unauthorized"}}, None, "wants an API key"),
        (401, {"error": "Unauthorized"}, "wrong", "refused the API key"),
        (
            400,
            {
                "error": {
                    "message": "This model's maximum context length is 2048 tokens. However, you requested 4000.",
                    "type": "BadRequestError",
                    "code": 400,
                }
            },
            None,
            "maximum context length is 2048",
        ),
        (
            400,
            {"object": "error", "message": "top_k must be -1", "type": "BadRequestError"},
            None,
            "400: top_k must be -1",
        ),
        (422, {"detail": [{"msg": "field required"}]}, None, "field required"),
        (500, b"<html>oops</html>", None, "500: Internal Server Error"),
    ],
)
def test_refusals_are_worded_for_the_user(status, body, key, expected):
    client = RemoteClient("http://srv/v1", key, transport=answering(status, body))
    with pytest.raises(RemoteError, match=expected) as err:
        client.chat("m", [{"role": "user", "content": "Hi"}])
    assert err.value.status == status
    assert err.value.context_overflow == ("context length" in expected)


def test_an_error_in_the_middle_of_a_stream_is_raised_with_its_message():
    body = sse(chunk("Hi"), {"error": {"message": "engine died", "code": 500}})
    stream = RemoteClient("http://srv", transport=answering(body=body)).chat("m", [])
    with pytest.raises(RemoteError, match="engine died"):
        list(stream)
    stream = RemoteClient("http://srv", transport=answering(body=sse(chunk("Hi")))).chat("m", [])  # cut off
    with pytest.raises(RemoteError, match="closed the stream"):
        list(stream)


def test_a_server_that_is_not_there_is_named():
    port = free_port()
    with pytest.raises(RemoteError, match=rf"Could not reach http://127.0.0.1:{port}/v1: is the server running\?"):
        connect(f"http://127.0.0.1:{port}")
    assert RemoteClient(f"http://127.0.0.1:{port}").metrics() is None  # no metrics, no error


def test_connect_lists_the_models_and_picks_one():
    models = {"object": "list", "data": [{"id": "big", "object": "model", "max_model_len": 8192}, {"id": "small"}]}
    backend = connect("http://srv", transport=answering(body=models))
    assert (backend.model, backend.max_model_len, backend.models) == ("big", 8192, ["big", "small"])
    assert backend.label == "Remote: big at http://srv/v1"  # as the header shows it
    assert connect("http://srv", model="small", transport=answering(body=models)).max_model_len is None
    with pytest.raises(RemoteError, match="does not serve 'huge'; it serves big, small"):
        connect("http://srv", model="huge", transport=answering(body=models))
    with pytest.raises(RemoteError, match="model list"):
        connect("http://srv", transport=answering(body=b"<html>a web page</html>", content_type="text/html"))
    with pytest.raises(RemoteError, match="no /models"):
        connect("http://srv", transport=answering(404, {"detail": "Not Found"}))


VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting{engine="1",model_name="m"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 300.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 100.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 96.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 4.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e+09
vllm:request_success_total{finished_reason="stop",model_name="a \\"b\\" {c} d"} 5
python_gc_objects_collected_total{generation="0"} 123.0
"""


def test_metrics_are_summed_over_label_sets():
    samples = parse_prometheus(VLLM_METRICS + 'garbage line\nvllm:odd{x="1"} not-a-number\n')
    assert samples["vllm:request_success_total"] == [5.0]  # a quoted label value with braces and quotes
    assert summarize_metrics(samples) == {
        "prefix_cache_queries": 400,
        "prefix_cache_hits": 100,
        "num_requests_running": 3,
        "num_requests_waiting": 4,
        "kv_cache_usage": 0.5,
        "prefix_cache_hit_rate": 0.25,
    }


def test_older_vllm_sglang_and_llama_cpp_names():
    old = 'vllm:gpu_cache_usage_perc{model_name="m"} 0.5\nvllm:gpu_prefix_cache_hit_rate{model_name="m"} 0.4\n'
    assert summarize_metrics(parse_prometheus(old)) == {"kv_cache_usage": 0.5, "prefix_cache_hit_rate": 0.4}
    sglang = (
        'sglang:cache_hit_rate{model_name="m"} 0.6\nsglang:num_running_reqs{model_name="m"} 3\n'
        "sglang:num_queue_reqs 1\n"
    )
    assert summarize_metrics(parse_prometheus(sglang)) == {
        "prefix_cache_hit_rate": 0.6,
        "num_requests_running": 3,
        "num_requests_waiting": 1,
    }
    llama = "llamacpp:requests_processing 1\nllamacpp:requests_deferred 0\nllamacpp:kv_cache_usage_ratio 0.1\n"
    assert summarize_metrics(parse_prometheus(llama)) == {
        "num_requests_running": 1,
        "num_requests_waiting": 0,
        "kv_cache_usage": 0.1,
    }


def test_metrics_from_the_servers_root_or_none():
    seen = []
    client = RemoteClient(
        "http://srv:8000/v1", transport=answering(body=VLLM_METRICS.encode(), content_type="text/plain", seen=seen)
    )
    assert client.metrics()["num_requests_running"] == 3 and str(seen[0].url) == "http://srv:8000/metrics"
    assert RemoteClient("http://srv", transport=answering(404, {"detail": "Not Found"})).metrics() is None
    assert (
        RemoteClient("http://srv", transport=answering(body=b"<html></html>", content_type="text/html")).metrics()
        is None
    )
    assert (
        RemoteClient("http://srv", transport=answering(body=b"python_info 1\n", content_type="text/plain")).metrics()
        == {}
    )


def remote_ui(tmp_path, handler):
    """A PagodaUI whose host is connected, through `handler`, to a canned server."""
    from app.model_host import ModelHost
    from app.remote import connect as connect_to
    from app.store import ConversationStore
    from app.ui import PagodaUI

    host = ModelHost()
    host.backend = connect_to("http://srv/v1", transport=mock(handler))
    return PagodaUI(ConversationStore(tmp_path / "chats.db"), host)


def test_the_page_follows_a_remote_reply_and_knows_the_context_only_from_usage(tmp_path):
    def server(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 2048}]})
        if request.url.path == "/metrics":
            return httpx.Response(404)
        body = json.loads(request.content)
        assert body["messages"][0] == {"role": "system", "content": "Be brief."}  # the chat's own system prompt
        return httpx.Response(200, content=REPLY, headers={"content-type": "text/event-stream"})

    ui = remote_ui(tmp_path, server)
    conv = ui.store.create(system_prompt="Be brief.").id
    assert ui.context_meter(conv).startswith("Context: unknown / 2,048 tokens")
    assert ui.header() == "**Pagoda** · Remote: m at http://srv/v1"
    *_, last = ui.respond(conv, "Hi", "Be brief.", *GREEDY, 16, None)
    assert last[0][-1]["content"].startswith("Hello!\n\n<sub>m · first token")  # the model that wrote it first
    reply = ui.store.messages(conv)[-1]
    assert reply.content == "Hello!" and reply.meta["cached_tokens"] == 32
    assert ui.context_meter(conv) == "Context: 43 / 2,048 tokens at the last reply (the server's count)"
    text = ui.kv_panel()
    assert "not available" in text and "exposes no metrics" in text


def test_a_server_failing_mid_reply_keeps_the_text_and_says_why(tmp_path):
    def server(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(200, content=sse(chunk("Hel"), {"error": {"message": "out of memory"}}))

    ui = remote_ui(tmp_path, server)
    conv = ui.store.create().id
    *_, last = ui.respond(conv, "Hi", "", *GREEDY, 16, None)
    assert "stopped: The server stopped the reply: out of memory" in last[0][-1]["content"]
    reply = ui.store.messages(conv)[-1]
    assert reply.content == "Hel" and "out of memory" in reply.meta["error"]
    assert "out of memory" in ui.history(conv)[-1]["content"]  # and the page says so when the chat is opened again
    assert ui.context_meter(conv).startswith("Context: unknown")


def test_a_forbidden_request_is_named_in_the_chat_and_no_empty_reply_is_left(tmp_path):
    def server(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(403, json={"error": {"message": "this key may not use model m"}})

    ui = remote_ui(tmp_path, server)
    conv = ui.store.create().id
    *_, last = ui.respond(conv, "Hi", "", *GREEDY, 16, None)
    assert last[2]["value"] == "**http://srv/v1 refused the request (403, forbidden): this key may not use model m**"
    assert last[1] == "Hi" and ui.store.messages(conv) == []  # the question stays in the box, for a retry


def test_a_stream_line_that_is_not_json_stops_the_reply_and_keeps_its_text(tmp_path):
    def server(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(200, content=sse(chunk("Hel")) + b"data: <html>502 Bad Gateway</html>\n\n" + REPLY)

    ui = remote_ui(tmp_path, server)
    conv = ui.store.create().id
    *_, last = ui.respond(conv, "Hi", "", *GREEDY, 16, None)
    says = "stopped: The server sent a stream line that is not JSON: '<html>502 Bad Gateway</html>'"
    assert last[0][-1]["content"] == f"Hel\n\n<sub>m · {says}</sub>"
    reply = ui.store.messages(conv)[-1]
    assert reply.content == "Hel" and "not JSON" in reply.meta["error"]


class Misbehaving(BaseHTTPRequestHandler):
    """An OpenAI-compatible server that sends the first piece of a reply, then stalls or resets the connection."""

    protocol_version = "HTTP/1.1"
    mode = "stall"
    release = threading.Event()  # ends a stall (the test's teardown)
    reset_when = staticmethod(lambda: True)  # a reset waits for this: data the client has not read dies with it

    def do_GET(self):
        found = self.path.endswith("/models")
        body = json.dumps({"data": [{"id": "m"}]} if found else {"detail": "Not Found"}).encode()
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        data = sse(chunk("Hel"))
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()
        self.close_connection = True
        if self.mode == "stall":
            self.release.wait(120)
        else:  # a reset: close with SO_LINGER 0, which sends RST instead of FIN
            wait_until(self.reset_when, timeout=60)
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()

    def log_message(self, *args):
        pass


@pytest.fixture
def misbehaving_server():
    Misbehaving.release.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Misbehaving)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    Misbehaving.release.set()
    server.shutdown()


@pytest.mark.parametrize(
    "mode, says",
    [
        ("stall", "did not answer in time (ReadTimeout)"),
        ("reset", "Connection reset by peer"),
    ],
    ids=["stall", "reset"],
)
def test_a_server_that_stalls_or_resets_mid_reply_keeps_the_text_and_says_why(
    tmp_path, misbehaving_server, monkeypatch, mode, says
):
    from app.model_host import ModelHost
    from app.store import ConversationStore
    from app.ui import PagodaUI

    monkeypatch.setattr(Misbehaving, "mode", mode)
    monkeypatch.setattr("app.remote.READ_TIMEOUT_S", 1.0)  # a stall is seen after this long between chunks
    host = ModelHost()
    host.backend = connect(misbehaving_server)
    ui = PagodaUI(ConversationStore(tmp_path / "chats.db"), host)
    conv = ui.store.create().id
    # The server resets once the page has the first piece (else the reset could beat it and take it along).
    monkeypatch.setattr(
        Misbehaving,
        "reset_when",
        staticmethod(lambda: ui.replies.get(conv) is not None and ui.replies.get(conv).turn.text == "Hel"),
    )
    *_, last = ui.respond(conv, "Hi", "", *GREEDY, 16, None)
    shown = last[0][-1]["content"]
    assert shown.startswith("Hel\n\n<sub>m · stopped: ") and says in shown, shown
    assert f"{misbehaving_server}/v1" in shown  # which server
    reply = ui.store.messages(conv)[-1]
    assert reply.content == "Hel" and says in reply.meta["error"]
    assert says in ui.history(conv)[-1]["content"]  # and so it reads when the chat is opened again
    host.backend.close()


# ---- Stop over a real socket ---------------------------------------------------------------------------
class EndlessReply(BaseHTTPRequestHandler):
    """Streams a token every 50 ms until the client hangs up, and records that it did."""

    hung_up = threading.Event()
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            while True:
                data = sse(chunk("la "))
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:
            EndlessReply.hung_up.set()

    def log_message(self, *args):
        pass


@pytest.fixture
def endless_server():
    EndlessReply.hung_up.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), EndlessReply)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_cancel_from_another_thread_hangs_up_at_once(endless_server):
    stream = RemoteClient(endless_server).chat("m", [])
    outs = []
    reader = threading.Thread(target=lambda: outs.extend(stream))
    reader.start()
    assert wait_until(lambda: len(outs) >= 3, timeout=60), "no reply streamed from the canned server"
    stream.cancel()  # the Stop button: another thread than the one reading
    reader.join(5)
    assert not reader.is_alive()
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert EndlessReply.hung_up.wait(5)  # the server saw the client go away


def test_a_consumer_that_stops_reading_hangs_up(endless_server):
    stream = RemoteClient(endless_server).chat("m", [])
    store = FakeStore()
    for turn in stream_reply(stream, store, 1, 0):
        if turn.output_tokens >= 2:
            break
    assert store.saved[1][1]["finish_reason"] == "abort" and store.saved[1][0].startswith("la la")
    assert EndlessReply.hung_up.wait(5)


# ---- the app against a real second Pagoda server process -------------------------------------------------
KEY = "remote-test-key"
MAX_MODEL_LEN = 1024  # the server's context: small, so a chat can outgrow it with the reply length alone
SYSTEM = (
    "You are Pagoda, a careful assistant that runs on the user's own computer. You answer briefly, "
    "you say so when you do not know, and you never make up facts about the user."
)
GREEDY = [0.0, 1.0, -1, 0.0, 1.0]  # temperature, top_p, top_k, min_p, repetition_penalty


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
