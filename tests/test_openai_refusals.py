"""What the OpenAI server refuses, and how, against a real server process: malformed and impossible requests,
a missing or wrong API key, bad logprobs and sampling fields, loosely typed fields and oversized bodies. Every
refusal is a 4xx in OpenAI's error shape, never a 5xx."""

import json

import httpx
import pytest

openai = pytest.importorskip("openai")

from entrypoints.cli import resolve_api_key  # noqa: E402
from tests.bundled_server import KEY, MODEL, serve_bundled  # noqa: E402

# Starting the server on the bundled model (built once per session) takes minutes on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def server(bundled_model, tmp_path_factory):
    srv = serve_bundled(bundled_model, tmp_path_factory.mktemp("serve") / "server.log")
    yield srv
    srv.stop()


# ---- malformed and impossible requests ---------------------------------------------------------
@pytest.mark.parametrize(
    "body, status, code",
    [
        ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model_not_found"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}]}, 400, "context_length_exceeded"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000},
            400,
            "context_length_exceeded",
        ),
        ({"model": MODEL}, 400, None),
        ({"model": MODEL, "messages": []}, 400, None),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, None),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, None),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, None),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
            400,
            None,
        ),
    ],
)
def test_bad_requests_get_openai_style_errors(server, body, status, code):
    r = httpx.post(
        f"{server.base}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json=body, timeout=30
    )
    assert r.status_code == status
    error = r.json()["error"]
    assert error["message"] and error["type"]
    assert error["code"] == code


def test_a_malformed_body_is_a_400_not_a_crash(server):
    r = httpx.post(
        f"{server.base}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        content=b"{not json",
        timeout=30,
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


# ---- the API key ---------------------------------------------------------------------------------
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}])
@pytest.mark.parametrize(
    "method, path", [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")]
)
def test_every_v1_route_wants_the_key(server, headers, method, path):
    body = {"model": MODEL, "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.request(
        method, f"{server.base}{path}", headers=headers, json=body if method == "POST" else None, timeout=30
    )
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"


def test_the_openai_client_with_a_wrong_key_is_refused(server):
    wrong = openai.OpenAI(base_url=f"{server.base}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_an_image_in_a_message_says_images_are_not_supported_yet(server):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    message = {"role": "user", "content": [{"type": "text", "text": "What is in it?"}, image]}
    r = httpx.post(
        f"{server.base}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": MODEL, "messages": [message]},
        timeout=30,
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("images are not supported yet")


def test_an_exposed_server_always_has_a_key(capsys):
    assert resolve_api_key(None, exposed=False) is None
    assert resolve_api_key("mine", exposed=True) == "mine"
    generated = resolve_api_key(None, exposed=True)
    assert generated and len(generated) > 20
    assert generated in capsys.readouterr().out  # printed, so the user can hand it to clients
    assert resolve_api_key(None, exposed=True) != generated


# ---- logprobs and sampling fields ---------------------------------------------------------------
@pytest.mark.parametrize("body", [{"logprobs": 21}, {"logprobs": -1}, {"max_tokens": 0}])
def test_bad_logprobs_requests_are_refused(server, body):
    r = httpx.post(
        f"{server.base}/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
        json={"model": MODEL, "prompt": "hi", **body},
    )
    assert r.status_code == 400 and r.json()["error"]["message"]


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("logit_bias", {"hello": 5}, "token ids"),
        ("logit_bias", {"99999999": 5}, "outside the vocabulary"),
        ("logit_bias", {"1": 101}, "from -100 to 100"),
        ("presence_penalty", 2.5, "less than or equal to 2"),
        ("frequency_penalty", -3, "greater than or equal to -2"),
        ("reasoning_effort", "extreme", "reasoning_effort: Input should be"),
        ("prompt_logprobs", 1, "for a prompt's logprobs send it to /v1/completions with echo"),
        ("stop_token_ids", [99999999], "stop_token_ids names token ids [99999999] outside the vocabulary"),
        ("stop_token_ids", [-1], "outside the vocabulary"),
        ("priority", "high", "valid integer"),
    ],
)
def test_bad_sampling_fields_are_refused_by_name(server, field, value, words):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    r = httpx.post(
        f"{server.base}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json=body, timeout=30
    )
    assert r.status_code == 400
    assert words in r.json()["error"]["message"]
    assert field in r.json()["error"]["message"] or r.json()["error"]["param"] == field


def post_chat(server, content: bytes | None = None, **fields) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    return httpx.post(
        f"{server.base}/v1/chat/completions",
        headers=headers,
        content=content if content is not None else json.dumps(body),
        timeout=60,
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", "2"),
        ("max_tokens", True),
        ("stream", "yes"),
        ("temperature", "0.5"),
        ("seed", 2**64),
        ("max_tokens", 2.5),
    ],
)
def test_fields_are_typed_strictly_and_named(server, field, value):
    r = post_chat(server, **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "content, words",
    [
        (b'{"model": "smollm2", "messages": [{"role": "user", "content": "\\ud800"}]}', "not valid JSON"),
        (b"[" * 1000 + b"]" * 1000, "nests too deeply"),
        # valid JSON, 200 levels deep: it was called "not valid JSON"
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", '
            b'"json_schema": {"schema": ' + b'{"a": ' * 200 + b"1" + b"}" * 200 + b"}}}",
            "nests too deeply (more than about 200 levels)",
        ),
        (b'{"model": "smollm2", "max_tokens": ' + b"9" * 5000 + b', "messages": []}', "not valid JSON"),
        (b'["a list"]', "must be a JSON object"),
    ],
)
def test_bodies_that_once_gave_500s_are_400s(server, content, words):
    r = post_chat(server, content)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


def test_a_body_over_the_limit_is_a_413_and_a_huge_prompt_is_refused_before_tokenizing(server):
    r = post_chat(server, messages=[{"role": "user", "content": "x" * (5 << 20)}])  # over the 4 MiB default
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = post_chat(server, messages=[{"role": "user", "content": "word " * 600_000}])  # 3 MB: under the limit
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "characters" in r.json()["error"]["message"]  # refused by its length, not by counting its tokens
    assert post_chat(server).status_code == 200  # and the server still answers
