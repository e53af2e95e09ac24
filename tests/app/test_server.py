"""Start-up options: a share link never goes out without a password (nor its API without a key), and a
missing tunnel is no crash."""

import argparse
import os
import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request

import pytest

from app.server import parse_args, resolve_auth
from tests.processes import REPO, free_port, wait_until


def test_share_without_auth_generates_a_login_and_prints_it(capsys):
    user, password = resolve_auth(parse_args(["--share"]))
    assert user and len(password) >= 12
    assert password in capsys.readouterr().out


def test_listen_without_auth_generates_a_login_and_prints_it(capsys):
    user, password = resolve_auth(parse_args(["--listen"]))
    assert user and len(password) >= 12
    out = capsys.readouterr().out
    assert "LAN login" in out and password in out
    assert resolve_auth(parse_args(["--listen", "--auth", "alice:s3cret"])) == ("alice", "s3cret")


def test_auth_is_parsed_and_a_malformed_one_is_refused():
    assert resolve_auth(parse_args(["--auth", "alice:s3cret:x"])) == ("alice", "s3cret:x")
    assert resolve_auth(parse_args([])) is None  # local only, no password needed
    with pytest.raises(SystemExit, match="user:password"):
        resolve_auth(argparse.Namespace(auth="alice", share=False, listen=False))


# The app with --share, its tunnel replaced by one that fails at once: with or without internet the test
# never reaches Gradio's share server, and what it checks is what protects a public link, the login and the key.
SHARE_WITHOUT_TUNNEL = """
import sys
from gradio import networking

def no_tunnel(*args, **kwargs):
    raise RuntimeError("no tunnel in this test")

networking.setup_tunnel = no_tunnel
from app.server import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(600)
def test_share_serves_only_behind_the_login_and_the_api_key(tiny_llama, tmp_path):
    port = free_port()
    log = tmp_path / "share.log"
    env = {**os.environ, "PAGODA_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "PAGODA_API_KEY": ""}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SHARE_WITHOUT_TUNNEL,
            "--model",
            str(tiny_llama),
            "--port",
            str(port),
            "--share",
            "--no-browser",
        ],
        env=env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    base = f"http://127.0.0.1:{port}"

    def page_refused() -> bool:  # the page is up, and answers 401 without the login
        if proc.poll() is not None:
            pytest.fail(f"the app exited: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"{base}/config", timeout=10)
        except urllib.error.HTTPError as e:
            assert e.code == 401, f"the page answered {e.code} without the login"
            return True
        except OSError:
            return False
        pytest.fail("the shared app served its page without the login")

    try:
        assert wait_until(page_refused, timeout=240, interval=0.5), log.read_text()[-2000:]
        # No tunnel is no crash: the app says so and keeps serving locally.
        assert wait_until(lambda: "Could not create the share link" in log.read_text(), timeout=60), log.read_text()
        text = log.read_text()
        assert f"127.0.0.1:{port}" in text
        password = re.search(r"pagoda / (\S+)", text).group(1)
        wrong = urllib.parse.urlencode({"username": "pagoda", "password": password + "x"}).encode()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{base}/login", data=wrong, timeout=10)
        assert refused.value.code in (400, 401)
        body = urllib.parse.urlencode({"username": "pagoda", "password": password}).encode()
        assert urllib.request.urlopen(f"{base}/login", data=body, timeout=10).status == 200
        # The share link would expose the OpenAI-compatible API too: it got a generated key, printed.
        key = re.search(r"every /v1 request needs this key.*\n\s+(pagoda-\S+)", text).group(1)
        for headers in ({}, {"Authorization": "Bearer pagoda-wrong"}):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(urllib.request.Request(f"{base}/v1/models", headers=headers), timeout=10)
            assert refused.value.code == 401
        with_key = urllib.request.Request(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"})

        def models_served() -> bool:  # the key is accepted at once; the model may still be loading (503)
            try:
                return urllib.request.urlopen(with_key, timeout=10).status == 200
            except urllib.error.HTTPError as e:
                assert e.code == 503, e
                return False

        assert wait_until(models_served, timeout=240, interval=0.5), log.read_text()[-2000:]
    finally:
        proc.kill()
        proc.wait(10)


def test_v1_during_a_model_load_says_it_is_loading():
    """A client that calls /v1 while the app is still loading its model is told so, not sent to the Models tab."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from app.model_host import LoadState, ModelHost
    from app.server import serve_openai_api

    host = ModelHost()
    demo = SimpleNamespace(server_app=FastAPI(), local_url="http://127.0.0.1:1/")
    serve_openai_api(demo, host, api_key=None, default_max_tokens=None, max_request_bytes=1 << 20)
    client = TestClient(demo.server_app)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    host.state = LoadState(
        "loading",
        "Loading SmolLM2-135M-Instruct… (Qwen3-0.6B was unloaded to free the GPU.)",
        "/models/smollm2",
        label="SmolLM2-135M-Instruct",
    )
    loading = client.post("/v1/chat/completions", json=body)
    assert loading.status_code == 503
    assert loading.json()["error"]["message"] == "Loading SmolLM2-135M-Instruct; try again when it is ready"

    host.state = LoadState()  # nothing loaded, nothing loading
    idle = client.post("/v1/chat/completions", json=body)
    assert idle.status_code == 503 and "Models tab" in idle.json()["error"]["message"]


def test_speculative_decoding_is_a_json_flag():
    assert parse_args(["--speculative-config", '{"method": "ngram"}']).speculative_config == {"method": "ngram"}
    assert parse_args([]).speculative_config is None
    with pytest.raises(SystemExit):
        parse_args(["--speculative-config", "ngram"])
