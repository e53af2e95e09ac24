"""A streamed response as the Responses API's server-sent events: response.created and response.in_progress, then
each output item (reasoning, message, function call) as output_item.added, its deltas and dones, output_item.done,
then response.completed. The reply's increments come as the OpenAI chunks every API's
streams are read from (Reply.chunks); this turns each into the events it makes."""

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from engine import RequestFailed, RequestStream
from entrypoints.openai.reply import Reply, failure
from entrypoints.responses.protocol import call_item, dumps, message_item, new_id, reasoning_item


class OutputItems:
    """The response's output items so far, the open one's text, and the events that open and close them."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.open: str | None = None  # "reasoning", "message" or "function_call"
        self.text = ""  # the open item's text (or a call's arguments)
        self.sequence = 0

    def event(self, kind: str, **data) -> str:
        self.sequence += 1
        return f"event: {kind}\ndata: {dumps({'type': kind, 'sequence_number': self.sequence - 1, **data})}\n\n"

    @property
    def where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def start(self, kind: str, item: dict) -> list[str]:
        events = self.stop()
        self.items.append(item)
        self.open, self.text = kind, ""
        events.append(self.event("response.output_item.added", item=item, output_index=len(self.items) - 1))
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self.event("response.content_part.added", **self.where, content_index=0, part=part))
        return events

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        item, events = self.items[-1], []
        if self.open == "reasoning":
            item.update(reasoning_item(self.text, item["id"]))
            events.append(self.event("response.reasoning_text.done", **self.where, content_index=0, text=self.text))
        elif self.open == "message":
            item.update(message_item(self.text, item["id"]))
            events.append(
                self.event("response.output_text.done", **self.where, content_index=0, text=self.text, logprobs=[])
            )
            events.append(
                self.event("response.content_part.done", **self.where, content_index=0, part=item["content"][0])
            )
        else:
            item.update(arguments=self.text, status="completed")
            events.append(
                self.event(
                    "response.function_call_arguments.done", **self.where, arguments=self.text, name=item["name"]
                )
            )
        self.open = None
        return [*events, self.event("response.output_item.done", item=item, output_index=len(self.items) - 1)]

    def of(self, delta: dict) -> list[str]:
        """The events one OpenAI chunk's delta makes."""
        events = []
        if reasoning := delta.get("reasoning_content"):
            if self.open != "reasoning":
                events += self.start("reasoning", {"type": "reasoning", "id": new_id("rs"), "summary": []})
            self.text += reasoning
            events.append(self.event("response.reasoning_text.delta", **self.where, content_index=0, delta=reasoning))
        if text := delta.get("content"):
            if self.open != "message":
                events += self.start("message", message_item("", status="in_progress"))
            self.text += text
            events.append(
                self.event("response.output_text.delta", **self.where, content_index=0, delta=text, logprobs=[])
            )
        for call in delta.get("tool_calls") or []:
            if "id" in call:  # a call's first delta: an item of its own
                events += self.start("function_call", call_item(call, status="in_progress"))
            if arguments := call.get("function", {}).get("arguments"):
                self.text += arguments
                events.append(self.event("response.function_call_arguments.delta", **self.where, delta=arguments))
        return events


async def response_events(
    reply: Reply, stream: RequestStream, respond: Callable[[list[dict], str], dict]
) -> AsyncIterator[str]:
    """The events of one streamed response; `respond(output, status)` makes the Response object (and stores the
    finished one). A client that goes away closes this generator, which aborts the request."""
    items = OutputItems()
    started = respond([], "in_progress")
    yield items.event("response.created", response=started)
    yield items.event("response.in_progress", response=started)
    try:
        async with aclosing(reply.deltas(stream)) as deltas:
            async for delta in deltas:
                for text in items.of(delta):
                    yield text
    except RequestFailed as e:  # headers are sent: the error goes in the stream
        yield items.event("error", message=failure(e).message, code=None, param=None)
        return
    for text in items.stop():
        yield text
    # response.completed also when max_output_tokens cut it (its status says "incomplete"): the openai SDK's
    # stream helpers, and the Agents SDK on them, wait for that event alone
    yield items.event("response.completed", response=respond(items.items, "completed"))
