"""The remote backend's client (app/remote.py): its parsing and error wording on canned answers
(httpx.MockTransport), the /metrics it reads (app/remote_metrics.py), and Stop over a tiny streaming HTTP server.

The page on a remote backend is in test_remote_page.py; the app against a real second Pagoda server in
test_remote_server.py.
"""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from app.chat import stream_reply
from app.chat_settings import ChatSettings
from app.remote import RemoteClient, RemoteError, connect, parse_usage, split_base_url
from app.remote_metrics import parse_prometheus, summarize_metrics
from tests.app.canned_server import REPLY, chunk, mock, sse
from tests.processes import free_port, wait_until


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
