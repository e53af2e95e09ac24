"""Local exposure (entrypoints/http_guard.py): foreign Host headers, other sites' pages and non-JSON /v1 POSTs
are refused, against a real `python -m engine.serve`; the policy's parsing and naming rules on their own."""

import argparse
import socket

import httpx
import pytest

from entrypoints.http_guard import AccessPolicy, host_name, parse_hosts, parse_origins
from tests.processes import ServeProcess

KEY = "sk-guard-test"
ALLOWED = "pagoda-box.test"
TOOL = "https://notes.example"  # a site given --cors-origins
CHAT = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    """Listening on every interface, as `--host 0.0.0.0` is documented, with one more name and one CORS site."""
    srv = ServeProcess(
        tiny_llama,
        tmp_path_factory.mktemp("guard") / "server.log",
        "--host",
        "0.0.0.0",
        "--api-key",
        KEY,
        "--allowed-hosts",
        ALLOWED,
        "--cors-origins",
        TOOL,
        "--served-model-name",
        "llama",
        "--max-model-len",
        "256",
    ).wait_ready()
    yield srv
    srv.stop()


def call(server, method: str, path: str, host: str | None = None, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", **kwargs.pop("headers", {})}
    if host is not None:
        headers["Host"] = host
    return httpx.request(method, f"{server.base}{path}", headers=headers, timeout=30, **kwargs)


ROUTES = [
    ("GET", "/v1/models", {}),
    ("POST", "/v1/chat/completions", {"json": CHAT}),
    ("POST", "/v1/completions", {"json": {"prompt": "hi", "max_tokens": 2}}),
    ("GET", "/metrics", {}),
    ("GET", "/docs", {}),
    ("GET", "/no-such-page", {}),
]


# Names that end with an allowed one (evil-localhost, x-pagoda-box.test) are other names: only equal ones are served.
FOREIGN_HOSTS = [
    "attacker.example",
    "attacker.example:8000",
    "localhost.attacker.example",
    "127.0.0.1.nip.io",
    "evil-localhost",
    "evil-localhost:8000",
    f"x-{ALLOWED}",
    f"x{ALLOWED}:8000",
    "[2001:db8::1]:8000",
    "",
]


@pytest.mark.parametrize("host", FOREIGN_HOSTS)
@pytest.mark.parametrize("method, path, kwargs", ROUTES)
def test_a_foreign_host_gets_a_403_on_every_route(server, host, method, path, kwargs):
    generated = server.metric("vllm:generation_tokens_total")
    r = call(server, method, path, host, **kwargs)
    assert r.status_code == 403
    hint = "--allowed-hosts" if host else "no Host header"
    if path.startswith("/v1"):
        error = r.json()["error"]
        assert error["code"] == "host_not_allowed" and hint in error["message"]
    else:
        assert hint in r.text
    assert server.metric("vllm:generation_tokens_total") == generated  # refused before any route ran


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "localhost", "LOCALHOST.", "[::1]", "127.0.0.2", ALLOWED, socket.gethostname()]
)
def test_this_machines_names_and_the_allowed_ones_are_served(server, host):
    r = call(server, "GET", "/v1/models", f"{host}:{server.port}")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "llama"


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        None,
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_post_that_is_not_json_gets_a_415_and_generates_nothing(server, content_type, path):
    """text/plain, forms and multipart are what a page may send cross-site without a preflight."""
    import json

    generated = server.metric("vllm:generation_tokens_total")
    headers = {"Content-Type": content_type} if content_type else {}
    body = json.dumps({**CHAT, "prompt": "hi"}).encode()
    r = call(server, "POST", path, headers=headers, content=body)
    assert r.status_code == 415
    error = r.json()["error"]
    assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    assert server.metric("vllm:generation_tokens_total") == generated
    ok = call(server, "POST", path, headers={"Content-Type": "application/json; charset=utf-8"}, content=body)
    assert ok.status_code == 200  # the same body as JSON is served


@pytest.mark.parametrize(
    "origin",
    [
        "https://attacker.example",
        "http://localhost.attacker.example",
        "null",
        "https://notes.example.evil.example",
        "http://notes.example",
        "http://evil-localhost:3000",
        f"https://x-{ALLOWED}",
    ],
)
def test_another_sites_page_is_refused_and_gets_no_cors_headers(server, origin):
    generated = server.metric("vllm:generation_tokens_total")
    for method, path, kwargs in ROUTES[:4]:
        r = call(server, method, path, headers={"Origin": origin}, **kwargs)
        assert r.status_code == 403 and ("--cors-origins" in r.text or origin == "null")
        assert "access-control-allow-origin" not in r.headers
    preflight = call(
        server,
        "OPTIONS",
        "/v1/chat/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers
    assert server.metric("vllm:generation_tokens_total") == generated


def test_a_site_given_cors_origins_gets_cors_and_the_machines_own_pages_need_none(server):
    preflight = call(
        server,
        "OPTIONS",
        "/v1/chat/completions",
        headers={
            "Origin": TOOL,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert preflight.status_code in (200, 204)
    assert preflight.headers["access-control-allow-origin"] == TOOL
    assert "content-type" in preflight.headers["access-control-allow-headers"]
    r = call(server, "POST", "/v1/chat/completions", headers={"Origin": f"{TOOL}:443"}, json=CHAT)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == f"{TOOL}:443"
    assert "Origin" in r.headers["vary"]
    # A page this machine serves (another local port) may call it, but CORS stays off: no wildcard, no echo.
    local = call(server, "GET", "/v1/models", headers={"Origin": "http://localhost:3000"})
    assert local.status_code == 200 and "access-control-allow-origin" not in local.headers


@pytest.fixture(scope="module")
def default_server(tiny_llama, tmp_path_factory):
    """Started with no access options at all: localhost, no --allowed-hosts, no --cors-origins."""
    srv = ServeProcess(
        tiny_llama,
        tmp_path_factory.mktemp("guard_default") / "server.log",
        "--served-model-name",
        "llama",
        "--max-model-len",
        "256",
    ).wait_ready()
    yield srv
    srv.stop()


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://127.0.0.1:5173", "https://attacker.example"])
def test_without_cors_origins_no_page_gets_cors_headers(default_server, origin):
    """CORS is off by default: a page on this machine (another port) is served without them, another site's
    page is refused; neither is told it may read the answer, on a request or on a preflight."""
    local = "localhost" in origin or "127.0.0.1" in origin
    for method, path, kwargs in ROUTES[:4]:
        r = httpx.request(method, f"{default_server.base}{path}", headers={"Origin": origin}, timeout=30, **kwargs)
        assert r.status_code == (200 if local else 403), (path, r.status_code)
        assert "access-control-allow-origin" not in r.headers, path
        assert "access-control-allow-credentials" not in r.headers, path
    preflight = httpx.options(
        f"{default_server.base}/v1/chat/completions",
        timeout=30,
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        },
    )
    assert "access-control-allow-origin" not in preflight.headers
    assert "access-control-allow-headers" not in preflight.headers


def test_the_key_rule_is_unchanged_behind_the_guard(server):
    r = httpx.get(f"{server.base}/v1/models", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


# ---- the policy's rules ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "header, name",
    [
        ("LocalHost:7860", "localhost"),
        ("[::1]:7860", "::1"),
        ("[::1]", "::1"),
        ("box.lan.", "box.lan"),
        ("10.0.0.5:80", "10.0.0.5"),
        ("::1", "::1"),
    ],
)
def test_host_name_takes_the_host_part(header, name):
    assert host_name(header) == name


def test_a_local_bind_serves_loopback_names_only_and_a_wildcard_bind_the_machines_own():
    local = AccessPolicy.for_bind("127.0.0.1")
    assert all(local.host_allowed(h) for h in ("localhost", "127.0.0.1:1", "[::1]:1", "127.9.9.9"))
    assert not local.host_allowed(socket.gethostname()) or socket.gethostname() == "localhost"
    assert not local.host_allowed("attacker.example")
    lan = AccessPolicy.for_bind("0.0.0.0", ["gpu-box.lan"])
    assert lan.host_allowed(socket.gethostname()) and lan.host_allowed("GPU-BOX.lan:7860")
    for foreign in [
        "attacker.example",
        "evil-localhost",
        "x-gpu-box.lan",
        "xgpu-box.lan:7860",
        "gpu-box.lan.evil",
        f"evil-{socket.gethostname()}",
    ]:
        assert not lan.host_allowed(foreign), foreign
        assert not lan.origin_allowed(f"http://{foreign}"), foreign
    assert AccessPolicy.for_bind("192.0.2.7").host_allowed("192.0.2.7:8000")  # the bound address
    proxy = AccessPolicy.for_bind("127.0.0.1", ["*"])
    assert proxy.host_allowed("anything.example")
    assert not proxy.origin_allowed("https://anything.example")  # `*` lets in names, not other sites' pages


@pytest.mark.parametrize("value", ["", "a,,b", "http://box", "box/path", "box:8000", "[::1]:8000", "user@box"])
def test_bad_allowed_hosts_say_what_to_give(value):
    with pytest.raises(argparse.ArgumentTypeError, match="host name"):
        parse_hosts(value)


@pytest.mark.parametrize(
    "value", ["*", "notes.example", "ftp://notes.example", "https://notes.example/app", "https://a.example:port"]
)
def test_bad_cors_origins_say_what_to_give(value):
    with pytest.raises(argparse.ArgumentTypeError, match="scheme://host"):
        parse_origins(value)


def test_origins_compare_with_default_ports_left_out():
    assert parse_origins("https://Notes.example:443,http://[::1]:8080") == [
        "https://notes.example",
        "http://[::1]:8080",
    ]


@pytest.mark.parametrize("path", ["/metrics", "/docs", "/redoc", "/openapi.json"])
def test_metrics_and_api_docs_want_the_key_when_exposed(server, path):
    """On localhost they stay open (tests/test_openai_server.py reads /metrics without the key)."""
    assert httpx.get(f"{server.base}{path}", timeout=30).status_code == 401
    wrong = httpx.get(f"{server.base}{path}", headers={"Authorization": "Bearer sk-wrong"}, timeout=30)
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert call(server, "GET", path).status_code == 200
