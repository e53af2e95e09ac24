"""An OpenAI-compatible HTTP API on an EngineThread: /v1/chat/completions, /v1/completions, /v1/models.

The routes are a FastAPI router, so the chat app mounts them on its own port (its chats and API
calls then share one batch) and `python -m engine.serve` runs them headless (`create_app`).
`/metrics` reports vLLM's metric names, so dashboards and clients written for vLLM read Pagoda's
prefix-cache counters too.
"""
import inspect
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from functools import lru_cache

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from engine import EngineThread, RequestFailed, RequestStream, SamplingParams
from entrypoints.http_guard import AccessPolicy, HTTPGuard
from entrypoints.openai import request_log
from entrypoints.openai.limits import DEFAULT_MAX_TOKENS, MAX_REQUEST_BYTES
from entrypoints.openai.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from entrypoints.openai.protocol import (
    APIError,
    ChatCompletionBody,
    CompletionBody,
    RequestBody,
    openapi_body,
    parse_body,
)
from entrypoints.openai.tool_calls import (
    ToolCallStream,
    ToolPlan,
    plan_tools,
    prompt_messages,
    template_knows_tools,
)
from entrypoints.reasoning import ReasoningSplitter, prompt_opens_reasoning, template_thinks

log = logging.getLogger("pagoda.api")


@dataclass
class ServedModel:
    """What the API serves right now: the engine and the name clients ask for it by."""

    engine: EngineThread
    name: str


# None: no model is loaded (the app between models); it may also raise APIError to say why not.
ModelSource = Callable[[], ServedModel | None]


# ---- the routes ------------------------------------------------------------------------------------
def key_required() -> APIError:
    return APIError(401, "a valid API key is required: send it as `Authorization: Bearer <key>`",
                    type="authentication_error", code="invalid_api_key")


def has_key(authorization: str, api_key: str | None) -> bool:
    """Whether an Authorization header carries the key (any header does when there is no key)."""
    if api_key is None:
        return True
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), api_key.encode())




def create_router(models: ModelSource, api_key: str | None = None,
                  default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
                  max_request_bytes: int = MAX_REQUEST_BYTES) -> APIRouter:
    """The /v1 routes. With an api_key, every one of them wants `Authorization: Bearer <key>`.
    `default_max_tokens`: for requests that send none (None: the rest of the context);
    `max_request_bytes`: larger bodies get a 413."""

    async def check_key(request: Request) -> None:
        if not has_key(request.headers.get("authorization", ""), api_key):
            raise key_required()

    async def guarded(request: Request, handler) -> object:
        try:
            await check_key(request)
            return await handler()
        except APIError as e:
            return e.response()
        except Exception as e:  # a bug of ours: still OpenAI's error shape, and the traceback in the log
            log.exception("%s %s failed", request.method, request.url.path)
            return APIError(500, f"Pagoda failed on this request ({type(e).__name__}: {e}); the server log has "
                                 "the details", type="server_error").response()

    router = APIRouter(prefix="/v1")
    told_of_dropped_tools: set[tuple] = set()

    def served(asked: str | None) -> ServedModel:
        model = models()
        if model is None:
            raise APIError(503, "no model is loaded; load one in Pagoda's Models tab", type="server_error",
                           code="model_not_loaded")
        if asked is not None and asked != model.name:
            raise APIError(404, f"the model {asked!r} does not exist; this server serves {model.name!r}",
                           code="model_not_found", param="model")
        return model

    def model_card(model: ServedModel) -> dict:
        return {"id": model.name, "object": "model", "created": 0, "owned_by": "pagoda",
                "max_model_len": model.engine.max_model_len}

    @router.get("/models")
    async def list_models(request: Request):
        async def handler():
            model = models()
            return {"object": "list", "data": [] if model is None else [model_card(model)]}
        return await guarded(request, handler)

    @router.get("/models/{model_id:path}")
    async def retrieve_model(request: Request, model_id: str):
        async def handler():
            return model_card(served(model_id))
        return await guarded(request, handler)

    @router.post("/chat/completions", openapi_extra=openapi_body(ChatCompletionBody))
    async def chat_completions(request: Request):
        async def handler():
            body = await parse_body(request, ChatCompletionBody, max_request_bytes)
            model = served(body.model)
            if "priority" not in body.model_fields_set and body.looks_like_a_background_task:
                body.priority = BACKGROUND_PRIORITY  # out of the way of the user's visible chats
            token_ids, plan, dropped = await chat_prompt(model.engine, body)
            if dropped:
                client = (request.client.host if request.client else "?", request.headers.get("user-agent", ""))
                if (client, dropped.split(":")[0]) not in told_of_dropped_tools:  # once per client and reason
                    told_of_dropped_tools.add((client, dropped.split(":")[0]))
                    log.warning("tools dropped for %s (%s): %s", client[0], client[1] or "no user agent", dropped)
            max_tokens = body.max_completion_tokens or body.max_tokens
            return await complete(request, model, body, token_ids, max_tokens, default_max_tokens, chat=True,
                                  tools=plan, headers={TOOLS_DROPPED_HEADER: dropped} if dropped else None)
        return await guarded(request, handler)

    @router.post("/completions", openapi_extra=openapi_body(CompletionBody))
    async def completions(request: Request):
        async def handler():
            body = await parse_body(request, CompletionBody, max_request_bytes)
            model = served(body.model)
            prompt = body.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                if len(prompt) != 1:
                    raise APIError(400, "send one prompt per request (a list of several prompts is not supported)",
                                   param="prompt")
                prompt = prompt[0]
            if isinstance(prompt, str):
                refuse_what_cannot_fit(model.engine, len(prompt), "prompt")
                token_ids = await anyio.to_thread.run_sync(model.engine.tokenize, prompt)
            else:
                token_ids = list(prompt)
            # Token ids are decoded for the echo once the engine has accepted them (in `complete`)
            echo = Echo(prompt if isinstance(prompt, str) else None, token_ids, only=body.echo_only) \
                if body.echo else None
            return await complete(request, model, body, token_ids, body.max_tokens, default_max_tokens, chat=False,
                                  echo=echo)
        return await guarded(request, handler)

    return router


@lru_cache(maxsize=4)
def max_token_chars(tokenizer) -> int:
    """The most characters one token stands for: its spelling's length (byte-level BPE spells each byte as
    one character, SentencePiece each character), so n tokens never hold more than n times this."""
    return max(len(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) if t)


def refuse_what_cannot_fit(engine: EngineThread, chars: int, param: str) -> None:
    """A 400 for text too long for the context whatever its tokens, before tokenizing it: a 10 MB prompt
    once took 21 s to tokenize only to be refused."""
    most = engine.max_model_len * max_token_chars(engine.tokenizer)
    if chars > most:
        raise APIError(400, f"This model's maximum context length is {engine.max_model_len} tokens, which hold "
                            f"at most {most:,} characters, and this request sends {chars:,}. Shorten the {param}.",
                       code="context_length_exceeded", param=param)


# What Open WebUI's background tasks get when they send no priority (lower is more urgent; chats get 0):
# beside three 8k-token requests at it, a chat kept 0.98x of its speed alone, at 0 it kept 0.03x
# (bench/RESULTS.md).
BACKGROUND_PRIORITY = 1

# A response whose request's tools were left out (tool_choice auto) says why in this header.
TOOLS_DROPPED_HEADER = "X-Pagoda-Tools-Dropped"
# Tools with tool_choice auto are left out when their description would take more than this share of the
# context: Open WebUI sends 36 by default, about 7k tokens, which leaves an 8k model no room for the chat.
TOOLS_MAX_SHARE = 0.5


async def chat_prompt(engine: EngineThread, body: ChatCompletionBody) -> tuple[list[int], ToolPlan | None, str]:
    """The chat's prompt ids, its tool plan, and why its tools were left out ("" when they were not).

    Tools with tool_choice auto (or none given, as Open WebUI sends them on every chat) are left out
    when the template has no place for them or they would take too much of the context: refusing them
    would break every chat of such a client. `required` and a named tool always go in (described in
    a system message when the template knows no tools): the reply is held to the calls anyway."""
    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    chat_template = engine.tokenizer.chat_template
    knows_tools = template_knows_tools(chat_template)
    template_kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        if not template_thinks(chat_template):
            raise APIError(400, "reasoning_effort is for models that think (Qwen3, DeepSeek-R1 distills), and this "
                                "one does not: leave it out", param="reasoning_effort")
        template_kwargs.setdefault("enable_thinking", body.reasoning_effort not in ("none", "minimal"))
    dropped = ""
    if plan is not None and plan.mode == "auto" and not knows_tools:
        plan, dropped = None, "the model's chat template has no tool support"
    raw = [m.for_template(i) for i, m in enumerate(body.messages)]
    tools = plan.template_tools() if plan else None
    messages = prompt_messages(raw, tools, knows_tools)
    refuse_what_cannot_fit(engine, sum(len(json.dumps(m)) for m in messages), "messages")
    with_tools = {**template_kwargs, "tools": tools} if tools and knows_tools else template_kwargs
    token_ids = await anyio.to_thread.run_sync(lambda: encode_chat(engine, messages, **with_tools))
    if tools and plan.mode == "auto":
        bare = await anyio.to_thread.run_sync(lambda: encode_chat(engine, prompt_messages(raw, None, knows_tools),
                                                                  **template_kwargs))
        cost, limit = len(token_ids) - len(bare), int(TOOLS_MAX_SHARE * engine.max_model_len)
        if cost > limit:
            token_ids, plan = bare, None
            dropped = (f"the tools take {cost:,} tokens, more than {TOOLS_MAX_SHARE:.0%} of the model's "
                       f"{engine.max_model_len:,}-token context")
    return token_ids, plan, dropped


def encode_chat(engine: EngineThread, messages: list[dict], **template_kwargs) -> list[int]:
    """The conversation through the engine's one chat encoder, which the app's chats use too."""
    from jinja2 import TemplateError

    try:
        return engine.encode_chat(messages, **template_kwargs)
    except ValueError as e:  # e.g. a model without a chat template
        raise APIError(400, f"{e}; use /v1/completions with a plain prompt") from None
    except TemplateError as e:  # the template refuses the conversation (e.g. roles out of order)
        raise APIError(400, f"the model's chat template refused these messages: {e}", param="messages") from None


def sampling_params(body: RequestBody, num_prompt_tokens: int, max_tokens: int | None,
                    max_model_len: int, default_max_tokens: int | None = None,
                    tools: ToolPlan | None = None) -> SamplingParams:
    """The request's sampling settings. Without max_tokens: `default_max_tokens`, or as many as the
    context has room for, whichever is fewer."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                            f"{num_prompt_tokens}. Shorten the messages.", code="context_length_exceeded",
                                param="messages")
    if max_tokens is not None and max_tokens > room:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                            f"{max_tokens} for "
                            f"the completion). Reduce the prompt or max_tokens.",
                       code="context_length_exceeded", param="max_tokens")
    logprobs = prompt_logprobs = None
    if isinstance(body, ChatCompletionBody):
        logprobs = body.num_logprobs
    elif isinstance(body, CompletionBody):
        logprobs = body.logprobs
        prompt_logprobs = logprobs if body.echo else None
        if body.echo_only:  # one token is generated (the engine always samples one) and left out of the reply
            max_tokens = 1
    if max_tokens is None:
        max_tokens = min(room, default_max_tokens or room)
    constraint = body.constraint()
    forced = tools.constraint() if tools else None
    if forced is not None:
        if constraint is not None:
            raise APIError(400, f"tool_choice {tools.mode!r} holds the reply to tool calls, so it cannot also follow "
                                "response_format; send one of them", param="response_format")
        constraint = forced
    try:
        return SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                              repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
                              frequency_penalty=body.frequency_penalty, logit_bias=body.token_biases(),
                              max_tokens=max_tokens, stop=body.stop, seed=body.seed, logprobs=logprobs,
                              ignore_eos=body.ignore_eos, stop_token_ids=body.stop_token_ids,
                              prompt_logprobs=prompt_logprobs, structured_outputs=constraint)
    except ValueError as e:
        raise APIError(400, str(e)) from None


@dataclass
class Echo:
    """A completion's prompt, to put before its text (`echo`)."""

    text: str | None  # None: to be decoded from token_ids
    token_ids: list[int]
    only: bool  # max_tokens=0: the prompt and nothing generated


@lru_cache(maxsize=4)
def token_texts(tokenizer) -> TokenTexts:
    """One per tokenizer, so its cache of token texts lasts across requests."""
    return TokenTexts(tokenizer)


async def complete(request: Request, model: ServedModel, body: RequestBody, token_ids: list[int],
                   max_tokens: int | None, default_max_tokens: int | None, chat: bool,
                   echo: Echo | None = None, tools: ToolPlan | None = None,
                   headers: dict[str, str] | None = None) -> object:
    engine = model.engine
    params = sampling_params(body, len(token_ids), max_tokens, engine.max_model_len, default_max_tokens, tools)
    try:
        stream = await anyio.to_thread.run_sync(engine.submit, token_ids, params, body.priority)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e)) from None
    except RuntimeError as e:
        raise APIError(503, str(e), type="server_error") from None
    if echo is not None and echo.text is None:
        # Only now: the engine has refused ids outside the vocabulary with a 400 that names them, where the
        # tokenizer raised OverflowError on a negative one (a 500).
        try:
            echo.text = await anyio.to_thread.run_sync(engine.tokenizer.decode, echo.token_ids)
        except BaseException:
            stream.cancel()
            raise
    texts = token_texts(engine.tokenizer) if params.logprobs is not None else None
    reasoning = None
    if chat and template_thinks(engine.tokenizer.chat_template) and not (tools and tools.constraint()):
        prompt_tail = await anyio.to_thread.run_sync(engine.tokenizer.decode, token_ids[-8:])
        reasoning = ReasoningSplitter(in_reasoning=prompt_opens_reasoning(prompt_tail))
    reply = Reply(model.name, chat, len(token_ids), params.logprobs, texts, echo,
                  ToolCallStream(tools) if tools and tools.mode != "none" else None, reasoning)
    request_log.record(request, reply)
    if body.stream:
        return StreamingResponse(reply.sse(stream, body.include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
    text = []
    try:
        async for out in stream:
            reply.count(out)
            text.append(out.new_text)
            if reply.chat:
                reply.take(out)
            if await request.is_disconnected():
                stream.cancel()
                return JSONResponse({}, status_code=499)
    except RequestFailed as e:
        raise APIError(500, str(e), type="server_error") from None
    return JSONResponse(reply.whole("".join(text)), headers=headers)


class Reply:
    """Shapes engine increments into OpenAI's response objects and counts usage.

    `logprobs`: SamplingParams.logprobs (None: not asked), with `texts` to name the tokens; `echo`: a
    completion's prompt, which comes first in its text (and its logprobs, when asked)."""

    def __init__(self, model_name: str, chat: bool, num_prompt_tokens: int, logprobs: int | None = None,
                 texts: TokenTexts | None = None, echo: Echo | None = None, tools: ToolCallStream | None = None,
                 reasoning: ReasoningSplitter | None = None):
        self.model_name, self.chat = model_name, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.prompt_tokens, self.completion_tokens, self.cached_tokens = num_prompt_tokens, 0, 0
        self.finish_reason: str | None = None
        self.logprobs, self.texts, self.echo = logprobs, texts, echo
        self.token_ids: list[int] = []  # the reply's tokens, and their logprobs entries when asked
        self.entries: list[dict[int, float]] = []
        self.prompt_entries: list[dict[int, float] | None] | None = None
        self.text_sent = 0  # characters of a streamed completion's text sent so far (its tokens' text_offset)
        self.tools = tools  # parses tool calls out of the text, when the request has tools
        self.reasoning = reasoning  # splits a thinking model's reasoning from its answer
        self.reasoning_tokens = 0
        self.content: list[str] = []  # a chat reply's content, as `take` has split it

    def take(self, out, final: bool = False) -> tuple[str, str, list[dict]]:
        """A chat increment's text as (reasoning, content, tool-call deltas); `final`: after the last
        increment, what was held back. The content is kept for `whole`."""
        text = "" if final else out.new_text
        reasoning = ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.finish() if final else self.reasoning.feed(text)
            if reasoning and not text and out is not None:
                self.reasoning_tokens += len(out.new_token_ids)
        calls = []
        if self.tools is not None:
            text, calls = self.tools.feed(text)
            if final:
                more, more_calls = self.tools.finish()
                text, calls = text + more, calls + more_calls
        self.content.append(text)
        return reasoning, text, calls

    @property
    def choice_finish_reason(self) -> str | None:
        """OpenAI's: "tool_calls" when a reply that ended by itself called tools."""
        if self.tools is not None and self.tools.calls and self.finish_reason == "stop":
            return "tool_calls"
        return self.finish_reason

    def count(self, out) -> None:
        self.cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_entries = out.prompt_logprobs
        if self.echo is not None and self.echo.only:  # the token generated is not part of the reply
            self.finish_reason = "length" if out.finished and out.finish_reason != "abort" else self.finish_reason
            return
        self.completion_tokens += len(out.new_token_ids)
        self.token_ids += out.new_token_ids
        self.entries += out.logprobs or []
        if out.finished and out.finish_reason in ("stop", "length"):
            self.finish_reason = out.finish_reason

    def choice_logprobs(self, token_ids: list[int], entries: list, text_offset: int = 0) -> dict | None:
        """`choices[i].logprobs` for these tokens in the route's shape; None when not asked."""
        if self.logprobs is None:
            return None
        if self.chat:
            return {"content": chat_logprobs(token_ids, entries, self.logprobs, self.texts)}
        return completion_logprobs(token_ids, entries, self.texts, text_offset)

    def echoed_prompt(self) -> tuple[list[int], list]:
        """The echoed prompt's tokens and entries (None for the first; all None if logprobs were not asked)."""
        ids = self.echo.token_ids
        return ids, self.prompt_entries or [None] * len(ids)

    def usage(self) -> dict:
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                 "total_tokens": self.prompt_tokens + self.completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if self.reasoning is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return usage

    def whole(self, text: str) -> dict:
        ids, entries = self.token_ids, self.entries
        if self.echo is not None:
            prompt_ids, prompt_entries = self.echoed_prompt()
            text = self.echo.text + ("" if self.echo.only else text)
            ids, entries = prompt_ids + ids, prompt_entries + entries
        logprobs = self.choice_logprobs(ids, entries)
        if self.chat:
            self.take(None, final=True)
            content = "".join(self.content)
            message = {"role": "assistant", "content": content or None if self.tools and self.tools.calls else content}
            if self.reasoning is not None and self.reasoning.reasoning:
                message["reasoning_content"] = self.reasoning.reasoning
            if self.tools is not None and self.tools.calls:
                message["tool_calls"] = self.tools.calls
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": self.choice_finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": self.finish_reason}
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model_name,
                "choices": [choice], "usage": self.usage()}

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False,
              logprobs: dict | None = None, tool_calls: list[dict] | None = None, reasoning: str = "") -> dict:
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            if reasoning:
                delta["reasoning_content"] = reasoning
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return {"id": self.id, "object": f"{self.object}.chunk" if self.chat else self.object, "created": self.created,
                "model": self.model_name, "choices": [choice]}

    async def sse(self, stream: RequestStream, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events. A client that goes away closes this generator, which aborts the request."""

        def event(obj: dict) -> str:
            if include_usage:
                obj.setdefault("usage", None)
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        if self.chat:
            yield event(self.chunk("", role=True))
        try:
            async with aclosing(self._chunks(stream)) as chunks:  # closed with this generator: aborts the request
                async for chunk in chunks:
                    yield event(chunk)
        except RequestFailed as e:  # headers are sent: the error goes in the stream, as OpenAI's does
            yield f"data: {json.dumps(APIError(500, str(e), type='server_error').body())}\n\n"
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            yield event({"id": self.id, "object": f"{self.object}.chunk" if self.chat else self.object,
                         "created": self.created, "model": self.model_name, "choices": [], "usage": self.usage()})
        yield "data: [DONE]\n\n"

    async def _chunks(self, stream: RequestStream) -> AsyncIterator[dict]:
        """The stream's chunks after the first (the role), its finish reason's last."""
        echoed = self.echo is None
        async for out in stream:
            self.count(out)
            if not echoed:  # the prompt's logprobs come with the first output
                echoed = True
                yield self.chunk(self.echo.text, logprobs=self.choice_logprobs(*self.echoed_prompt()))
                self.text_sent = len(self.echo.text)
                if self.echo.only:
                    continue
            reasoning, text, calls = self.take(out) if self.chat else ("", out.new_text, [])
            if reasoning:
                yield self.chunk(None, reasoning=reasoning)
            if calls:
                yield self.chunk(None, tool_calls=calls)
            # A token whose text is held back (a partial character, a possible stop string) still
            # brings its logprobs.
            if text or (self.logprobs is not None and out.logprobs):
                logprobs = self.choice_logprobs(out.new_token_ids, out.logprobs or [], self.text_sent)
                yield self.chunk(text, logprobs=logprobs)
                self.text_sent += len(text)
        if self.chat:
            reasoning, text, calls = self.take(None, final=True)
            if reasoning or text or calls:
                yield self.chunk(text or None, tool_calls=calls, reasoning=reasoning)
        yield self.chunk(None if self.chat else "", self.choice_finish_reason)


# ---- /metrics --------------------------------------------------------------------------------------
METRICS = [  # vLLM's name, Prometheus type, help, the engine stat it reads
    ("vllm:prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "counter", "Prompt tokens served from the prefix cache.", "prefix_cache_hits"),
    ("vllm:generation_tokens", "counter", "Tokens generated.", "num_generated_tokens"),
    ("vllm:num_preemptions", "counter", "Requests preempted for lack of KV blocks.", "num_preemptions"),
    ("vllm:num_requests_running", "gauge", "Requests in the running batch.", "num_running"),
    ("vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.", "num_waiting"),
    ("pagoda:max_batch_size", "gauge", "The most requests one step has run together, since start.", "max_batch_size"),
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
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}",
                      f"{name}{'_total' if kind == 'counter' else ''}{label} {getattr(stats, key)}"]
        lines += ["# HELP vllm:kv_cache_usage_perc KV-cache usage (1 = full).", "# TYPE vllm:kv_cache_usage_perc gauge",
                  f"vllm:kv_cache_usage_perc{label} {stats.kv_cache_usage:.6f}"]
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
    """OpenAI's error for a path or method no /v1 route has (Starlette's 404 and 405), or None for others."""
    if not is_api_path(request.url.path) or exc.status_code not in (404, 405):
        return None
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return APIError(405, f"{where} is not supported: this route takes {allowed or 'other methods'}",
                        code="method_not_allowed", headers=exc.headers).response()
    return APIError(404, f"Invalid URL ({where}): this server serves /v1/chat/completions, /v1/completions "
                         "and /v1/models", code="not_found").response()


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


def create_app(engine: EngineThread, model_name: str, api_key: str | None,
               policy: AccessPolicy | None = None, default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
               max_request_bytes: int = MAX_REQUEST_BYTES, exposed: bool = False) -> FastAPI:
    """A FastAPI app serving one EngineThread: the headless server. `policy`: the hosts and sites it answers
    (default: this machine's loopback names only); `exposed`: reachable from other machines, where
    /metrics and the API docs want the key as /v1 does."""
    served = ServedModel(engine, model_name)
    app = FastAPI(title="Pagoda OpenAI-compatible API")
    if exposed and api_key:
        app.add_middleware(KeyedPaths, api_key=api_key, paths=SIDE_PATHS)
    app.add_middleware(HTTPGuard, policy=policy or AccessPolicy())
    app.add_middleware(request_log.RequestLog)  # outermost: requests the guard refuses are logged too
    add_api_error_handlers(app)
    app.include_router(create_router(lambda: served, api_key, default_max_tokens, max_request_bytes))
    app.include_router(create_metrics_router(lambda: served))
    return app
