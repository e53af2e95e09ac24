"""A reply in OpenAI's shape: the engine's increments become a whole response or server-sent events, with the
usage counted, tool calls and reasoning split out, and a failure mid-reply turned into the error a client reads."""

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from engine import ConstraintFailed, RequestFailed, RequestStream
from entrypoints.openai.errors import APIError
from entrypoints.openai.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    CompletionChoice,
    CompletionResponse,
    CompletionTokensDetails,
    Delta,
    PromptTokensDetails,
    Usage,
)
from entrypoints.openai.tool_calls import ToolCallStream
from entrypoints.reasoning import ReasoningSplitter
from entrypoints.token_formats import TokenFormatStream


@dataclass
class Echo:
    """A completion's prompt, to put before its text (`echo`)."""

    text: str | None  # None: to be decoded from token_ids
    token_ids: list[int]
    only: bool  # max_tokens=0: the prompt and nothing generated


class ServerStopping(RequestFailed):
    """The server is shutting down, and the request's grace period ran out before its reply ended."""

    def __init__(self) -> None:
        super().__init__(
            "the server is shutting down, and this reply was cut short; send the request again once it is back"
        )


def failure(error: RequestFailed, param: str | None = None) -> APIError:
    """A request that failed mid-reply: its constraint could not be followed (the request's doing: a 400), the
    server is stopping (a 503), or the engine failed its step (a 500: send it again)."""
    if isinstance(error, ConstraintFailed):
        return APIError(400, str(error), param=param)
    if isinstance(error, ServerStopping):
        return APIError(503, str(error), type="server_error", code="server_shutting_down")
    return APIError(500, str(error), type="server_error")


class Reply:
    """Shapes engine increments into OpenAI's response objects and counts usage.

    `logprobs`: SamplingParams.logprobs (None: not asked), with `texts` to name the tokens; `echo`: a
    completion's prompt, which comes first in its text (and its logprobs, when asked)."""

    def __init__(
        self,
        model_name: str,
        chat: bool,
        num_prompt_tokens: int,
        logprobs: int | None = None,
        texts: TokenTexts | None = None,
        echo: Echo | None = None,
        tools: ToolCallStream | None = None,
        reasoning: ReasoningSplitter | None = None,
        channels: TokenFormatStream | None = None,
    ):
        self.model_name, self.chat = model_name, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.prompt_tokens, self.completion_tokens, self.cached_tokens = num_prompt_tokens, 0, 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the stop string or stop token id that ended it
        self.logprobs, self.texts, self.echo = logprobs, texts, echo
        self.token_ids: list[int] = []  # the reply's tokens, and their logprobs entries when asked
        self.entries: list[dict[int, float]] = []
        self.prompt_entries: list[dict[int, float] | None] | None = None
        self.text_sent = 0  # characters of a streamed completion's text sent so far (its tokens' text_offset)
        self.tools = tools  # parses tool calls out of the text, when the request has tools
        self.reasoning = reasoning  # splits a thinking model's reasoning from its answer
        self.channels = channels  # gpt-oss, Gemma 4: reasoning, answer and tool calls read from the reply's tokens
        self.reasoning_tokens = 0
        self.content: list[str] = []  # a chat reply's content, as `take` has split it

    def take(self, out, final: bool = False) -> tuple[str, str, list[dict]]:
        """A chat increment's text as (reasoning, content, tool-call deltas); `final`: after the last
        increment, what was held back. The content is kept for `whole`."""
        if self.channels is not None:
            reasoning, text, calls = self.channels.finish() if final else self.channels.feed(out.new_token_ids)
            if reasoning and not text and out is not None:
                self.reasoning_tokens += len(out.new_token_ids)
            self.content.append(text)
            return reasoning, text, calls
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

    def stops_repeating(self, stream: RequestStream) -> bool:
        """Stop a reply held to tool calls that has begun to repeat one (its calls are complete): True if so."""
        if self.tools is None or not self.tools.repeating:
            return False
        stream.cancel()
        self.finish_reason = "stop"
        return True

    @property
    def choice_finish_reason(self) -> str | None:
        """OpenAI's: "tool_calls" when a reply that ended by itself called tools, or when max_tokens cut a
        reply held to calls (tool_choice "required") after its complete ones (the cut one is left out)."""
        if self.calls:
            required = self.tools is not None and self.tools.plan.mode == "required"
            if self.finish_reason == "stop" or (self.finish_reason == "length" and required):
                return "tool_calls"
        return self.finish_reason

    @property
    def calls(self) -> list[dict]:
        """The reply's tool calls so far, whole."""
        parser = self.tools if self.tools is not None else self.channels
        return parser.calls if parser is not None else []

    @property
    def reasoning_text(self) -> str:
        parser = self.reasoning if self.reasoning is not None else self.channels
        return parser.reasoning if parser is not None else ""

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
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason

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

    def usage(self) -> Usage:
        usage = Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )
        if self.reasoning is not None or self.channels is not None:
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=self.reasoning_tokens)
        return usage

    def response(self, choices: list, usage: Usage | None = None, chunk: bool = False) -> CompletionResponse:
        response = CompletionResponse(
            id=self.id,
            object=f"{self.object}.chunk" if chunk and self.chat else self.object,
            created=self.created,
            model=self.model_name,
            choices=choices,
        )
        if usage is not None:
            response.usage = usage
        return response

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
            message = AssistantMessage(content=content or None if self.calls else content)
            if self.reasoning_text:
                message.reasoning_content = self.reasoning_text
            if self.calls:
                message.tool_calls = self.calls
            choice = ChatChoice(message=message, logprobs=logprobs, finish_reason=self.choice_finish_reason)
        else:
            choice = CompletionChoice(text=text, logprobs=logprobs, finish_reason=self.finish_reason)
        if self.stop_reason is not None:
            choice.stop_reason = self.stop_reason
        return self.response([choice], self.usage()).json_body()

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        role: bool = False,
        logprobs: dict | None = None,
        tool_calls: list[dict] | None = None,
        reasoning: str = "",
        stop_reason: str | int | None = None,
    ) -> dict:
        if self.chat:
            delta = Delta()
            if role:
                delta.role = "assistant"
            if text is not None:
                delta.content = text
            if reasoning:
                delta.reasoning_content = reasoning
            if tool_calls:
                delta.tool_calls = tool_calls
            choice = ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        else:
            choice = CompletionChoice(text=text or "", logprobs=logprobs, finish_reason=finish_reason)
        if stop_reason is not None:
            choice.stop_reason = stop_reason
        return self.response([choice], chunk=True).json_body()

    async def sse(self, stream: RequestStream, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events. A client that goes away closes this generator, which aborts the request."""

        def event(obj: dict) -> str:
            if include_usage:
                obj.setdefault("usage", None)
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        if self.chat:
            yield event(self.chunk("", role=True))
        try:
            async with aclosing(self.chunks(stream)) as chunks:  # closed with this generator: aborts the request
                async for chunk in chunks:
                    yield event(chunk)
        except RequestFailed as e:  # headers are sent: the error goes in the stream, as OpenAI's does
            yield f"data: {json.dumps(failure(e).body())}\n\n"
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            yield event(self.response([], self.usage(), chunk=True).json_body())
        yield "data: [DONE]\n\n"

    async def deltas(self, stream: RequestStream) -> AsyncIterator[dict]:
        """Each chunk's delta (a completion's as {"content": its text}), for the APIs that shape a stream of their
        own; the finish reason is `choice_finish_reason` and `stop_reason` once it ends. Closing this aborts the
        request."""
        async with aclosing(self.chunks(stream)) as chunks:
            async for chunk in chunks:
                for choice in chunk["choices"]:
                    yield choice.get("delta") or {"content": choice.get("text", "")}

    async def chunks(self, stream: RequestStream) -> AsyncIterator[dict]:
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
            if self.chat and self.stops_repeating(stream):
                break
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
        yield self.chunk(None if self.chat else "", self.choice_finish_reason, stop_reason=self.stop_reason)
