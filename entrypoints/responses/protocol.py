"""OpenAI's Responses API as Pagoda takes it: the request body, what it becomes on the request path every API shares
(an OpenAI chat body), and the Response object and its output items. OpenAI's hosted tools (web search, file
search, ...) are left out, as Codex CLI sends them beside its functions (the X-Pagoda-Ignored header says so);
naming one in tool_choice, images and background runs are refused."""

import json
import time
import uuid

from pydantic import BaseModel, ConfigDict, Field

from entrypoints.documents import DocumentError, file_part_block
from entrypoints.openai.body_reader import body_from
from entrypoints.openai.errors import APIError
from entrypoints.openai.protocol import IMAGE_PARTS, ChatCompletionBody

TEXT_PARTS = ("input_text", "output_text", "text")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="allow")  # metadata, user, truncation, include, ...: they change nothing here
    model: str | None = None
    input: str | list[dict] = ""
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stream: bool = False
    reasoning: dict | None = None  # {"effort": "none" ... "high", "summary": ...}
    text: dict | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", "name", "schema"}}
    previous_response_id: str | None = None
    store: bool = True

    def check_supported(self) -> None:
        if (self.model_extra or {}).get("background"):
            raise APIError(400, "background responses are not supported: send the request and wait", param="background")

    def chat_body(self, history: list[dict]) -> ChatCompletionBody:
        """The request on the path every API shares, after `history` (the earlier turns of previous_response_id)."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + history
        messages += input_messages(self.input)
        functions, hosted = chat_tools(self.tools or [])
        fields = dict(
            model=self.model,
            messages=messages,
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stream=self.stream,
            tools=functions or None,
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=response_format((self.text or {}).get("format")),
        )
        if self.tool_choice is not None:
            choice = self.tool_choice
            if isinstance(choice, dict) and choice.get("type") == "function":
                choice = {"type": "function", "function": {"name": choice.get("name")}}
            elif isinstance(choice, dict):
                raise APIError(
                    400,
                    f"tool_choice {choice.get('type')!r}: Pagoda runs none of OpenAI's hosted tools",
                    param="tool_choice",
                )
            fields["tool_choice"] = choice
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:
            fields["reasoning_effort"] = "high" if effort == "xhigh" else effort
        body = body_from(ChatCompletionBody, fields)
        if hosted:
            body.ignored.append(
                f"tools: {', '.join(hosted)}: OpenAI's hosted tools, which Pagoda does not run; left out"
            )
        return body


def input_messages(given: str | list[dict]) -> list[dict]:
    """Responses' input items as chat messages: messages, function calls (an assistant's tool_calls) and their
    outputs (tool messages); reasoning items are not fed back."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    out = []
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"input.{i}.role must be user, system, developer or assistant", param=f"input.{i}")
            out.append({"role": role, "content": text_of(item.get("content", ""), f"input.{i}")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}
            if out and out[-1]["role"] == "assistant" and not out[-1]["content"]:  # parallel calls: one message
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            text = output if isinstance(output, str) else text_of(output, f"input.{i}.output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind != "reasoning":
            raise APIError(400, f"input.{i}: items of type {kind!r} are not supported", param=f"input.{i}")
    return out


def text_of(content: str | list, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_PARTS:
            raise APIError(
                400, f"{where}: {kind} is not supported yet: Pagoda runs the language part of a model only", param=where
            )
        if kind == "input_file":  # a document: its text, as a block where the part is
            try:
                parts.append(file_part_block(part.get("filename"), part.get("file_data"), part.get("file_id")))
            except DocumentError as e:
                raise APIError(400, f"{where}: {e}", param=where) from None
            continue
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}: content parts of type {kind!r} are not supported", param=where)
        parts.append(part["text"])
    return "".join(parts)


def chat_tools(tools: list[dict]) -> tuple[list[dict], list[str]]:
    """Function tools as chat tools (a namespace's functions too, as Codex CLI groups some); and the kinds of the
    others, OpenAI's hosted tools (web search, file search, ...), which Pagoda does not run and leaves out."""
    functions, hosted = [], []
    for index, tool in enumerate(tools):
        kind = tool.get("type")
        if kind == "namespace" and isinstance(tool.get("tools"), list):
            more, others = chat_tools(tool["tools"])
            functions, hosted = functions + more, hosted + others
        elif kind != "function":
            hosted.append(str(kind))
        elif not isinstance(tool.get("name"), str):
            raise APIError(
                400, f'tools.{index} must be {{"type": "function", "name", "parameters"}}', param=f"tools.{index}"
            )
        else:
            function = {
                "name": tool["name"],
                "parameters": tool.get("parameters") or {"type": "object", "properties": {}},
            }
            if tool.get("description"):
                function["description"] = tool["description"]
            functions.append({"type": "function", "function": function})
    return functions, hosted


def response_format(given: dict | None) -> dict | None:
    if given is None or given.get("type") == "text":
        return None
    if given.get("type") == "json_schema":
        return {
            "type": "json_schema",
            "json_schema": {"name": given.get("name", "output"), "schema": given.get("schema")},
        }
    return {"type": given.get("type")}  # json_object, or refused as response_format is


def output_items(said: dict) -> list[dict]:
    """A chat reply's message (Reply.whole's) as Responses' output items: reasoning, message, function calls."""
    items = []
    if said.get("reasoning_content"):
        items.append(reasoning_item(said["reasoning_content"]))
    if said.get("content"):
        items.append(message_item(said["content"]))
    items += [call_item(call) for call in said.get("tool_calls") or []]
    return items


def reasoning_item(text: str, item_id: str | None = None) -> dict:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [], "content": content}


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    content = [part] if status == "completed" else []
    return {
        "type": "message",
        "id": item_id or new_id("msg"),
        "status": status,
        "role": "assistant",
        "content": content,
    }


def call_item(call: dict, item_id: str | None = None, status: str = "completed") -> dict:
    function = call["function"]
    return {
        "type": "function_call",
        "id": item_id or new_id("fc"),
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function.get("arguments") or "" if status == "completed" else "",
        "status": status,
    }


def history_of(items: list[dict]) -> list[dict]:
    """Output items as the chat messages they were (for the next turn of previous_response_id)."""
    return input_messages([item for item in items if item["type"] != "reasoning"])


def response_object(
    body: ResponsesBody, response_id: str, model: str, output: list[dict], reply, status: str = "completed"
) -> dict:
    """The Response; `reply` (the Reply) gives its usage and whether it was cut short (None: just created)."""
    incomplete = None
    if reply is not None and status == "completed" and reply.finish_reason == "length":
        status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    usage = None
    if reply is not None and status != "in_progress":
        usage = {
            "input_tokens": reply.prompt_tokens,
            "input_tokens_details": {"cached_tokens": reply.cached_tokens},
            "output_tokens": reply.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reply.reasoning_tokens},
            "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        }
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": output,
        "incomplete_details": incomplete,
        "error": None,
        "instructions": body.instructions,
        "tools": body.tools or [],
        "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning,
        "text": body.text or {"format": {"type": "text"}},
        "store": body.store,
        "metadata": (body.model_extra or {}).get("metadata") or {},
        "usage": usage,
    }


def dumps(data: dict) -> str:
    return json.dumps(data, ensure_ascii=False)
