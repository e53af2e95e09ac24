"""Anthropic's Messages routes: POST /v1/messages (whole, or streamed as Anthropic's events) and POST
/v1/messages/count_tokens, for Claude Code and the anthropic SDK. A request becomes an OpenAI chat body and goes
the way /v1/chat/completions goes (entrypoints/openai/serving.py); only the shapes differ. The API key may come as
`x-api-key` (the anthropic SDK's) or `Authorization: Bearer`; every refusal is in Anthropic's error shape.

Claude Code names Anthropic's models (claude-sonnet-..., and claude-haiku-... for its background tasks) unless
told otherwise: a `claude-*` name is answered by the loaded model, and the response's X-Pagoda-Model header names
it. Any other name must be the loaded model's.
"""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from entrypoints.anthropic.protocol import MessagesBody, error_response, message
from entrypoints.anthropic.stream import message_events
from entrypoints.openai import request_log
from entrypoints.openai.api_router import guard, served_model
from entrypoints.openai.body_reader import openapi_body, parse_body
from entrypoints.openai.limits import MAX_REQUEST_BYTES
from entrypoints.openai.serving import IGNORED_HEADER, ModelSource, chat_prompt, start_reply, whole_text

MODEL_HEADER = "X-Pagoda-Model"


class CountTokensBody(MessagesBody):
    max_tokens: int = 1  # not part of a count_tokens request


def create_router(
    models: ModelSource, api_key: str | None = None, max_request_bytes: int = MAX_REQUEST_BYTES
) -> APIRouter:
    guarded = guard(api_key, error_response, "x-api-key")

    async def read(request: Request, kind: type[MessagesBody]):
        body = await parse_body(request, kind, max_request_bytes)
        model = await served_model(models, None if body.model.startswith("claude-") else body.model)
        chat = body.chat_body()
        return body, chat, model, await chat_prompt(model.engine, chat)

    router = APIRouter(prefix="/v1")

    @router.post("/messages", openapi_extra=openapi_body(MessagesBody))
    @guarded
    async def messages(request: Request):
        body, chat, model, prompt = await read(request, MessagesBody)
        headers = {MODEL_HEADER: model.name, **(prompt.headers() or {})}
        # Clients send the most a Claude model may write (Claude Code: 32,000) whatever the model: a bound, which
        # the context's room lowers, not a request to refuse
        room = model.engine.max_model_len - len(prompt.token_ids)
        max_tokens = min(body.max_tokens, room) if room > 0 else body.max_tokens
        if max_tokens < body.max_tokens:
            lowered = (
                f"max_tokens: {body.max_tokens} is more than the context has room for; the reply may run to {room}"
            )
            headers[IGNORED_HEADER] = "; ".join(filter(None, [headers.get(IGNORED_HEADER), lowered]))
        reply, stream = await start_reply(model, chat, prompt.token_ids, max_tokens, None, True, tools=prompt.tools)
        request_log.record(request, reply)
        if body.stream:
            return StreamingResponse(
                message_events(reply, stream, body.stop_sequences, model.name),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
            )
        text = await whole_text(request, reply, stream, chat, prompt.tools)
        if text is None:
            return JSONResponse({}, status_code=499)
        whole = message(reply.whole(text), model.name, body.stop_sequences, reply.cached_tokens)
        return JSONResponse(whole, headers=headers)

    @router.post("/messages/count_tokens", openapi_extra=openapi_body(CountTokensBody))
    @guarded
    async def count_tokens(request: Request):
        _, _, model, prompt = await read(request, CountTokensBody)
        return JSONResponse({"input_tokens": len(prompt.token_ids)}, headers={MODEL_HEADER: model.name})

    return router
