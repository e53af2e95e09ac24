"""A step that raises fails only its requests: through /v1 they get OpenAI's error shape (a 500 whole, an error
event in a stream), and the server goes on answering."""

import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from engine import EngineThread
from entrypoints.openai.api_router import create_router
from entrypoints.openai.server import add_api_error_handlers
from entrypoints.openai.serving import ServedModel

ASK = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture
def client_and_engine(tiny_llama):
    engine = EngineThread.load(str(tiny_llama), dtype="float32", num_kvcache_blocks=64)
    app = FastAPI()
    app.include_router(create_router(lambda: ServedModel(engine, "tiny")))
    add_api_error_handlers(app)
    yield TestClient(app), engine
    engine.shutdown()


def fail_next_step(engine: EngineThread) -> None:
    runner = engine.engine.model_runner
    launch = runner.launch

    def failing(batch):
        runner.launch = launch
        raise RuntimeError("a bug in one step")

    runner.launch = failing


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_step_answers_its_request_with_an_error_and_the_next_one_is_served(client_and_engine, stream):
    client, engine = client_and_engine
    fail_next_step(engine)
    r = client.post("/v1/chat/completions", json={**ASK, "stream": stream})
    if stream:
        events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
    else:
        assert r.status_code == 500
        error = r.json()["error"]
    assert error["type"] == "server_error" and "RuntimeError: a bug in one step" in error["message"]
    assert "send it again" in error["message"]
    again = client.post("/v1/chat/completions", json=ASK)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4
    assert engine.error is None and engine.stats().used_blocks == 0
