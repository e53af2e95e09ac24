"""Ollama's API as Pagoda takes it: /api/chat and /api/generate bodies, what they become on the request path every
API shares (an OpenAI body: entrypoints/openai/protocol.py, whose ollama_fields.py already knows Ollama's option
names), and the replies in Ollama's shape. Its errors are {"error": "..."}."""

import json
import math
import re
import time
from datetime import datetime, timezone
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from entrypoints.openai.body_reader import body_from
from entrypoints.openai.errors import APIError
from entrypoints.openai.protocol import ChatCompletionBody, CompletionBody
from entrypoints.openai.tool_calls import new_call

# The Ollama API version whose routes and fields these are: clients gate features (thinking, tools) on it
OLLAMA_API_VERSION = "0.14.0"
DONE_REASONS = {"length": "length", "tool_calls": "stop", "stop": "stop"}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[dict] | None = None
    tool_name: str | None = None
    thinking: str | None = None

    def openai(self, index: int) -> dict:
        if self.images:
            raise APIError(
                400, f"messages.{index}: images are not supported yet: Pagoda runs the language part of a model only"
            )
        calls = None
        if self.tool_calls:
            calls = []
            for j, call in enumerate(self.tool_calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
                    raise APIError(
                        400, f'messages.{index}.tool_calls.{j} must be {{"function": {{"name", "arguments"}}}}'
                    )
                arguments = function.get("arguments", {})
                calls.append(
                    new_call(function["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))
                )
        return {"role": self.role, "content": self.content, "tool_calls": calls, "name": self.tool_name}


class OllamaBody(BaseModel):
    model_config = ConfigDict(extra="allow")  # keep_alive and others: ollama_fields.py says what is ignored
    model: str = ""
    stream: bool = True  # Ollama's default
    format: str | dict | None = None
    options: dict | None = None
    think: bool | str | None = None
    keep_alive: str | int | float | None = None

    def check_supported(self) -> None:
        """What the OpenAI body checks (parse_body calls this)."""

    def common(self) -> dict:
        """The OpenAI body's fields: the options flattened (their Ollama names ollama_fields.py reads), format,
        think, keep_alive."""
        options = dict(self.options or {})
        fields = {"model": self.model or None, "stream": self.stream, **options}
        for name in ("format", "think", "keep_alive"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if "stop" in options and isinstance(options["stop"], list) and not options["stop"]:
            fields.pop("stop")
        return fields


class ChatBody(OllamaBody):
    messages: list[OllamaMessage] = Field(min_length=1)
    tools: list[dict] | None = None

    def openai(self) -> ChatCompletionBody:
        messages = [m.openai(i) for i, m in enumerate(self.messages)]
        return body_from(ChatCompletionBody, {**self.common(), "messages": messages, "tools": self.tools})


class GenerateBody(OllamaBody):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    images: list[str] | None = None
    template: str | None = None
    context: list[int] | None = None

    def openai(self) -> ChatCompletionBody | CompletionBody:
        """A chat of the system prompt and the prompt, through the model's template; `raw`: the prompt as is."""
        for name in ("suffix", "images", "template", "context"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported by /api/generate here; leave it out")
        if self.raw:
            return body_from(CompletionBody, {**self.common(), "prompt": self.prompt})
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": self.prompt})
        return body_from(ChatCompletionBody, {**self.common(), "messages": messages})


class EmbedBody(BaseModel):
    """/api/embed's body; /api/embeddings' older one sends one `prompt` instead of `input`."""

    model_config = ConfigDict(extra="allow")  # options and keep_alive change nothing in an embedding
    model: str = ""
    input: str | list[str] | None = None
    prompt: str | None = None
    truncate: bool = True  # Ollama's default: an input longer than the model reads is cut, not refused
    dimensions: int | None = Field(None, ge=1)

    def check_supported(self) -> None:
        """What the OpenAI body checks (parse_body calls this)."""

    def inputs(self) -> list[str]:
        given = self.input if self.input is not None else self.prompt
        if given is None:
            raise APIError(400, "send the text to embed as `input` (a string or a list of them)")
        return [given] if isinstance(given, str) else list(given)


GO_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: str | int | float) -> float:
    """Ollama's keep_alive in seconds: a number of seconds or a Go duration ("5m", "1h30m"); negative: forever."""
    text = str(value).strip()
    unsigned = text.removeprefix("-")
    parts = re.findall(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", unsigned)
    if re.fullmatch(r"\d+(?:\.\d+)?", unsigned):
        seconds = float(unsigned)
    elif parts and "".join(n + u for n, u in parts) == unsigned:
        seconds = sum(float(n) * GO_DURATION_UNITS[u] for n, u in parts)
    else:
        raise APIError(400, f'keep_alive must be a duration such as "5m" or a number of seconds, got {value!r}')
    return math.inf if text.startswith("-") and seconds > 0 else seconds


def counts(reply, started: float) -> dict:
    """Ollama's counters and durations (nanoseconds) of a finished reply."""
    total = int((time.perf_counter() - started) * 1e9)
    return {
        "done_reason": DONE_REASONS.get(reply.choice_finish_reason or "stop", "stop"),
        "total_duration": total,
        "load_duration": 0,
        "prompt_eval_count": reply.prompt_tokens,
        "prompt_eval_duration": 0,
        "eval_count": reply.completion_tokens,
        "eval_duration": total,
    }


def ollama_calls(calls: list[dict]) -> list[dict]:
    """OpenAI's tool calls as Ollama's: arguments as an object."""
    out = []
    for call in calls:
        try:
            arguments = json.loads(call["function"].get("arguments") or "{}")
        except json.JSONDecodeError:
            arguments = {}
        out.append({"function": {"name": call["function"]["name"], "arguments": arguments}})
    return out
