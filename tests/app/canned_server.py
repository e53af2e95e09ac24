"""Canned answers of an OpenAI-compatible server, for the remote backend's tests (test_remote*.py): its streamed
chat chunks as SSE, a whole reply with its usage, httpx's mock transport, and the sliders' greedy settings."""

import json

import httpx


def sse(*events) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def chunk(text=None, finish=None, role=None, usage=None, choices=True) -> dict:
    delta = {k: v for k, v in (("role", role), ("content", text)) if v is not None}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if choices else [],
        "usage": usage,
    }


USAGE = {
    "prompt_tokens": 40,
    "completion_tokens": 3,
    "total_tokens": 43,
    "prompt_tokens_details": {"cached_tokens": 32},
}
REPLY = sse(
    chunk(role="assistant", text=""),
    chunk("Hel"),
    chunk("lo"),
    chunk("!"),
    chunk(finish="stop"),
    chunk(usage=USAGE, choices=False),
    "[DONE]",
)


def mock(handler) -> httpx.MockTransport:
    return httpx.MockTransport(handler)


GREEDY = [0.0, 1.0, -1, 0.0, 1.0]  # temperature, top_p, top_k, min_p, repetition_penalty
