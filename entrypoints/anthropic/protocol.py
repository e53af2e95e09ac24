"""Anthropic's Messages API as Pagoda takes it: the request body, what it becomes on the one request path every
API shares (an OpenAI chat body: entrypoints/openai/protocol.py), the reply in Anthropic's message shape, and its
error shape. Blocks Pagoda cannot honour (images, documents, Anthropic's server tools) are refused by name."""

import json
import uuid
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from entrypoints.anthropic.errors import error_body
from entrypoints.openai.body_reader import body_from
from entrypoints.openai.errors import APIError
from entrypoints.openai.protocol import ChatCompletionBody

STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message), status_code=e.status, headers=e.headers)


class AnthropicMessage(BaseModel):
    role: Literal["user", "assistant", "system"]  # Claude Code sends system messages between the turns too
    content: str | list[dict]


class MessagesBody(BaseModel):
    model_config = ConfigDict(extra="allow")  # metadata, service_tier, ...: they change nothing here
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict] | None = None
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: dict | None = None  # {"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}
    thinking: dict | None = None  # {"type": "enabled", "budget_tokens": n} | {"type": "disabled"}
    output_config: dict | None = None  # {"effort": "low" ... "max", "format": {"type": "json_schema", "schema"}}

    def check_supported(self) -> None:
        """Nothing to check beyond the blocks, which `chat_body` reads (parse_body calls this)."""

    def chat_body(self) -> ChatCompletionBody:
        """The same request on the path every API shares: an OpenAI chat body."""
        fields = dict(
            model=self.model,
            messages=[*system_messages(self.system), *chat_messages(self.messages)],
            max_tokens=self.max_tokens,
            stop=self.stop_sequences or None,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stream=self.stream,
            tools=[function_tool(t, i) for i, t in enumerate(self.tools or [])] or None,
            # vLLM's constraint on the reply, as /v1/chat/completions takes it: a Pagoda extension here
            structured_outputs=(self.model_extra or {}).get("structured_outputs"),
        )
        choice = self.tool_choice or {}
        kind = choice.get("type", "auto")
        if kind == "tool" and not isinstance(choice.get("name"), str):
            raise APIError(400, 'tool_choice of type "tool" needs the tool\'s "name"', param="tool_choice")
        if kind not in ("auto", "any", "tool", "none"):
            raise APIError(400, f'tool_choice.type must be "auto", "any", "tool" or "none", got {kind!r}')
        if fields["tools"]:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or {
                "type": "function",
                "function": {"name": choice["name"]},
            }
            fields["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use", False)
        body = body_from(ChatCompletionBody, fields)
        self.read_output_config(body)
        if self.thinking is not None:
            kind = self.thinking.get("type")
            if kind not in ("enabled", "disabled", "adaptive"):
                raise APIError(400, f'thinking.type must be "enabled" or "disabled", got {kind!r}', param="thinking")
            body.reasoning_effort = "none" if kind == "disabled" else "medium"
            if "budget_tokens" in self.thinking:
                body.ignored.append("thinking.budget_tokens: the model thinks until it is done; max_tokens bounds it")
        return body

    def read_output_config(self, body: ChatCompletionBody) -> None:
        config = self.output_config or {}
        if (effort := config.get("effort")) is not None:
            if effort not in ("low", "medium", "high", "xhigh", "max"):
                raise APIError(400, f"output_config.effort must be low to max, got {effort!r}", param="output_config")
            body.reasoning_effort = "high" if effort in ("xhigh", "max") else effort
        if (output := config.get("format")) is not None:
            if not (
                isinstance(output, dict)
                and output.get("type") == "json_schema"
                and isinstance(output.get("schema"), dict)
            ):
                raise APIError(
                    400, 'output_config.format must be {"type": "json_schema", "schema": {...}}', param="output_config"
                )
            body.response_format = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": output["schema"]},
            }


def system_messages(system: str | list[dict] | None) -> list[dict]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "".join(text_of(b, "system") for b in system)
    return [{"role": "system", "content": text}]


def text_of(block: dict, where: str) -> str:
    """A text block's text; any other block is refused by its type."""
    kind = block.get("type")
    if kind == "text" and isinstance(block.get("text"), str):
        return block["text"]
    if kind in ("image", "document"):
        raise APIError(
            400,
            f"{where}: {kind} blocks are not supported yet: Pagoda runs the language part of a model only; send text",
            param=where,
        )
    raise APIError(400, f"{where}: a block of type {kind!r} is not supported here", param=where)


def chat_messages(messages: list[AnthropicMessage]) -> list[dict]:
    """Anthropic's messages as OpenAI's: an assistant's tool_use blocks become its tool_calls, a user's
    tool_result blocks become tool messages (before the rest of that user message), thinking is not fed back."""
    out = []
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        texts, calls, results = [], [], []
        for j, block in enumerate(message.content):
            kind = block.get("type")
            if kind in ("thinking", "redacted_thinking") and message.role == "assistant":
                continue  # as the models' templates intend: earlier turns' thinking is not in the prompt
            if kind == "tool_use" and message.role == "assistant":
                arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
                function = {"name": block.get("name"), "arguments": arguments}
                calls.append({"id": block.get("id"), "type": "function", "function": function})
            elif kind == "tool_result" and message.role == "user":
                results.append(tool_result(block, f"{where}.content.{j}"))
            else:
                texts.append(text_of(block, f"{where}.content.{j}"))
        out += results
        if texts or calls or not results:
            out.append({"role": message.role, "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
    return out


def tool_result(block: dict, where: str) -> dict:
    content = block.get("content", "")
    text = content if isinstance(content, str) else "".join(text_of(b, where) for b in content)
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text}


def function_tool(tool: dict, index: int) -> dict:
    """A client tool ({"name", "description", "input_schema"}) as an OpenAI function tool; Anthropic's own server
    tools (web search, code execution, ...) are refused: Pagoda runs none of them."""
    kind = tool.get("type", "custom")
    if kind != "custom":
        raise APIError(
            400,
            f"tools.{index}: {kind!r} is one of Anthropic's server tools, which Pagoda does not run; "
            'send client tools ({"name", "description", "input_schema"})',
            param=f"tools.{index}",
        )
    if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema", {}), dict):
        raise APIError(400, f'tools.{index} must be {{"name": ..., "input_schema": {{...}}}}', param=f"tools.{index}")
    function = {"name": tool["name"], "parameters": tool.get("input_schema", {"type": "object"})}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def stop_reason(finish_reason: str | None, stopped_on: str | int | None, stop_sequences: list[str] | None) -> tuple:
    """(stop_reason, stop_sequence) in Anthropic's terms."""
    if finish_reason == "stop" and isinstance(stopped_on, str) and stopped_on in (stop_sequences or []):
        return "stop_sequence", stopped_on
    return STOP_REASONS.get(finish_reason or "stop", "end_turn"), None


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def message(reply: dict, model: str, stop_sequences: list[str] | None, cached_tokens: int) -> dict:
    """A whole OpenAI chat.completion (Reply.whole) as Anthropic's message."""
    choice = reply["choices"][0]
    said = choice["message"]
    content = []
    if said.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": said["reasoning_content"], "signature": ""})
    if said.get("content"):
        content.append({"type": "text", "text": said["content"]})
    content += [tool_use_block(call) for call in said.get("tool_calls") or []]
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), stop_sequences)
    usage = reply["usage"]
    return {
        "id": message_id(),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {
            "input_tokens": usage["prompt_tokens"] - cached_tokens,
            "cache_read_input_tokens": cached_tokens,
            "output_tokens": usage["completion_tokens"],
        },
    }


def tool_use_block(call: dict, whole: bool = True) -> dict:
    """An OpenAI tool call as a tool_use block: its input parsed (whole), or empty (a stream's start)."""
    arguments = call["function"].get("arguments") or "{}"
    try:
        parsed = json.loads(arguments) if whole else {}
    except json.JSONDecodeError:
        parsed = {}
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": parsed}
