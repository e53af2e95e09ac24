"""Serving one request: the prompt a chat becomes, the sampling settings, and the engine's stream, whose
increments reply.py shapes into OpenAI's objects (whole, or as server-sent events). The routes (api_router.py)
call `complete`."""

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine import EngineThread, RequestFailed, RequestStream, SamplingParams
from entrypoints.gemma4_format import template_speaks_gemma4
from entrypoints.harmony import template_speaks_harmony
from entrypoints.openai import request_log
from entrypoints.openai.errors import APIError
from entrypoints.openai.logprobs import TokenTexts
from entrypoints.openai.protocol import (
    ChatCompletionBody,
    CompletionBody,
    RequestBody,
)
from entrypoints.openai.reply import Echo, Reply, failure
from entrypoints.openai.tool_calls import ToolCallStream, ToolPlan, plan_tools, prompt_messages, template_knows_tools
from entrypoints.reasoning import ReasoningSplitter, prompt_opens_reasoning, template_thinks
from entrypoints.token_formats import token_format_stream


@dataclass
class ServedModel:
    """What the API serves right now: the engine and the name clients ask for it by."""

    engine: EngineThread
    name: str


# None: no model is loaded (the app between models); it may also raise APIError to say why not.
ModelSource = Callable[[], ServedModel | None]


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
        raise APIError(
            400,
            f"This model's maximum context length is {engine.max_model_len} tokens, which hold "
            f"at most {most:,} characters, and this request sends {chars:,}. Shorten the {param}.",
            code="context_length_exceeded",
            param=param,
        )


# What Open WebUI's background tasks get when they send no priority (lower is more urgent; chats get 0):
# beside three 8k-token requests at it, a chat kept 0.98x of its speed alone, at 0 it kept 0.03x
# (bench/RESULTS.md).
BACKGROUND_PRIORITY = 1

# A response whose request's tools were left out (tool_choice auto) says why in this header.
TOOLS_DROPPED_HEADER = "X-Pagoda-Tools-Dropped"
# A response whose request set something this model has no use for (reasoning_effort on a model that does not
# think, as a client's default sends it on every chat) names it and why in this header: refused, every chat broke.
IGNORED_HEADER = "X-Pagoda-Ignored"
# Tools with tool_choice auto are left out when their description would take more than this share of the
# context: Open WebUI sends 36 by default, about 7k tokens, which leaves an 8k model no room for the chat.
TOOLS_MAX_SHARE = 0.5


@dataclass
class ChatPrompt:
    token_ids: list[int]
    tools: ToolPlan | None
    tools_dropped: str = ""  # why the request's tools were left out
    ignored: str = ""  # the request's settings this model has no use for, and why

    def headers(self) -> dict[str, str] | None:
        """What the response says of the two, in headers (None: nothing to say)."""
        headers = {TOOLS_DROPPED_HEADER: self.tools_dropped, IGNORED_HEADER: self.ignored}
        return {name: value for name, value in headers.items() if value} or None


async def chat_prompt(engine: EngineThread, body: ChatCompletionBody) -> ChatPrompt:
    """The chat's prompt ids, its tool plan, why its tools were left out and what it set that was ignored.

    Tools with tool_choice auto (or none given, as Open WebUI sends them on every chat) are left out
    when the template has no place for them or they would take too much of the context: refusing them
    would break every chat of such a client. `required` and a named tool always go in (described in
    a system message when the template knows no tools): the reply is held to the calls anyway."""
    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    chat_template = engine.tokenizer.chat_template
    knows_tools = template_knows_tools(chat_template)
    template_kwargs = dict(body.chat_template_kwargs or {})
    ignored = list(body.ignored)
    if body.reasoning_effort is not None:
        if template_thinks(chat_template) or template_speaks_gemma4(chat_template):  # a thinking switch
            template_kwargs.setdefault("enable_thinking", body.reasoning_effort not in ("none", "minimal"))
        elif template_speaks_harmony(chat_template):  # gpt-oss: its `Reasoning:` line, low to high
            effort = body.reasoning_effort
            template_kwargs.setdefault("reasoning_effort", "low" if effort in ("none", "minimal") else effort)
            if effort in ("none", "minimal"):
                ignored.append(f"reasoning_effort: {effort}: this model always reasons; it got low")
        else:
            ignored.append("reasoning_effort: this model does not think")
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
        bare = await anyio.to_thread.run_sync(
            lambda: encode_chat(engine, prompt_messages(raw, None, knows_tools), **template_kwargs)
        )
        cost, limit = len(token_ids) - len(bare), int(TOOLS_MAX_SHARE * engine.max_model_len)
        if cost > limit:
            token_ids, plan = bare, None
            dropped = (
                f"the tools take {cost:,} tokens, more than {TOOLS_MAX_SHARE:.0%} of the model's "
                f"{engine.max_model_len:,}-token context"
            )
    if plan is not None and plan.loosens_strict_tools:
        ignored.append(
            'strict: with tool_choice "auto" the calls are read from the reply, not held to their schemas; '
            'send tool_choice "required" or a named tool for that'
        )
    return ChatPrompt(token_ids, plan, dropped, "; ".join(ignored))


def encode_chat(engine: EngineThread, messages: list[dict], **template_kwargs) -> list[int]:
    """The conversation through the engine's one chat encoder, which the app's chats use too."""
    from jinja2 import TemplateError

    try:
        return engine.encode_chat(messages, **template_kwargs)
    except ValueError as e:  # e.g. a model without a chat template
        raise APIError(400, f"{e}; use /v1/completions with a plain prompt") from None
    except TemplateError as e:  # the template refuses the conversation (e.g. roles out of order)
        raise APIError(400, f"the model's chat template refused these messages: {e}", param="messages") from None


def sampling_params(
    body: RequestBody,
    num_prompt_tokens: int,
    max_tokens: int | None,
    max_model_len: int,
    default_max_tokens: int | None = None,
    tools: ToolPlan | None = None,
) -> SamplingParams:
    """The request's sampling settings. Without max_tokens: `default_max_tokens`, or as many as the
    context has room for, whichever is fewer."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{num_prompt_tokens}. Shorten the messages.",
            code="context_length_exceeded",
            param="messages",
        )
    if max_tokens is not None and max_tokens > room:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} for "
            f"the completion). Reduce the prompt or max_tokens.",
            code="context_length_exceeded",
            param="max_tokens",
        )
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
            raise APIError(
                400,
                f"tool_choice {tools.mode!r} holds the reply to tool calls, so it cannot also follow "
                "response_format; send one of them",
                param="response_format",
            )
        constraint = forced
    return body.sampling_params(max_tokens, logprobs, prompt_logprobs, constraint)


@lru_cache(maxsize=4)
def token_texts(tokenizer) -> TokenTexts:
    """One per tokenizer, so its cache of token texts lasts across requests."""
    return TokenTexts(tokenizer)


async def start_reply(
    model: ServedModel,
    body: RequestBody,
    token_ids: list[int],
    max_tokens: int | None,
    default_max_tokens: int | None,
    chat: bool,
    echo: Echo | None = None,
    tools: ToolPlan | None = None,
) -> tuple[Reply, RequestStream]:
    """The request submitted to the engine: its stream of increments, and the Reply that reads them (its
    reasoning, answer and tool calls). Every API's routes start here."""
    engine = model.engine
    params = sampling_params(body, len(token_ids), max_tokens, engine.max_model_len, default_max_tokens, tools)
    try:
        stream = await anyio.to_thread.run_sync(engine.submit, token_ids, params, body.priority)
    except (ValueError, TypeError) as e:
        message = str(e)
        if not message.startswith("structured_outputs:"):
            raise APIError(400, message) from None
        raise APIError(400, message, param=constraint_field(body, tools)) from None  # it did not compile
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
    reasoning = channels = None
    free = chat and not (tools and tools.constraint())  # a reply held to tool calls is their JSON alone
    if free:  # gpt-oss's harmony, Gemma 4's channels: reasoning and calls read from the reply's tokens
        channels = token_format_stream(engine.tokenizer)
    if free and channels is None and template_thinks(engine.tokenizer.chat_template):
        prompt_tail = await anyio.to_thread.run_sync(engine.tokenizer.decode, token_ids[-8:])
        reasoning = ReasoningSplitter(in_reasoning=prompt_opens_reasoning(prompt_tail))
    parses_calls = tools and tools.mode != "none" and channels is None
    reply = Reply(
        model.name,
        chat,
        len(token_ids),
        params.logprobs,
        texts,
        echo,
        ToolCallStream(tools) if parses_calls else None,
        reasoning,
        channels,
    )
    return reply, stream


async def whole_text(
    request: Request, reply: Reply, stream: RequestStream, body: RequestBody, tools: ToolPlan | None
) -> str | None:
    """The reply's text, read to its end; None if the client went away meanwhile (the request is aborted)."""
    text = []
    try:
        async for out in stream:
            reply.count(out)
            text.append(out.new_text)
            if reply.chat:
                reply.take(out)
                if reply.stops_repeating(stream):
                    break
            if await request.is_disconnected():
                stream.cancel()
                return None
    except RequestFailed as e:
        raise failure(e, constraint_field(body, tools)) from None
    return "".join(text)


async def complete(
    request: Request,
    model: ServedModel,
    body: RequestBody,
    token_ids: list[int],
    max_tokens: int | None,
    default_max_tokens: int | None,
    chat: bool,
    echo: Echo | None = None,
    tools: ToolPlan | None = None,
    headers: dict[str, str] | None = None,
) -> object:
    """The request answered in OpenAI's shapes: a chat.completion or text_completion, or their chunks as
    server-sent events."""
    reply, stream = await start_reply(model, body, token_ids, max_tokens, default_max_tokens, chat, echo, tools)
    request_log.record(request, reply)
    if body.stream:
        return StreamingResponse(
            reply.sse(stream, body.include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
    text = await whole_text(request, reply, stream, body, tools)
    if text is None:
        return JSONResponse({}, status_code=499)
    return JSONResponse(reply.whole(text), headers=headers)


def constraint_field(body: RequestBody, tools: ToolPlan | None) -> str | None:
    """The field the request's constraint came in (for an error's `param`)."""
    fields = ["tools"] if tools and tools.constraint() else body.constraint_fields()
    return fields[0] if fields else None
