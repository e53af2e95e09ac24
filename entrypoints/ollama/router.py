"""Ollama's API routes, for the editor plugins, scripts and Open WebUI connections that speak it: /api/chat and
/api/generate (whole, or streamed as NDJSON lines, Ollama's default), /api/tags, /api/ps, /api/show and
/api/version. A request becomes an OpenAI body and goes the way /v1/chat/completions goes
(entrypoints/openai/serving.py); only the shapes differ. Behind the same API key as /v1 (`Authorization: Bearer`),
and every refusal in Ollama's error shape ({"error": "..."}).

A model is named as /api/tags lists it (the served name), with or without Ollama's ":latest" tag. /api/embed and
/api/embeddings answer from the embedding model served beside the chat model (entrypoints/embeddings.py), as
/v1/embeddings does.
"""

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine import RequestFailed
from entrypoints.embeddings import EmbedderSource, embed, find_embedder, listed_embedder
from entrypoints.model_registry import ModelRegistry
from entrypoints.ollama.protocol import (
    OLLAMA_API_VERSION,
    ChatBody,
    EmbedBody,
    GenerateBody,
    counts,
    error_response,
    keep_alive_seconds,
    now,
    ollama_calls,
)
from entrypoints.openai import request_log
from entrypoints.openai.api_router import guard, served_model
from entrypoints.openai.body_reader import openapi_body, parse_body
from entrypoints.openai.errors import APIError
from entrypoints.openai.limits import DEFAULT_MAX_TOKENS, MAX_REQUEST_BYTES
from entrypoints.openai.protocol import ChatCompletionBody
from entrypoints.openai.reply import Reply, failure
from entrypoints.openai.serving import ModelSource, ServedModel, chat_prompt, refuse_what_cannot_fit, start_reply
from entrypoints.openai.serving import whole_text as read_whole


def create_router(  # noqa: C901 (one closure per route, as the /v1 router)
    models: ModelSource,
    api_key: str | None = None,
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    embedders: EmbedderSource | None = None,
) -> APIRouter:
    guarded = guard(api_key, error_response)

    def embedder():
        return listed_embedder(embedders)

    async def served(asked: str) -> ServedModel:
        if isinstance(models, ModelRegistry):  # Ollama's names may carry ":latest"
            name = next(
                (n for n in models.names() if n.removesuffix(":latest") == asked.removesuffix(":latest")), asked
            )
            return await served_model(models, name or None)
        model = await served_model(models, None)
        if asked and asked.removesuffix(":latest") != model.name.removesuffix(":latest"):
            raise APIError(404, f"model {asked!r} not found; this server serves {model.name!r}")
        return model

    def details(engine) -> dict:
        """Ollama's details of a model (of a registry's model not loaded: what is known without loading it)."""
        return {
            "format": "",
            "family": "",
            "families": None,
            "parameter_size": "",
            "quantization_level": engine.stats().quantization if engine is not None else "",
        }

    def listed(name: str, engine) -> dict:
        return {"name": name, "model": name, "modified_at": now(), "size": 0, "digest": "", "details": details(engine)}

    def served_now() -> list[tuple[str, object]]:
        """(name, engine) of each model loaded: the chat models and the embedding model, where there are."""
        if isinstance(models, ModelRegistry):
            chats = [(e.name, e.engine) for e in models.listing(look=False) if e.engine is not None]
        else:
            chats = [(m.name, m.engine) for m in [models()] if m is not None]
        other = embedder()
        return chats + [(e.name, e.llm) for e in [other] if e]

    async def reply_to(request: Request, body, model: ServedModel, key: str):
        """The reply to a chat or generate request, whole or streamed; `key`: "message" or "response"."""
        chat = isinstance(body, ChatCompletionBody)
        if chat:
            prompt = await chat_prompt(model.engine, body)
            token_ids, tools, headers = prompt.token_ids, prompt.tools, prompt.headers()
        else:
            refuse_what_cannot_fit(model.engine, len(body.prompt), "prompt")
            token_ids = await anyio.to_thread.run_sync(model.engine.tokenize, body.prompt)
            tools, headers = None, None
        started = time.perf_counter()
        reply, stream = await start_reply(
            model, body, token_ids, body.max_tokens, default_max_tokens, chat, tools=tools
        )
        request_log.record(request, reply)
        if body.stream:
            lines = ndjson(reply, stream, model.name, key, started)
            return StreamingResponse(lines, media_type="application/x-ndjson", headers=headers)
        text = await read_whole(request, reply, stream, body, tools)
        if text is None:
            return JSONResponse({}, status_code=499)
        said = reply.whole(text)["choices"][0]
        said = said.get("message") or {"content": said.get("text", "")}
        out = {"model": model.name, "created_at": now()}
        if key == "message":
            message = {"role": "assistant", "content": said.get("content") or ""}
            if said.get("reasoning_content"):
                message["thinking"] = said["reasoning_content"]
            if said.get("tool_calls"):
                message["tool_calls"] = ollama_calls(said["tool_calls"])
            out["message"] = message
        else:
            out["response"] = said.get("content") or ""
            if said.get("reasoning_content"):
                out["thinking"] = said["reasoning_content"]
        return JSONResponse({**out, "done": True, **counts(reply, started)}, headers=headers)

    router = APIRouter(prefix="/api")

    def keep_alive(body, model: ServedModel, asked=None) -> bool:
        """Ollama's keep_alive where several models are served by name: how long `model` stays loaded once idle.
        Taken (True) for all but the default model; then `asked` (the request's OpenAI body) no longer lists it
        among the fields it ignored."""
        if body.keep_alive is None or not isinstance(models, ModelRegistry):
            return False
        taken = models.keep(model.name, keep_alive_seconds(body.keep_alive))
        if taken and asked is not None:
            asked.ignored[:] = [note for note in asked.ignored if not note.startswith("keep_alive:")]
        return taken

    @router.post("/chat", openapi_extra=openapi_body(ChatBody))
    @guarded
    async def chat(request: Request):
        body = await parse_body(request, ChatBody, max_request_bytes)
        asked, model = body.openai(), await served(body.model)
        keep_alive(body, model, asked)
        return await reply_to(request, asked, model, "message")

    @router.post("/generate", openapi_extra=openapi_body(GenerateBody))
    @guarded
    async def generate(request: Request):
        body = await parse_body(request, GenerateBody, max_request_bytes)
        model = await served(body.model)
        if not body.prompt and not body.system:  # Ollama's way to load a model, or with keep_alive 0 to unload it
            unloads = keep_alive(body, model) and keep_alive_seconds(body.keep_alive) == 0
            return JSONResponse(
                {
                    "model": model.name,
                    "created_at": now(),
                    "response": "",
                    "done": True,
                    "done_reason": "unload" if unloads else "load",
                }
            )
        asked = body.openai()
        keep_alive(body, model, asked)
        return await reply_to(request, asked, model, "response")

    @router.get("/tags")
    @guarded
    async def tags(request: Request):
        if isinstance(models, ModelRegistry):  # every model it can serve, loaded or not, as Ollama lists its own
            every = [(e.name, e.engine) for e in await anyio.to_thread.run_sync(models.listing)]
            every += [(n, e) for n, e in served_now() if n not in dict(every)]  # the embedding model
            return {"models": [listed(name, engine) for name, engine in every]}
        return {"models": [listed(name, engine) for name, engine in served_now()]}

    @router.get("/ps")
    @guarded
    async def ps(request: Request):
        running = [{**listed(*m), "expires_at": "0001-01-01T00:00:00Z", "size_vram": 0} for m in served_now()]
        return {"models": running}

    @router.post("/show")
    @guarded
    async def show(request: Request):
        raw = await request.body()
        try:
            asked = json.loads(raw or b"{}")
        except ValueError:
            raise APIError(400, "the request body is not valid JSON") from None
        name = asked.get("model") or asked.get("name") if isinstance(asked, dict) else None
        if not isinstance(name, str):
            raise APIError(400, 'send {"model": <name>}')
        other = embedder()
        if other is not None and name.removesuffix(":latest") == other.name.removesuffix(":latest"):
            return {
                "modified_at": now(),
                "template": "",
                "parameters": "",
                "details": details(other.llm),
                "model_info": {"general.context_length": other.llm.max_model_len},
                "capabilities": ["embedding"],
            }
        model = await served(name)
        template = model.engine.tokenizer.chat_template or ""
        capabilities = ["completion"] + (["tools"] if "tools" in template else [])
        capabilities += ["thinking"] if "think" in template else []
        return {
            "modified_at": now(),
            "template": template,
            "parameters": "",
            "details": details(model.engine),
            "model_info": {"general.context_length": model.engine.max_model_len},
            "capabilities": capabilities,
        }

    @router.get("/version")
    @guarded
    async def version(request: Request):
        return {"version": OLLAMA_API_VERSION}

    async def embeddings_of(request: Request):
        body = await parse_body(request, EmbedBody, max_request_bytes)
        asked = body.model.removesuffix(":latest")
        names = [name for name, _ in served_now()]
        asked = next((n for n in names if n.removesuffix(":latest") == asked), asked)
        chosen = find_embedder(embedders, models, asked)
        started = time.perf_counter()
        vectors, tokens = await embed(chosen, body.inputs(), body.dimensions, truncate=body.truncate)
        took = int((time.perf_counter() - started) * 1e9)
        return chosen.name, vectors, {"total_duration": took, "load_duration": 0, "prompt_eval_count": tokens}

    @router.post("/embed", openapi_extra=openapi_body(EmbedBody))
    @guarded
    async def embed_route(request: Request):
        name, vectors, timings = await embeddings_of(request)
        return {"model": name, "embeddings": vectors, **timings}

    @router.post("/embeddings", openapi_extra=openapi_body(EmbedBody))
    @guarded
    async def embeddings(request: Request):  # Ollama's older route: one prompt, one vector
        _, vectors, _ = await embeddings_of(request)
        return {"embedding": vectors[0]}

    return router


async def ndjson(reply: Reply, stream, model: str, key: str, started: float) -> AsyncIterator[str]:
    """Ollama's stream: a JSON line per increment, then one with done and the counters. Tool calls come whole,
    in a line of their own before it. A client that goes away closes this generator, which aborts the request."""

    def line(fields: dict, done: bool = False) -> str:
        return json.dumps({"model": model, "created_at": now(), **fields, "done": done}, ensure_ascii=False) + "\n"

    def part(content: str, thinking: str = "") -> dict:
        if key == "message":
            message = {"role": "assistant", "content": content}
            return {"message": {**message, "thinking": thinking} if thinking else message}
        return {"response": content, **({"thinking": thinking} if thinking else {})}

    try:
        async with aclosing(reply.deltas(stream)) as deltas:
            async for delta in deltas:
                content, thinking = delta.get("content") or "", delta.get("reasoning_content") or ""
                if content or thinking:
                    yield line(part(content, thinking))
    except RequestFailed as e:  # headers are sent: the error goes in the stream, as Ollama's does
        yield json.dumps({"error": failure(e).message}) + "\n"
        return
    if reply.calls and key == "message":
        yield line({"message": {"role": "assistant", "content": "", "tool_calls": ollama_calls(reply.calls)}})
    yield line({**part(""), **counts(reply, started)}, done=True)
