"""One log line per API request, at info level, as vLLM's and llama.cpp's servers write:

    POST /v1/chat/completions 200 · prompt 812 tokens (768 cached) · completion 64 tokens · 3.21 s
    POST /v1/chat/completions 400 · think must be true, false, "low", "medium" or "high", got 3 · 0.01 s

so a user sees what a client sent and what failed, and why. The line is written when the response's last
byte is sent (a stream's end), or when the client leaves first.
"""

import logging
import time

from fastapi import Request

log = logging.getLogger("pagoda.api")

_STATE_KEY = "pagoda_reply"
_ERROR_KEY = "pagoda_error"
MAX_REASON_CHARS = 300  # a refused 1 MB grammar must not become a 1 MB log line


def record(request: Request, reply) -> None:
    """Name the Reply (entrypoints/openai/serving.py) whose token counts go in this request's line."""
    setattr(request.state, _STATE_KEY, reply)


def record_error(request: Request, message: str) -> None:
    """Why the request was refused, for its line."""
    setattr(request.state, _ERROR_KEY, message)


def line(method: str, path: str, status: int | str, reply, seconds: float, error: str | None = None) -> str:
    parts = [f"{method} {path} {status}"]
    if error:
        parts.append(error if len(error) <= MAX_REASON_CHARS else error[:MAX_REASON_CHARS] + " ...")
    if reply is not None:
        parts += [
            f"prompt {reply.prompt_tokens} tokens ({reply.cached_tokens} cached)",
            f"completion {reply.completion_tokens} tokens",
        ]
    return " · ".join(parts + [f"{seconds:.2f} s"])


class RequestLog:
    """ASGI middleware: logs requests whose path starts with one of `paths` (the app logs only /v1,
    not the page's own requests)."""

    def __init__(self, app, paths: tuple[str, ...] = ("/",)):
        self.app, self.paths = app, paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.paths):
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        state = scope.setdefault("state", {})  # Request.state reads and writes this dict
        status: int | None = None
        logged = False

        def write(outcome: int | str) -> None:
            nonlocal logged
            logged = True
            took = time.perf_counter() - start
            log.info(line(scope["method"], scope["path"], outcome, state.get(_STATE_KEY), took, state.get(_ERROR_KEY)))

        async def send_and_log(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not logged:
                write(status)

        try:
            await self.app(scope, receive, send_and_log)
        finally:
            if not logged:  # the client left mid-response, or the app raised
                write(f"{status} (cut short)" if status is not None else "(no response)")
