"""A streamed reply as Anthropic's server-sent events: message_start, a ping, then each content block (thinking,
text, tool_use) as content_block_start, its deltas and content_block_stop, then message_delta (the stop reason and
usage) and message_stop. The reply's increments come as the OpenAI chunks every API's streams are read from
(Reply.chunks); this turns each into the events it makes."""

import json
from collections.abc import AsyncIterator
from contextlib import aclosing

from engine import RequestFailed, RequestStream
from entrypoints.anthropic.errors import ERROR_TYPES
from entrypoints.anthropic.protocol import message_id, stop_reason, tool_use_block
from entrypoints.openai.reply import Reply, failure


def event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class Blocks:
    """The content blocks of the message so far: which one is open, and the events that open and close them."""

    def __init__(self) -> None:
        self.index, self.open = -1, None  # the open block's index and kind ("thinking", "text", "tool_use")

    def start(self, kind: str, block: dict) -> list[str]:
        events = self.stop()
        self.index, self.open = self.index + 1, kind
        return events + [event("content_block_start", {"index": self.index, "content_block": block})]

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def delta(self, delta: dict) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def of(self, chunk_delta: dict) -> list[str]:
        """The events one OpenAI chunk's delta makes."""
        events = []
        if reasoning := chunk_delta.get("reasoning_content"):
            if self.open != "thinking":
                events += self.start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self.delta({"type": "thinking_delta", "thinking": reasoning}))
        if text := chunk_delta.get("content"):
            if self.open != "text":
                events += self.start("text", {"type": "text", "text": ""})
            events.append(self.delta({"type": "text_delta", "text": text}))
        for call in chunk_delta.get("tool_calls") or []:
            if "id" in call:  # a call's first delta: a block of its own
                events += self.start("tool_use", tool_use_block(call, whole=False))
            if arguments := call.get("function", {}).get("arguments"):
                events.append(self.delta({"type": "input_json_delta", "partial_json": arguments}))
        return events


async def message_events(
    reply: Reply, stream: RequestStream, stop_sequences: list[str] | None, model: str
) -> AsyncIterator[str]:
    """The events of one streamed message. A client that goes away closes this generator, which aborts the
    request."""
    usage = {"input_tokens": reply.prompt_tokens, "output_tokens": 0}
    start = {"id": message_id(), "type": "message", "role": "assistant", "model": model, "content": []}
    yield event("message_start", {"message": {**start, "stop_reason": None, "stop_sequence": None, "usage": usage}})
    yield event("ping", {})
    blocks = Blocks()
    try:
        async with aclosing(reply.deltas(stream)) as deltas:
            async for delta in deltas:
                for text in blocks.of(delta):
                    yield text
    except RequestFailed as e:  # headers are sent: the error goes in the stream, as Anthropic's does
        error = failure(e)
        yield event("error", {"error": {"type": ERROR_TYPES.get(error.status, "api_error"), "message": error.message}})
        return
    for text in blocks.stop():
        yield text
    reason, sequence = stop_reason(reply.choice_finish_reason, reply.stop_reason, stop_sequences)
    final = {
        "input_tokens": reply.prompt_tokens - reply.cached_tokens,
        "cache_read_input_tokens": reply.cached_tokens,
        "output_tokens": reply.completion_tokens,
    }
    yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": final})
    yield event("message_stop", {})
