"""The /v1 routes: /v1/models, /v1/chat/completions and /v1/completions, each answering in OpenAI's shapes.

A route reads its body and finds the served model; serving.py does the rest. Every route passes through
`guarded`: the API key, then OpenAI's error shape for whatever fails (a bug of ours is a 500 in that shape,
with the traceback in the log).
"""

import base64
import functools
import logging
import secrets
import struct
from collections.abc import Callable

import anyio
from fastapi import APIRouter, Request, Response

from entrypoints.embeddings import EmbedderSource, ServedEmbedder, embed, find_embedder, listed_embedder
from entrypoints.model_registry import ModelEntry, ModelRegistry
from entrypoints.openai import request_log
from entrypoints.openai.body_reader import openapi_body, parse_body
from entrypoints.openai.errors import APIError
from entrypoints.openai.limits import DEFAULT_MAX_TOKENS, MAX_REQUEST_BYTES
from entrypoints.openai.protocol import (
    ChatCompletionBody,
    CompletionBody,
    EmbeddingBody,
    ModelCard,
    ModelList,
)
from entrypoints.openai.reply import Echo
from entrypoints.openai.serving import (
    BACKGROUND_PRIORITY,
    IGNORED_HEADER,
    ModelSource,
    ServedModel,
    chat_prompt,
    complete,
    refuse_what_cannot_fit,
)

log = logging.getLogger("pagoda.api")


def as_base64(vector: list[float]) -> str:
    """OpenAI's `encoding_format: base64`: the vector's float32 bytes, little-endian, in base64."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def key_required() -> APIError:
    return APIError(
        401,
        "a valid API key is required: send it as `Authorization: Bearer <key>`",
        type="authentication_error",
        code="invalid_api_key",
    )


def has_key(authorization: str, api_key: str | None) -> bool:
    """Whether an Authorization header carries the key (any header does when there is no key)."""
    if api_key is None:
        return True
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), api_key.encode())


async def served_model(models: ModelSource | ModelRegistry, asked: str | None) -> ServedModel:
    """The model `asked` for (None: whichever is serving): from a registry, loaded on first use; else the loaded
    model if it is that one. A 503 or 404 says why not."""
    if isinstance(models, ModelRegistry):
        return await models.pick(asked)
    model = models()
    if model is None:
        raise APIError(
            503, "no model is loaded; load one in Pagoda's Models tab", type="server_error", code="model_not_loaded"
        )
    if asked is not None and asked != model.name:
        raise APIError(
            404,
            f"the model {asked!r} does not exist; this server serves {model.name!r}",
            code="model_not_found",
            param="model",
        )
    return model


def guard(api_key: str | None, respond: Callable[[APIError], Response], key_header: str | None = None) -> Callable:
    """A decorator for an API's routes: the API key first (`Authorization: Bearer`, or `key_header` where the API
    sends it so: Anthropic's x-api-key), then every refusal made into that API's error shape by `respond` (a bug
    of ours is a 500 in that shape, with the traceback in the log)."""

    def guarded(route):
        @functools.wraps(route)  # FastAPI reads the route's own parameters through this wrapper
        async def answer(request: Request, *args, **kwargs):
            try:
                given = request.headers.get(key_header) if key_header else None
                authorization = request.headers.get("authorization", "") if given is None else f"Bearer {given}"
                if not has_key(authorization, api_key):
                    raise key_required()
                return await route(request, *args, **kwargs)
            except APIError as e:
                request_log.record_error(request, e.message)
                return respond(e)
            except Exception as e:  # a bug of ours: still the API's error shape, and the traceback in the log
                log.exception("%s %s failed", request.method, request.url.path)
                return respond(
                    APIError(
                        500,
                        f"Pagoda failed on this request ({type(e).__name__}: {e}); the server log has the details",
                        type="server_error",
                    )
                )

        return answer

    return guarded


def create_router(  # noqa: C901 (pyproject.toml says why)
    models: ModelSource,
    api_key: str | None = None,
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    embedders: EmbedderSource | None = None,
) -> APIRouter:
    """The /v1 routes. With an api_key, every one of them wants `Authorization: Bearer <key>`.
    `default_max_tokens`: for requests that send none (None: the rest of the context);
    `max_request_bytes`: larger bodies get a 413; `embedders`: the embedding model, if one is served."""

    guarded = guard(api_key, APIError.response)

    router = APIRouter(prefix="/v1")
    told_of_dropped_tools: set[tuple] = set()

    async def served(asked: str | None) -> ServedModel:
        return await served_model(models, asked)

    def model_card(model: ServedModel | ServedEmbedder | ModelEntry) -> ModelCard:
        if isinstance(model, ModelEntry):  # a registry's: its state, and its context once loaded
            length = model.engine.max_model_len if model.engine is not None else None
            return ModelCard(id=model.name, max_model_len=length, status=model.state)
        engine = model.engine if isinstance(model, ServedModel) else model.llm
        return ModelCard(id=model.name, max_model_len=engine.max_model_len, status="loaded")

    def embedder() -> ServedEmbedder | None:
        return listed_embedder(embedders)

    @router.get("/models")
    @guarded
    async def list_models(request: Request):
        chats = await anyio.to_thread.run_sync(models.listing) if isinstance(models, ModelRegistry) else [models()]
        served_now = [*chats, embedder()]
        return ModelList(data=[model_card(m) for m in served_now if m is not None]).json_body()

    @router.get("/models/{model_id:path}")
    @guarded
    async def retrieve_model(request: Request, model_id: str):
        other = embedder()
        if other is not None and other.name == model_id:
            return model_card(other).json_body()
        if isinstance(models, ModelRegistry) and model_id in models.entries:  # asking about a model loads nothing
            return model_card(models.entries[model_id]).json_body()
        return model_card(await served(model_id)).json_body()

    @router.post("/chat/completions", openapi_extra=openapi_body(ChatCompletionBody))
    @guarded
    async def chat_completions(request: Request):
        body = await parse_body(request, ChatCompletionBody, max_request_bytes)
        model = await served(body.model)
        if "priority" not in body.model_fields_set and body.looks_like_a_background_task:
            body.priority = BACKGROUND_PRIORITY  # out of the way of the user's visible chats
        prompt = await chat_prompt(model.engine, body)
        if dropped := prompt.tools_dropped:
            client = (request.client.host if request.client else "?", request.headers.get("user-agent", ""))
            if (client, dropped.split(":")[0]) not in told_of_dropped_tools:  # once per client and reason
                told_of_dropped_tools.add((client, dropped.split(":")[0]))
                log.warning("tools dropped for %s (%s): %s", client[0], client[1] or "no user agent", dropped)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await complete(
            request,
            model,
            body,
            prompt.token_ids,
            max_tokens,
            default_max_tokens,
            chat=True,
            tools=prompt.tools,
            headers=prompt.headers(),
        )

    @router.post("/embeddings", openapi_extra=openapi_body(EmbeddingBody))
    @guarded
    async def embeddings(request: Request):
        body = await parse_body(request, EmbeddingBody, max_request_bytes)
        embedder = find_embedder(embedders, models, body.model)
        vectors, tokens = await embed(embedder, body.inputs(), body.dimensions)
        encoded = vectors if body.encoding_format == "float" else [as_base64(v) for v in vectors]
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)],
            "model": embedder.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    @router.post("/completions", openapi_extra=openapi_body(CompletionBody))
    @guarded
    async def completions(request: Request):
        body = await parse_body(request, CompletionBody, max_request_bytes)
        model = await served(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(
                    400, "send one prompt per request (a list of several prompts is not supported)", param="prompt"
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            refuse_what_cannot_fit(model.engine, len(prompt), "prompt")
            token_ids = await anyio.to_thread.run_sync(model.engine.tokenize, prompt)
        else:
            token_ids = list(prompt)
        # Token ids are decoded for the echo once the engine has accepted them (in `complete`)
        echo = Echo(prompt if isinstance(prompt, str) else None, token_ids, only=body.echo_only) if body.echo else None
        ignored = {IGNORED_HEADER: "; ".join(body.ignored)} if body.ignored else None
        return await complete(
            request, model, body, token_ids, body.max_tokens, default_max_tokens, chat=False, echo=echo, headers=ignored
        )

    return router
