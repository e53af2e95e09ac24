"""Open WebUI's background tasks (titles, tags, follow-ups) get a lower priority than chats when they send none,
so that they wait while the user's visible chat runs (bench/RESULTS.md: 0.98x of the chat's speed alone beside
three 8k-token tasks, against 0.03x at the same priority)."""

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from engine import EngineThread
from entrypoints.openai.api_router import create_router
from entrypoints.openai.protocol import ChatCompletionBody
from entrypoints.openai.serving import BACKGROUND_PRIORITY, ServedModel

TITLE_TASK = "### Task:\nGenerate a concise title summarizing the chat history.\n### Guidelines:\n- 3-5 words"


def body(content: str, **extra) -> ChatCompletionBody:
    return ChatCompletionBody.model_validate({"messages": [{"role": "user", "content": content}], **extra})


def test_what_counts_as_a_background_task():
    assert body(TITLE_TASK).looks_like_a_background_task
    assert not body(TITLE_TASK, stream=True).looks_like_a_background_task  # Open WebUI's RAG chats stream
    assert not body("Tell me about ### Task: headings").looks_like_a_background_task


@pytest.fixture(scope="module")
def served(tiny_llama):
    engine = EngineThread.load(str(tiny_llama), dtype="float32", num_kvcache_blocks=64)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize(
    "content, extra, expected",
    [
        (TITLE_TASK, {}, BACKGROUND_PRIORITY),
        (TITLE_TASK, {"priority": 0}, 0),  # a client's own priority wins
        ("Hello there", {}, 0),
        (TITLE_TASK, {"stream": True}, 0),
    ],
)
def test_the_engine_gets_the_tasks_priority(served, monkeypatch, content, extra, expected):
    seen = []
    submit = served.submit
    monkeypatch.setattr(
        served, "submit", lambda ids, params, priority=0: (seen.append(priority), submit(ids, params, priority))[1]
    )
    app = FastAPI()
    app.include_router(create_router(lambda: ServedModel(served, "tiny")))
    r = TestClient(app).post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}
    )
    assert r.status_code == 200 and seen == [expected]
