"""The chat's MCP tools as the model sees them: their names, the prompt that offers them, the constraint that holds
a call to its tool's schema, the calls read back out of the reply, and the rounds of a reply as the model reads them
again (each call followed by its result).

A chat picks its tools by key, "server/tool". The model calls a tool by its own name, or by "server_tool" when two of
the chat's servers have a tool of that name.

Calls are written in the Hermes form (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), which Qwen2.5/3
are trained on and which Pagoda describes in the system prompt for a template that has no tools (the bundled
SmolLM2's). A grammar holds the reply to it: free text that never opens a call, or text and then one call whose JSON
follows the tool's schema. The call is constrained only from `<tool_call>` on, so a model answers as freely as
without tools, and even a 135M model's call names a real tool with valid arguments.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from app.store_records import Message
from engine import StructuredOutputsParams
from entrypoints.openai.tool_calls import CALL_OPEN, Tool

# JSON as json.dumps writes it (engine/sample/structured_output.py's JSON_OPTIONS): free whitespace let a small model
# write newlines until max_tokens
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Free text that never opens a call, in llguidance's Lark (`&` and `~`: and, not)
_ANSWER = r"/(?s:.+)/ & ~/(?s:.*)<tool_call>(?s:.*)/"


def tool_key(server: str, tool: str) -> str:
    return f"{server}/{tool}"


@dataclass(frozen=True)
class ChatTool:
    server: str
    tool: str  # its name on the server
    name: str  # the name the model calls it by
    description: str
    schema: dict  # its arguments' JSON schema (an object)

    @property
    def key(self) -> str:
        return tool_key(self.server, self.tool)

    def as_tool(self) -> Tool:
        return Tool(self.name, self.schema, self.description or None)


def chat_tools(listed: Iterable, enabled: Iterable[str]) -> list[ChatTool]:
    """The tools the chat has on, from the servers' lists (app/mcp_servers.py's ToolInfo), each with the name the
    model calls it by."""
    wanted = set(enabled)
    picked = [t for t in listed if tool_key(t.server, t.name) in wanted]
    clashes = Counter(t.name for t in picked)
    tools, taken = [], set()
    for t in picked:
        name = re.sub(r"[^A-Za-z0-9_-]", "_", t.name if clashes[t.name] == 1 else f"{t.server}_{t.name}")[:64]
        unique, n = name, 1
        while unique in taken:  # "a.b" and "a_b" spell one name: the second gets a number
            n += 1
            unique = f"{name[: 64 - len(str(n)) - 1]}_{n}"
        taken.add(unique)
        schema = t.input_schema if t.input_schema.get("type", "object") == "object" else {"type": "object"}
        tools.append(ChatTool(t.server, t.name, unique, t.description, schema))
    return tools


@dataclass(frozen=True)
class ToolPrompt:
    """The tools one round of a reply is offered, and what it may do with them: "auto" (answer, or call tools
    first), "first" (call a tool before answering) or "answer" (no more calls: the rounds' limit is reached)."""

    tools: tuple[ChatTool, ...]
    mode: str = "auto"

    def specs(self) -> list[dict]:
        """The tools in OpenAI's shape, as chat templates take them."""
        return [t.as_tool().as_openai() for t in self.tools]

    def named(self, name: str) -> ChatTool | None:
        return next((t for t in self.tools if t.name == name), None)

    def constraint(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(grammar=call_grammar(self.tools, self.mode))


def call_grammar(tools: Iterable[ChatTool], mode: str) -> str:
    """The reply's shape as an llguidance Lark grammar: an answer that never opens a call, or (text then) calls."""
    if mode == "answer":
        return f"start: ANSWER\nANSWER: {_ANSWER}\n"
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.as_tool().arguments_schema()},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {"x-guidance": _JSON_STYLE, **(calls[0] if len(calls) == 1 else {"anyOf": calls})}
    # One call a round: a small model held to "calls" repeated its call until max_tokens. The model reads the
    # result and may call again in the next round.
    start = 'start: "<tool_call>" call' if mode == "first" else "start: ANSWER | lead call"
    return (
        f"{start}\n"
        f"ANSWER: {_ANSWER}\n"
        f'lead[stop="{CALL_OPEN}"]: /(?s:.*)/\n'
        'call: "\\n" arguments "\\n</tool_call>"\n'
        f"arguments: %json {json.dumps(schema)}\n"
    )


# What the model reads for a call that gave no result
_NO_RESULT = {
    "denied": "The user did not allow this call.",
    "stopped": "The user stopped this call.",
    "asking": "This call did not run.",
    "running": "This call did not finish.",
}


def result_for_model(call: dict) -> str:
    """A call's outcome as the model reads it: the tool's result, its error, or why it did not run."""
    status = call.get("status")
    if status == "done":
        return call.get("result", "")
    if status == "error":
        return f"Error: {call.get('result', '')}"
    return _NO_RESULT.get(status, _NO_RESULT["asking"])


def chat_turns(messages: Iterable[Message]) -> list[dict]:
    """Stored messages as a chat's turns: a reply that called tools is its text with the calls (OpenAI's shape),
    then one "tool" turn per call with its outcome."""
    turns = []
    for m in messages:
        calls = m.meta.get("tool_calls") if m.role == "assistant" else None
        if not calls:
            turns.append({"role": m.role, "content": m.content})
            continue
        turns.append(
            {
                "role": "assistant",
                "content": m.content,
                "tool_calls": [
                    {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for c in calls
                ],
            }
        )
        turns += [{"role": "tool", "tool_call_id": c["id"], "content": result_for_model(c)} for c in calls]
    return turns
