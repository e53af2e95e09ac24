"""Fuzzing a real `python -m engine.serve`: schemathesis over its declared /openapi.json, and hypothesis over
the request bodies (drawn by tests/request_bodies.py). Whatever a client sends (embeddings' routes included), the
answer is never a 5xx, every 4xx is in its API's error shape (OpenAI's, Anthropic's under /v1/messages, Ollama's
under /api), and afterwards the server still answers, with nothing left running or holding KV blocks.

The tests share their servers (one on the tiny Llama, one on a tiny Qwen3 with Qwen3's own chat template) and
run in file order: the health check comes last, after everything else has hit them."""

import json
import shutil

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import negative_data_rejection

from tests.processes import ServeProcess, wait_until
from tests.request_bodies import CHAT, COMPLETION, MAX_TOKENS, MODEL, any_text, bodies, junk, messages, prompts

MAX_REQUEST_BYTES = 64 * 1024  # small, so that the 413 case is cheap to send
FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)


def serve(model, log, *more: str) -> ServeProcess:
    """The fuzz's server; `more`: flags that replace its settings."""
    return ServeProcess(
        model,
        log,
        "--served-model-name",
        MODEL,
        "--dtype",
        "float32",
        "--default-max-tokens",
        str(MAX_TOKENS),
        "--max-model-len",
        "128",
        "--num-kvcache-blocks",
        "64",
        "--max-request-bytes",
        str(MAX_REQUEST_BYTES),
        *more,
    ).wait_ready()


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    """The tiny Llama, with a tiny embedding model beside it: /v1/embeddings and /api/embed get fuzzed too."""
    from tests.test_embeddings import build_embedding_model

    folder = tmp_path_factory.mktemp("fuzz")
    embedder = build_embedding_model(folder / "embedding")
    srv = serve(tiny_llama, folder / "server.log", "--embedding-model", str(embedder))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.base, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def qwen3_server(tiny_models, tmp_path_factory):
    """A tiny Qwen3 with Qwen3's real chat template, which renders tools, tool calls and thinking (the tiny
    Llama's template ignores all three): the paths through Jinja and the reasoning split get fuzzed too."""
    from transformers import AutoTokenizer

    from tests.chat_templates import real_chat_template

    folder = tmp_path_factory.mktemp("fuzz-qwen3") / "model"
    shutil.copytree(tiny_models["qwen3"], folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = real_chat_template("Qwen-Qwen3-0.6B.jinja")
    tokenizer.save_pretrained(folder)
    srv = serve(folder, folder.parent / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def qwen3_client(qwen3_server):
    with httpx.Client(base_url=qwen3_server.base, timeout=60) as c:
        yield c


# ---- what every answer must be ---------------------------------------------------------------------
def openai_error(content: bytes) -> str | None:
    """Why a body is not OpenAI's error object ({"error": {"message", "type", "param", "code"}}), or None."""
    try:
        body = json.loads(content)
    except ValueError:
        return f"not JSON: {content[:200]!r}"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(error, dict):
        return f"not {{'error': {{...}}}}: {body!r}"[:500]
    if set(error) != {"message", "type", "param", "code"}:
        return f"error's keys are {sorted(error)}, not message, type, param, code"
    if not (isinstance(error["message"], str) and error["message"]):
        return f"error.message is {error['message']!r}, not a message"
    if not (isinstance(error["type"], str) and error["type"]):
        return f"error.type is {error['type']!r}, not a string"
    if not all(error[k] is None or isinstance(error[k], str) for k in ("param", "code")):
        return f"error.param / error.code are {error['param']!r} / {error['code']!r}, not strings or null"
    return None


def check_answer(response: httpx.Response, sent: object) -> None:
    """No 5xx; a 4xx in OpenAI's error shape; a 200 a whole completion (a stream to its [DONE])."""
    where = f"{response.request.method} {response.request.url.path} with {sent!r}"[:2000]
    status = response.status_code
    assert status < 500, f"{status} for {where}: {response.text[:1000]}"
    if status >= 400:
        problem = openai_error(response.content)
        assert problem is None, f"{status} for {where}: {problem}"
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", f"the stream for {where} did not end with [DONE]: {events[-3:]}"
        for event in events[:-1]:
            chunk = json.loads(event)
            if "error" in chunk:  # only the request's own doing (a constraint it could not follow), as the last event
                assert chunk["error"]["type"] == "invalid_request_error" and event == events[-2], (
                    f"{where} sent {event}"
                )
                continue
            assert "choices" in chunk, f"the stream for {where} sent {event}"
    else:
        assert status == 200, f"{status} for {where}: {response.text[:1000]}"
        body = response.json()
        assert body.get("object") in ("chat.completion", "text_completion") and len(body["choices"]) == 1, (
            f"200 for {where} is not a completion: {body}"
        )


def post(client: httpx.Client, path: str, body: object) -> httpx.Response:
    # json.dumps as a client would write it: NaN and Infinity as JS writes them, lone surrogates escaped
    response = client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    check_answer(response, body)
    return response


# ---- (a) schemathesis over the declared schema -----------------------------------------------------
@pytest.fixture(scope="module")
def api_schema(server):
    config = schemathesis.Config.from_dict({"generation": {"database": "none"}})
    return schemathesis.openapi.from_url(f"{server.base}/openapi.json", config=config)


@pytest.fixture(autouse=True)
def schemathesis_node_id(request):
    # schemathesis 4.32 renames its subtests through `node._nodeid`, which pytest 9.2 no longer has: without
    # it the lazy schema fails with an AttributeError before sending anything.
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


def anthropic_error(content: bytes) -> str | None:
    """Why a body is not Anthropic's error object ({"type": "error", "error": {"type", "message"}}), or None."""
    try:
        body = json.loads(content)
    except ValueError:
        return f"not JSON: {content[:200]!r}"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(body, dict) or body.get("type") != "error" or not isinstance(error, dict):
        return f"not {{'type': 'error', 'error': {{...}}}}: {body!r}"[:500]
    if set(error) != {"type", "message"} or not all(isinstance(error[k], str) and error[k] for k in error):
        return f"error is {error!r}, not a type and a message"
    return None


def ollama_error(content: bytes) -> str | None:
    """Why a body is not Ollama's error object ({"error": "..."}), or None."""
    try:
        body = json.loads(content)
    except ValueError:
        return f"not JSON: {content[:200]!r}"
    if not (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], str) and body["error"]):
        return f"not {{'error': '...'}}: {body!r}"[:500]
    return None


def openai_error_shape(ctx, response, case) -> None:
    """schemathesis check: a 4xx of an API is its own error object (Anthropic's under /v1/messages, OpenAI's
    elsewhere under /v1, Ollama's under /api)."""
    if 400 <= response.status_code < 500 and case.path.startswith(("/v1", "/api/")):
        shape = anthropic_error if case.path.startswith("/v1/messages") else openai_error
        shape = ollama_error if case.path.startswith("/api/") else shape
        problem = shape(response.content)
        if problem is not None:
            raise AssertionError(f"{response.status_code} from {case.method} {case.path}: {problem}")


def cap_max_tokens(body: object) -> None:
    """A valid max_tokens above MAX_TOKENS is lowered to it: it stays valid, and the case runs shorter."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if type(value) is int and value > MAX_TOKENS:
                body[key] = MAX_TOKENS


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(FUZZ, max_examples=60)
def test_schemathesis(case):
    """Every operation, with schemathesis' examples, boundary (coverage) and random cases, valid and not:
    never a 5xx, an invalid body always refused, and the refusal in OpenAI's shape."""
    cap_max_tokens(case.body)
    case.call_and_validate(checks=[not_a_server_error, negative_data_rejection, openai_error_shape], timeout=60)


# ---- (b) hypothesis over the request models --------------------------------------------------------


@given(body=bodies({"messages": messages}, CHAT, mutate=False))
@settings(FUZZ, max_examples=200)
def test_chat_bodies(client, body):
    post(client, "/v1/chat/completions", body)


@given(body=bodies({"prompt": prompts}, COMPLETION, mutate=False))
@settings(FUZZ, max_examples=150)
def test_completion_bodies(client, body):
    post(client, "/v1/completions", body)


@given(
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
    chat=bodies({"messages": messages}, CHAT, mutate=True),
    completion=bodies({"prompt": prompts}, COMPLETION, mutate=True),
)
@settings(FUZZ, max_examples=120)
def test_mistaken_bodies(client, path, chat, completion):
    post(client, path, chat if path == "/v1/chat/completions" else completion)


@given(body=junk | st.lists(junk))
@settings(FUZZ, max_examples=30)
def test_bodies_of_other_kinds(client, body):
    """A body that is JSON but no object (a list, a number, a string, null) or an object of nonsense."""
    for path in ("/v1/chat/completions", "/v1/completions"):
        post(client, path, body)


@given(raw=st.binary(max_size=64) | any_text.map(lambda s: s.encode("utf-8", "surrogatepass")))
@settings(FUZZ, max_examples=30)
def test_bodies_that_are_not_json(client, raw):
    response = client.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    check_answer(response, raw)


HELLO = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    "raw, status",
    [
        (json.dumps(HELLO).encode(), 200),
        (b"\xef\xbb\xbf" + json.dumps(HELLO).encode(), 400),  # a byte-order mark is not JSON
        (b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', 400),  # a lone surrogate
        (b'{"messages": [{"role": "user", "content": "\xff\xfe"}], "max_tokens": 2}', 400),  # not UTF-8
        (b'{"messages": [{"role": "user", "content": "a\\u0000b"}], "max_tokens": 2}', 200),  # NUL is text
        (b'{"messages": [], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}', 200),  # last key wins
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "seed": ' + b"9" * 5000 + b"}", 400),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e1}', 400),  # 10.0 is not an int
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN, "max_tokens": 2}', 400),
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "x": '
            + b"[" * 10000
            + b"]" * 10000
            + b"}",
            400,
        ),  # nesting deeper than any parser should recurse
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "x": "'
            + b"a" * MAX_REQUEST_BYTES
            + b'"}',
            413,
        ),
        (b'{"messages": [{"role": "user", "content": "hi"}]', 400),  # cut short
        (b"", 400),
    ],
)
def test_hostile_bodies(client, raw, status):
    response = client.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    check_answer(response, raw[:200])
    assert response.status_code == status, response.text


@pytest.mark.parametrize(
    "method, path, status",
    [
        ("GET", "/v1/nope", 404),
        ("POST", "/v1", 404),
        ("DELETE", "/v1/chat/completions", 405),
        ("PUT", "/v1/models", 405),
        ("BREW", "/v1/completions", 405),
        ("GET", "/v1/models/a%0Ab", 404),
    ],
)
def test_unknown_routes_answer_in_openai_shape(client, method, path, status):
    """Regression: a path or method no route has answered FastAPI's {"detail": "Not Found"}, which OpenAI's
    clients cannot read (schemathesis found it with TRACE, QUERY and a model id with a newline)."""
    response = client.request(method, path, headers={"Content-Type": "application/json"})
    assert response.status_code == status
    assert openai_error(response.content) is None, response.text
    if status == 405:
        assert response.headers["allow"], "a 405 names the methods the route takes"


@pytest.mark.parametrize("prompt", [[-1], [5, 2**32], [2**70]])
def test_echo_of_token_ids_outside_the_vocabulary(client, tiny_llama, prompt):
    """Regression: echo decoded the prompt's ids before the engine checked them, and the tokenizer raised
    OverflowError on a negative id or one past 32 bits: a 500 (schemathesis found it). Now the engine's 400,
    which names them."""
    response = post(client, "/v1/completions", {"prompt": prompt, "echo": True, "max_tokens": 1})
    assert response.status_code == 400
    assert "outside the vocabulary" in response.json()["error"]["message"]
    from transformers import AutoTokenizer

    echoed = post(client, "/v1/completions", {"prompt": [5, 6], "echo": True, "max_tokens": 0})
    assert echoed.status_code == 200
    assert echoed.json()["choices"][0]["text"] == AutoTokenizer.from_pretrained(tiny_llama).decode([5, 6])


# ---- the chat paths that need a template with tools and thinking ------------------------------------
@given(body=bodies({"messages": messages}, CHAT, mutate=False) | bodies({"messages": messages}, CHAT, mutate=True))
@settings(FUZZ, max_examples=120)
def test_chat_bodies_with_tools_and_thinking_template(qwen3_client, body):
    post(qwen3_client, "/v1/chat/completions", body)


# ---- the requests a hostile client sent (issue 39), replayed --------------------------------------------
def schema_of(count: int, required: bool = True) -> dict:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(count)}}
    return {**schema, "required": list(schema["properties"])} if required else schema


def as_response_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


NAMED = {"type": "function", "function": {"name": "measure"}}
HIDDEN_SHAPES = {
    # (the request's constraint, what the answer must be: "ok", or a 400 whose message starts with it)
    "4,000 properties": (as_response_format(schema_of(4000)), "ok"),
    "16,000 properties": (as_response_format(schema_of(16000)), "ok"),  # a 400 whose message was a Rust panic
    "4,000 optional properties": (as_response_format(schema_of(4000, False)), "the reply could not follow"),
    "50,000 choices": ({"structured_outputs": {"choice": [f"c{i}" for i in range(50000)]}}, "the reply could not"),
    "2,010 choices": ({"guided_choice": [f"option number {i}" for i in range(2010)]}, "the reply could not follow"),
    "a grammar that never ends": ({"structured_outputs": {"grammar": 'root ::= "a" root'}}, "the reply could not"),
    "a schema that is only itself": ({"guided_json": {"$ref": "#"}}, "structured_outputs: no reply can follow"),
    "a tool without parameters": ({"tools": [NAMED], "tool_choice": NAMED}, "ok"),
    "a tool with a float": (
        {
            "tools": [
                {**NAMED, "function": {**NAMED["function"], "parameters": {"properties": {"x": {"type": "number"}}}}}
            ],
            "tool_choice": NAMED,
        },
        "ok",
    ),
}


@pytest.fixture(scope="module")
def roomy_client(tiny_llama, tmp_path_factory):
    """The fuzz server's model, with room for the replayed requests: the server's default body limit, and a
    context that holds a tool's description."""
    log = tmp_path_factory.mktemp("fuzz-roomy") / "server.log"
    srv = serve(
        tiny_llama, log, "--max-request-bytes", str(4 << 20), "--max-model-len", "1024", "--num-kvcache-blocks", "256"
    )
    with httpx.Client(base_url=srv.base, timeout=120) as client:
        yield client
    srv.stop()


@pytest.mark.parametrize("name", HIDDEN_SHAPES)
def test_the_hidden_shape_requests_end_in_a_whole_reply_or_a_visible_error(roomy_client, name):
    """They froze every stream while they compiled, ended with finish_reason "stop" and output that broke the
    constraint, answered a Rust backtrace, or ran to max_tokens without ending."""
    constraint, expected = HIDDEN_SHAPES[name]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, **constraint}
    for stream in (False, True):
        response = post(roomy_client, "/v1/chat/completions", {**body, "stream": stream})
        if expected != "ok":
            message = response.json()["error"]["message"] if not stream else response.text
            assert response.status_code == 400 if not stream else expected in message, response.text[:500]
            assert expected in message and "backtrace" not in message and "<state>" not in message, message[:500]
            continue
        assert response.status_code == 200, response.text[:500]
        if not stream:
            choice = response.json()["choices"][0]
            if "tools" in constraint:  # a call whose arguments end: {} for no parameters, a number that stops
                assert choice["finish_reason"] == "tool_calls", choice
                arguments = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])
                assert arguments == {} if name == "a tool without parameters" else set(arguments) <= {"x"}


# ---- (c) afterwards ----------------------------------------------------------------------------------
def assert_healthy(server: ServeProcess) -> None:
    """The server answers a plain chat, and nothing is left running, waiting or holding KV blocks."""
    with httpx.Client(base_url=server.base, timeout=60) as client:
        response = post(
            client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
        )
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] is not None
    gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    settled = wait_until(lambda: all(server.metric(name) == 0 for name in gauges), timeout=10, interval=0.2)
    assert settled, {name: server.metric(name) for name in gauges}
    assert server.metric("vllm:generation_tokens_total") > 10, "the fuzz reached the engine"
    log = server.log.read_text()
    # A 500 that the routes caught, or an engine step that failed, writes its traceback here
    assert "Traceback" not in log, log[max(0, log.index("Traceback") - 2000) :][:6000]


def test_servers_are_healthy_afterwards(server, qwen3_server):
    """Last: after all of the above."""
    assert_healthy(server)
    assert_healthy(qwen3_server)
