"""Ollama's API (/api/*) through the ollama Python client itself, as editor plugins and Open WebUI's Ollama
connection reach Pagoda: chat and generate, whole and streamed (NDJSON), options and `format`, tools and thinking,
and the model routes (tags, show, ps, version); refusals in Ollama's error shape. The same request through /v1
gives the same reply: one request path serves every API."""

import json

import httpx
import pytest

ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")

from tests.bundled_server import KEY, MODEL, running_server  # noqa: E402
from tests.test_openai_reasoning import thinking_server  # noqa: E402

pytestmark = pytest.mark.timeout(600)
HELLO = [{"role": "user", "content": "Say hello to the world."}]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def server(bundled_model, tmp_path_factory):
    yield from running_server(bundled_model, tmp_path_factory)


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def test_chat_whole_and_streamed_give_the_v1_reply(client, server):
    whole = client.chat(model=MODEL, messages=HELLO, options=GREEDY, stream=False)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.role == "assistant"
    assert 0 < whole.eval_count <= 12 and whole.prompt_eval_count > 5
    parts = list(client.chat(model=MODEL, messages=HELLO, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count
    v1 = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)
    same = v1.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=12)
    assert same.choices[0].message.content == whole.message.content


def test_chat_holds_to_a_format_schema(client):
    schema = {
        "type": "object",
        "properties": {"greeting": {"type": "string", "maxLength": 20}},
        "required": ["greeting"],
    }
    reply = client.chat(model=f"{MODEL}:latest", messages=HELLO, format=schema, options={"num_predict": 40})
    assert isinstance(json.loads(reply.message.content)["greeting"], str)


def test_generate_whole_streamed_and_raw(client):
    whole = client.generate(model=MODEL, prompt="Say hello.", system="Be brief.", options=GREEDY)
    assert whole.done and whole.response
    streamed = "".join(
        p.response
        for p in client.generate(model=MODEL, prompt="Say hello.", system="Be brief.", options=GREEDY, stream=True)
    )
    assert streamed == whole.response
    raw = client.generate(model=MODEL, prompt="One, two, three,", raw=True, options=GREEDY)
    assert raw.response and raw.prompt_eval_count < whole.prompt_eval_count  # no chat template around it


def test_the_model_routes_describe_the_served_model(client, server):
    (listed,) = client.list().models
    assert listed.model == MODEL
    (running,) = client.ps().models
    assert running.model == MODEL
    shown = client.show(MODEL)
    assert "completion" in shown.capabilities and shown.modelinfo["general.context_length"] == 2048
    assert "im_start" in shown.template  # the model's own chat template
    version = httpx.get(f"{server.base}/api/version", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert version["version"].count(".") == 2


def test_refusals_come_in_ollamas_error_shape(client, server):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="llama3.2", messages=HELLO)
    assert e.value.status_code == 404 and MODEL in e.value.error
    with pytest.raises(ollama.ResponseError, match="is a chat model"):
        client.embed(model=MODEL, input="hello")
    with pytest.raises(ollama.ResponseError, match="mirostat"):
        client.chat(model=MODEL, messages=HELLO, options={"mirostat": 1})
    keyless = httpx.post(f"{server.base}/api/chat", json={"model": MODEL, "messages": HELLO})
    assert keyless.status_code == 401 and set(keyless.json()) == {"error"}
    missing = httpx.get(f"{server.base}/api/nothing-here", headers={"Authorization": f"Bearer {KEY}"})
    assert missing.status_code == 404 and set(missing.json()) == {"error"}


@pytest.fixture(scope="module")
def qwen3(tiny_models, tmp_path_factory):
    yield from thinking_server(tiny_models, tmp_path_factory, max_len=2048)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_call_comes_back_as_ollamas(qwen3, stream):
    """A tiny Qwen3 with Qwen3's template, its reply held by `format` to the bare JSON call Llama-style models
    write: the reply's call is parsed, and comes back with its arguments as an object."""
    client = ollama.Client(host=qwen3.base, timeout=120)
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    only = {"additionalProperties": False, "type": "object"}
    arguments = {**only, "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}
    call = {
        **only,
        "properties": {"name": {"const": "get_weather"}, "arguments": arguments},
        "required": ["name", "arguments"],
    }
    kwargs = dict(
        model="qwen3", messages=HELLO, tools=[weather], format=call, think=False, options={"num_predict": 120}
    )
    if stream:
        calls = [c for part in client.chat(**kwargs, stream=True) for c in part.message.tool_calls or []]
    else:
        calls = client.chat(**kwargs).message.tool_calls
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
