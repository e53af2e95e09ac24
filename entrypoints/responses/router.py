"""OpenAI's Responses routes, for Codex CLI and the OpenAI Agents SDK: POST /v1/responses (whole, or streamed as its
events), GET and DELETE /v1/responses/{id}. A request becomes an OpenAI chat body and goes the way
/v1/chat/completions goes (entrypoints/openai/serving.py); only the shapes differ.

`previous_response_id` continues a stored response: its conversation (instructions aside, as OpenAI's API has it)
comes before the new input. Responses are stored unless `store` is false, in memory, the most recent STORED_RESPONSES
of them (the oldest go first): a server restart forgets them, and a continuation of a forgotten one gets a 404 that
says to send the whole conversation.
"""

from collections import OrderedDict

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from entrypoints.openai import request_log
from entrypoints.openai.api_router import guard, served_model
from entrypoints.openai.body_reader import openapi_body, parse_body
from entrypoints.openai.errors import APIError
from entrypoints.openai.limits import DEFAULT_MAX_TOKENS, MAX_REQUEST_BYTES
from entrypoints.openai.serving import ModelSource, chat_prompt, start_reply, whole_text
from entrypoints.responses.protocol import ResponsesBody, history_of, new_id, output_items, response_object
from entrypoints.responses.stream import response_events

STORED_RESPONSES = 256


class ResponseStore:
    """Finished responses by id, with the conversation each one ended (for previous_response_id)."""

    def __init__(self, size: int = STORED_RESPONSES):
        self.size, self.responses = size, OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        self.responses[response["id"]] = (response, conversation)
        while len(self.responses) > self.size:
            self.responses.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict]]:
        if response_id not in self.responses:
            raise APIError(
                404,
                f"no stored response {response_id!r}: this server keeps its last {self.size} stored responses in "
                "memory (not those sent with store: false, nor any from before a restart); send the whole "
                "conversation as input instead",
                param="previous_response_id",
            )
        self.responses.move_to_end(response_id)
        return self.responses[response_id]


def create_router(
    models: ModelSource,
    api_key: str | None = None,
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
    max_request_bytes: int = MAX_REQUEST_BYTES,
) -> APIRouter:
    guarded = guard(api_key, APIError.response)
    store = ResponseStore()
    router = APIRouter(prefix="/v1")

    @router.post("/responses", openapi_extra=openapi_body(ResponsesBody))
    @guarded
    async def create(request: Request):
        body = await parse_body(request, ResponsesBody, max_request_bytes)
        model = await served_model(models, body.model)
        history = store.get(body.previous_response_id)[1] if body.previous_response_id else []
        chat = body.chat_body(history)
        prompt = await chat_prompt(model.engine, chat)
        reply, stream = await start_reply(
            model, chat, prompt.token_ids, chat.max_tokens, default_max_tokens, True, tools=prompt.tools
        )
        request_log.record(request, reply)
        response_id = new_id("resp")
        asked = [m.model_dump(exclude_none=True) for m in chat.messages[1 if body.instructions else 0 :]]

        def respond(output: list[dict], status: str) -> dict:
            response = response_object(body, response_id, model.name, output, reply, status)
            if status != "in_progress" and body.store:
                store.put(response, [*asked, *history_of(output)])
            return response

        if body.stream:
            events = response_events(reply, stream, respond)
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(prompt.headers() or {})}
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        text = await whole_text(request, reply, stream, chat, prompt.tools)
        if text is None:
            return JSONResponse({}, status_code=499)
        said = reply.whole(text)["choices"][0]["message"]
        return JSONResponse(respond(output_items(said), "completed"), headers=prompt.headers())

    @router.get("/responses/{response_id}")
    @guarded
    async def retrieve(request: Request, response_id: str):
        return store.get(response_id)[0]

    @router.delete("/responses/{response_id}")
    @guarded
    async def delete(request: Request, response_id: str):
        store.get(response_id)
        del store.responses[response_id]
        return {"id": response_id, "object": "response", "deleted": True}

    return router
