"""The headless OpenAI-compatible server: the /v1 routes (api_router.py) on a FastAPI app of their own, with
/metrics, the access guard, the request log, and OpenAI's errors for paths and methods no route has.

The chat app mounts the same routes on its own port (its chats and API calls then share one batch);
`pagoda-serve` (or `python -m engine.serve`) runs them headless through `create_app`. `/metrics` reports
vLLM's metric names, so dashboards and clients written for vLLM read Pagoda's prefix-cache counters too.
"""

import inspect

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException

from engine import EngineThread
from entrypoints.anthropic.errors import speaks_anthropic
from entrypoints.anthropic.protocol import error_response
from entrypoints.anthropic.router import create_router as create_anthropic_router
from entrypoints.embeddings import ServedEmbedder
from entrypoints.http_guard import AccessPolicy, HTTPGuard
from entrypoints.model_registry import ModelRegistry
from entrypoints.ollama.protocol import error_response as ollama_error
from entrypoints.ollama.router import create_router as create_ollama_router
from entrypoints.openai import request_log
from entrypoints.openai.api_router import create_router, has_key, key_required
from entrypoints.openai.errors import APIError
from entrypoints.openai.limits import DEFAULT_MAX_TOKENS, MAX_REQUEST_BYTES
from entrypoints.openai.serving import ModelSource, ServedModel
from entrypoints.responses.router import create_router as create_responses_router

# ---- /metrics --------------------------------------------------------------------------------------
METRICS = [  # vLLM's name, Prometheus type, help, the engine stat it reads
    ("vllm:prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "counter", "Prompt tokens served from the prefix cache.", "prefix_cache_hits"),
    ("vllm:generation_tokens", "counter", "Tokens generated.", "num_generated_tokens"),
    ("vllm:num_preemptions", "counter", "Requests preempted for lack of KV blocks.", "num_preemptions"),
    ("vllm:num_requests_running", "gauge", "Requests in the running batch.", "num_running"),
    ("vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.", "num_waiting"),
    ("pagoda:max_batch_size", "gauge", "The most requests one step has run together, since start.", "max_batch_size"),
    # speculative decoding (0 while it is off): vLLM's names
    ("vllm:spec_decode_num_drafts", "counter", "Request-steps that checked drafted tokens.", "spec_steps"),
    ("vllm:spec_decode_num_draft_tokens", "counter", "Tokens drafted.", "spec_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "counter", "Drafted tokens accepted.", "spec_accepted_tokens"),
]


def create_metrics_router(models: ModelSource) -> APIRouter:
    router = APIRouter()

    @router.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        try:
            model = models()
        except APIError:  # e.g. the app serves its chats from elsewhere: nothing of ours to count
            model = None
        if model is None:
            return ""
        stats = await anyio.to_thread.run_sync(model.engine.stats)
        label = '{model_name="%s"}' % model.name.replace("\\", "\\\\").replace('"', '\\"')
        lines = []
        for name, kind, text, key in METRICS:
            lines += [
                f"# HELP {name} {text}",
                f"# TYPE {name} {kind}",
                f"{name}{'_total' if kind == 'counter' else ''}{label} {getattr(stats, key)}",
            ]
        lines += [
            "# HELP vllm:kv_cache_usage_perc KV-cache usage (1 = full).",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{label} {stats.kv_cache_usage:.6f}",
        ]
        return "\n".join(lines) + "\n"

    return router


class KeyedPaths:
    """ASGI middleware: these paths want the API key too. The headless server puts /metrics and its API
    docs behind it when it is reachable from other machines (on localhost they stay open)."""

    def __init__(self, app, api_key: str, paths: tuple[str, ...]):
        self.app, self.api_key, self.paths = app, api_key, paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] in self.paths:
            authorization = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not has_key(authorization, self.api_key):
                await key_required().response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


SIDE_PATHS = ("/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


def is_api_path(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def routing_error(request: Request, exc: HTTPException) -> JSONResponse | None:
    """The API's error for a path or method no /v1 route has (Starlette's 404 and 405), or None for others."""
    path = request.url.path
    ollama = path.startswith("/api/")
    if not (is_api_path(path) or ollama) or exc.status_code not in (404, 405):
        return None
    where = f"{request.method} {path}"
    shaped = error_response if speaks_anthropic(path) else ollama_error if ollama else APIError.response
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return shaped(
            APIError(
                405,
                f"{where} is not supported: this route takes {allowed or 'other methods'}",
                code="method_not_allowed",
                headers=exc.headers,
            )
        )
    return shaped(
        APIError(
            404,
            f"Invalid URL ({where}): this server serves /v1/chat/completions, /v1/completions, /v1/responses, "
            "/v1/embeddings, /v1/messages and /v1/models",
            code="not_found",
        )
    )


def add_api_error_handlers(app: FastAPI) -> None:
    """Answer unknown /v1 paths and methods in OpenAI's error shape, which its clients parse (with FastAPI's
    {"detail": "Not Found"} the openai client says "Error code: 404 - {'detail': 'Not Found'}"). Every other
    HTTPException still goes to the handler the app had. An exception handler rather than a catch-all
    route: a route misses what Starlette's path patterns cannot match (a path with a newline) and methods
    it does not list (any token is a method)."""
    from fastapi.exception_handlers import http_exception_handler

    previous = app.exception_handlers.get(HTTPException, http_exception_handler)

    async def handler(request: Request, exc: HTTPException):
        response = routing_error(request, exc)
        if response is not None:
            return response
        response = previous(request, exc)
        return await response if inspect.isawaitable(response) else response

    app.add_exception_handler(HTTPException, handler)


def create_app(
    engine: EngineThread | ModelRegistry,
    model_name: str | None,
    api_key: str | None,
    policy: AccessPolicy | None = None,
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    exposed: bool = False,
    embedder: ServedEmbedder | None = None,
) -> FastAPI:
    """A FastAPI app serving one EngineThread as `model_name`, or a ModelRegistry's models by their names: the
    headless server. `policy`: the hosts and sites it answers (default: this machine's loopback names only);
    `exposed`: reachable from other machines, where /metrics and the API docs want the key as /v1 does;
    `embedder`: an embedding model served beside it."""
    if isinstance(engine, ModelRegistry):
        models = engine
    else:
        served = ServedModel(engine, model_name)

        def models() -> ServedModel:
            return served

    app = FastAPI(title="Pagoda OpenAI-compatible API")
    if exposed and api_key:
        app.add_middleware(KeyedPaths, api_key=api_key, paths=SIDE_PATHS)
    app.add_middleware(HTTPGuard, policy=policy or AccessPolicy())
    app.add_middleware(request_log.RequestLog)  # outermost: requests the guard refuses are logged too
    add_api_error_handlers(app)
    app.include_router(
        create_router(models, api_key, default_max_tokens, max_request_bytes, embedders=lambda: embedder)
    )
    app.include_router(create_responses_router(models, api_key, default_max_tokens, max_request_bytes))
    app.include_router(create_anthropic_router(models, api_key, max_request_bytes))
    app.include_router(
        create_ollama_router(models, api_key, default_max_tokens, max_request_bytes, embedders=lambda: embedder)
    )
    app.include_router(create_metrics_router(models))
    return app
