"""Local exposure, against real app processes: a page that rebinds its domain to 127.0.0.1 (a foreign Host),
another site's page (its Origin) and a text/plain POST get nothing from the page, the Gradio API or /v1; on
the LAN (--listen) nothing is served without the login."""

import re
import socket

import httpx
import pytest

from tests.app.app_process import AppProcess

ALLOWED = "pagoda-box.test"
TOOL = "https://notes.example"  # a site given --cors-origins
CHAT = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# One route of each family: the page, Gradio's config, its API (reading chats, changing the backend), /v1, /metrics.
ROUTES = [
    ("GET", "/", {}),
    ("GET", "/config", {}),
    ("GET", "/gradio_api/info", {}),
    ("POST", "/gradio_api/call/conversations", {"json": {"data": [""]}}),
    ("POST", "/gradio_api/call/load_model", {"json": {"data": ["/tmp/attackers-model"]}}),
    ("POST", "/gradio_api/call/connect_remote", {"json": {"data": ["http://attacker.example/v1", "", ""]}}),
    ("GET", "/v1/models", {}),
    ("POST", "/v1/chat/completions", {"json": CHAT}),
    ("GET", "/metrics", {}),
]


@pytest.fixture(scope="module")
def local_app(tiny_llama, tmp_path_factory):
    app = AppProcess(
        tiny_llama, tmp_path_factory.mktemp("local_home"), "--allowed-hosts", ALLOWED, "--cors-origins", TOOL
    )
    client = app.start()
    yield app, client
    app.kill()


@pytest.fixture(scope="module")
def lan_app(tiny_llama, tmp_path_factory):
    """--listen with no --auth: the app makes a login and prints it (AppProcess's client logs in with it)."""
    app = AppProcess(tiny_llama, tmp_path_factory.mktemp("lan_home"), "--listen")
    client = app.start()
    yield app, client
    app.kill()


def request(app: AppProcess, method: str, path: str, host: str | None = None, **kwargs) -> httpx.Response:
    headers = kwargs.pop("headers", {})
    if host is not None:
        headers["Host"] = host
    return httpx.request(method, f"http://127.0.0.1:{app.port}{path}", headers=headers, timeout=30, **kwargs)


def unchanged(client) -> None:
    """Nothing a refused request asked for happened: the local model still serves."""
    status = client.predict(api_name="/model_status")
    assert status["status"] == "ready" and status["backend"] == "local", status


# evil-localhost and x-pagoda-box.test end with a served name: a suffix match would let them in.
@pytest.mark.parametrize(
    "host", ["attacker.example", "attacker.example:7860", "[2001:db8::1]", "evil-localhost", f"x-{ALLOWED}:7860"]
)
@pytest.mark.parametrize("method, path, kwargs", ROUTES)
def test_a_foreign_host_gets_a_403_on_every_route_family(local_app, host, method, path, kwargs):
    app, client = local_app
    r = request(app, method, path, host, **kwargs)
    assert r.status_code == 403
    assert "is not allowed; start with --allowed-hosts" in r.text
    unchanged(client)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", ALLOWED])
def test_local_names_and_allowed_ones_are_served(local_app, host):
    app, _ = local_app
    for path in ("/config", "/v1/models"):
        assert request(app, "GET", path, f"{host}:{app.port}").status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_a_v1_post_that_is_not_json_gets_a_415(local_app, content_type):
    import json

    app, _ = local_app
    r = request(
        app, "POST", "/v1/chat/completions", headers={"Content-Type": content_type}, content=json.dumps(CHAT).encode()
    )
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert request(app, "POST", "/v1/chat/completions", json=CHAT).status_code == 200


def test_another_sites_page_gets_a_403_and_no_cors_headers(local_app):
    app, client = local_app
    origin = {"Origin": "https://attacker.example"}
    for method, path, kwargs in ROUTES:
        r = request(app, method, path, headers=dict(origin), **kwargs)
        assert r.status_code == 403 and "--cors-origins" in r.text, path
        assert "access-control-allow-origin" not in r.headers
    # The text/plain POST a page sends without a preflight, to point the app at the attacker's server.
    r = request(
        app,
        "POST",
        "/gradio_api/call/connect_remote",
        headers={**origin, "Content-Type": "text/plain"},
        content=b'{"data": ["http://attacker.example/v1", "", ""]}',
    )
    assert r.status_code == 403
    unchanged(client)


def test_cors_is_off_for_unnamed_origins_and_on_for_cors_origins(local_app):
    app, _ = local_app
    # Gradio echoes a localhost origin to a localhost host; the guard removes it: no wildcard, no echo.
    local_page = request(app, "GET", "/config", headers={"Origin": "http://localhost:3000"})
    assert local_page.status_code == 200 and "access-control-allow-origin" not in local_page.headers
    preflight = request(
        app,
        "OPTIONS",
        "/v1/chat/completions",
        headers={
            "Origin": TOOL,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        },
    )
    assert preflight.status_code in (200, 204) and preflight.headers["access-control-allow-origin"] == TOOL
    r = request(app, "POST", "/v1/chat/completions", headers={"Origin": TOOL}, json=CHAT)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == TOOL


# ---- --listen ------------------------------------------------------------------------------------
PROTECTED = [
    ("GET", "/config", {}),
    ("GET", "/gradio_api/info", {}),
    ("POST", "/gradio_api/queue/join", {"json": {"data": [], "fn_index": 0, "session_hash": "x"}}),
    ("POST", "/gradio_api/call/delete", {"json": {"data": [1]}}),
    ("POST", "/gradio_api/call/conversations", {"json": {"data": [""]}}),
    ("POST", "/gradio_api/call/messages", {"json": {"data": [1]}}),
    ("POST", "/gradio_api/call/load_model", {"json": {"data": ["/tmp/attackers-model"]}}),
    ("POST", "/gradio_api/call/connect_remote", {"json": {"data": ["http://attacker.example/v1", "", ""]}}),
]


def test_listen_without_auth_prints_a_login(lan_app):
    app, _ = lan_app
    user, password = app.printed_login()
    assert user and len(password) >= 12
    assert "LAN login" in app.log.read_text()
    page = request(app, "GET", "/")  # the login form, with none of the page's components
    assert page.status_code == 200 and "auth_required" in page.text


@pytest.mark.parametrize("method, path, kwargs", PROTECTED)
def test_listen_serves_nothing_without_the_login(lan_app, method, path, kwargs):
    app, client = lan_app
    r = request(app, method, path, **kwargs)
    assert r.status_code == 401, (path, r.status_code, r.text[:200])
    unchanged(client)


def test_listen_refuses_wrong_credentials_and_serves_the_printed_ones(lan_app):
    from gradio_client import Client

    app, _ = lan_app
    user, password = app.printed_login()
    for wrong in [(user, "guess"), ("admin", password), (user, password[:-1]), (user.upper(), password)]:
        r = request(app, "POST", "/login", data={"username": wrong[0], "password": wrong[1]})
        # Gradio's refusal (400 "Incorrect credentials." today, 401 in some versions): not an error of its own
        assert r.status_code in (400, 401) and "incorrect credentials" in r.text.lower(), (wrong, r.status_code, r.text)
        assert not any(name.startswith("access-token") for name in r.cookies)
        # gradio_client's error for a login the app answered with a refusal (AuthenticationError for a 401, a
        # ValueError for a 400), before it reads anything of the app
        with pytest.raises(ValueError, match=f"^Could not login to {re.escape(app.url)}"):
            Client(app.url, auth=wrong, verbose=False)
    r = request(app, "POST", "/login", data={"username": "", "password": ""})
    assert r.status_code == 422 and "username" in r.text  # an empty name is not even a form Gradio takes
    with httpx.Client(base_url=f"http://127.0.0.1:{app.port}", timeout=30) as session:
        assert session.post("/login", data={"username": user, "password": password}).status_code == 200
        assert session.get("/config").status_code == 200
    logged_in = Client(app.url, auth=(user, password), verbose=False)
    assert isinstance(logged_in.predict("", api_name="/conversations"), list)


@pytest.mark.parametrize("origin", ["http://localhost:3000", f"http://{socket.gethostname()}:3000"])
def test_without_cors_origins_the_app_sends_no_cors_headers(lan_app, origin):
    """No --cors-origins (lan_app has none): Gradio's own CORS middleware echoes a page on this machine (any page,
    when reached by a LAN name); the guard strips it, so no page is told it may read the answers."""
    app, _ = lan_app
    for host in (None, f"{socket.gethostname()}:{app.port}"):
        preflight = request(
            app,
            "OPTIONS",
            "/gradio_api/info",
            host,
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "GET",
                "Access-Control-Request-Headers": "content-type",
            },
        )
        assert "access-control-allow-origin" not in preflight.headers, (host, preflight.headers)
        assert "access-control-allow-credentials" not in preflight.headers
        page = request(app, "GET", "/", host, headers={"Origin": origin})
        assert page.status_code == 200 and "access-control-allow-origin" not in page.headers, (host, page.headers)


def test_listen_keeps_the_v1_key_rule_and_the_host_check(lan_app):
    app, _ = lan_app
    key = re.search(r"every /v1 request needs this key.*\n\s+(pagoda-\S+)", app.log.read_text()).group(1)
    assert request(app, "GET", "/v1/models").status_code == 401
    assert request(app, "GET", "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    # Other machines reach it by this machine's name; a rebinding page's name is still refused.
    assert request(app, "GET", "/config", f"{socket.gethostname()}:{app.port}").status_code == 401
    assert request(app, "GET", "/config", "attacker.example").status_code == 403
