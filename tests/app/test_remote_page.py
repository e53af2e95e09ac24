"""The page on a remote backend (app/remote.py behind PagodaUI): a reply followed and stored, the context known
only from the server's usage, and a server that refuses, fails, stalls or resets mid-reply, on canned answers
(httpx.MockTransport, and a tiny HTTP server that misbehaves)."""

import json
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from app.remote import connect
from tests.app.canned_server import GREEDY, REPLY, chunk, mock, sse
from tests.app.chat_text import without_links
from tests.processes import wait_until


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
    assert without_links(last[0][-1]["content"]).startswith(
        "Hello!\n\n<sub>m · first token"
    )  # the model that wrote it first
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
    assert without_links(last[0][-1]["content"]) == f"Hel\n\n<sub>m · {says}</sub>"
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
