"""Tool calls in /v1/chat/completions: the tools into the prompt, the reply back into OpenAI's `tool_calls`.

`tool_choice` "auto" lets the model answer or call: its calls are parsed from the text, in the Hermes
form Qwen2.5 and Qwen3 are trained on (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`) or
Llama 3.1's bare JSON (`{"name": ..., "parameters": ...}`). "required" and a named tool go through
constrained decoding, as vLLM does: the reply is held to JSON of the calls' shape, so even a small model
returns a real tool and valid arguments. "none" keeps the tools out of the prompt.

A chat template that knows nothing of tools (the bundled SmolLM2's) gets them in a system message
instead, written in the Hermes form, so that "auto" can work there too.
"""

import json
import re
import uuid
from dataclasses import dataclass, field

from engine import StructuredOutputsParams
from entrypoints.openai.errors import APIError
from entrypoints.reasoning import partial_suffix

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1 starts a call with it
# The most calls a "required" reply may make at once. Unbounded, a small model went on calling the same tool
# until max_tokens (the bundled SmolLM2: 6 calls of `add` in 120 tokens, and no end in sight).
MAX_PARALLEL_CALLS = 8


@dataclass
class Tool:
    name: str
    parameters: dict  # a JSON schema of an object
    description: str | None = None
    strict: bool = False  # OpenAI's: the calls must follow the schema exactly

    def arguments_schema(self) -> dict:
        """What a constrained call's arguments are held to: an object (a schema that leaves out "type" would also
        take a bare number, and one such call ran to max_tokens), closed as closed_arguments says."""
        return closed_arguments({"type": "object", **self.parameters})

    def as_openai(self) -> dict:
        """The tool as chat templates take it (OpenAI's shape)."""
        function = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


def parse_tools(tools: list[dict]) -> list[Tool]:
    """The request's `tools`, checked: function tools with a name and an object schema for parameters
    (a tool without `parameters` takes none, as OpenAI defines it)."""
    parsed = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise APIError(400, f'{where}: each tool must be {{"type": "function", "function": {{...}}}}', param=where)
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise APIError(
                400,
                f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
                param=f"{where}.function.name",
            )
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise APIError(
                400,
                f"{where}.function.parameters must be a JSON schema of an object (the call's "
                f"arguments), got {json.dumps(parameters)[:80]}",
                param=f"{where}.function.parameters",
            )
        description = function.get("description")
        strict = function.get("strict") is True
        parsed.append(Tool(name, parameters, description if isinstance(description, str) else None, strict))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: two tools have the same name; give each its own", param="tools")
    return parsed


# A number argument without bounds is held to 15 digits before the point, and a decimal one to 6 after it (no
# exponent): unbounded, a small model wrote digits until max_tokens, and the call never ended
MAX_INTEGER = 10**15 - 1
NUMBER_STEP = 1e-6  # as `multipleOf`: llguidance reads it as a count of decimals
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


def closed_arguments(schema):
    """A tool's parameter schema as a constrained call is held to it: an object takes only the properties it
    declares unless it says otherwise (without this a model invented properties, and a tool without parameters
    got `{"type": "object", "properties": {}}` back as its arguments), and a number has at most 15 digits before
    its point and 6 after, unless the schema bounds it. The template still shows the tool's schema as sent."""
    if isinstance(schema, list):
        return [closed_arguments(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {
        key: closed_arguments(value) if key in ("items", "additionalProperties", *_SUBSCHEMA_LISTS) else value
        for key, value in schema.items()
    }
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            closed[key] = {name: closed_arguments(sub) for name, sub in schema[key].items()}
    is_object = schema.get("type") == "object" or "properties" in schema
    if is_object and not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & schema.keys():
        closed["additionalProperties"] = False
    if schema.get("type") in ("integer", "number"):
        if not {"minimum", "exclusiveMinimum"} & schema.keys():
            closed["minimum"] = -MAX_INTEGER
        if not {"maximum", "exclusiveMaximum"} & schema.keys():
            closed["maximum"] = MAX_INTEGER
    if schema.get("type") == "number" and "multipleOf" not in schema:
        closed["multipleOf"] = NUMBER_STEP
    return closed


@dataclass
class ToolPlan:
    """How one request treats tools: "none", "auto", "required" or "named" (then `name`)."""

    tools: list[Tool]
    mode: str
    name: str | None = None
    parallel: bool = True

    @property
    def loosens_strict_tools(self) -> bool:
        """tool_choice "auto" with tools marked strict: their calls are read from free text, not held to their
        schemas (which "required" and a named tool do, strict or not)."""
        return self.mode == "auto" and any(t.strict for t in self.tools)

    def template_tools(self) -> list[dict] | None:
        return None if self.mode == "none" or not self.tools else [t.as_openai() for t in self.tools]

    def constraint(self) -> StructuredOutputsParams | None:
        """The shape a "required" or named reply is held to; None for "auto" and "none"."""
        if self.mode == "named":
            return StructuredOutputsParams(json=next(t for t in self.tools if t.name == self.name).arguments_schema())
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "parameters": t.arguments_schema()},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        array = {
            "type": "array",
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
            "minItems": 1,
            "maxItems": MAX_PARALLEL_CALLS if self.parallel else 1,
        }
        return StructuredOutputsParams(json=array)


def plan_tools(tools: list[dict] | None, tool_choice, parallel_tool_calls: bool) -> ToolPlan | None:
    """The request's tools and tool_choice, checked; None when it has no tools."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise APIError(
                400,
                "tool_choice asks for a tool call, but the request has no tools; add them to `tools`",
                param="tool_choice",
            )
        return None
    parsed = parse_tools(tools)
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        return ToolPlan(parsed, tool_choice or "auto", parallel=parallel_tool_calls)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(function, dict) or tool_choice.get("type") != "function":
        raise APIError(
            400,
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    name = function.get("name")
    if name not in {t.name for t in parsed}:
        raise APIError(
            400,
            f"tool_choice names the tool {name!r}, which is not in `tools` ({', '.join(t.name for t in parsed)})",
            param="tool_choice",
        )
    return ToolPlan(parsed, "named", name, parallel_tool_calls)


# ---- the prompt ----------------------------------------------------------------------------------
def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def tools_system_text(tools: list[dict]) -> str:
    """The tools for a template that has no place for them, in the Hermes form the parser reads back."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to help with the user's request. The functions are:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call a function, reply with its name and arguments as JSON inside tags, one call per block:\n"
        f'{CALL_OPEN}\n{{"name": <function name>, "arguments": <arguments object>}}\n{CALL_CLOSE}'
    )


def prompt_messages(messages: list[dict], tools: list[dict] | None, knows_tools: bool) -> list[dict]:
    """The conversation as the chat template should see it. Assistant tool calls carry their arguments as
    objects (templates write them with `tojson`). A template without tool support gets the tools in the
    system message, the calls as Hermes text and the results as user turns in <tool_response> tags."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": arguments_object(c)}} for c in calls]
        if not knows_tools:
            if calls:
                text = "\n".join(hermes_call(c["function"]) for c in m.pop("tool_calls"))
                m["content"] = "\n".join(part for part in (m.get("content"), text) if part)
            if m["role"] == "tool":
                m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if tools and not knows_tools:
        text = tools_system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def hermes_call(function: dict) -> str:
    call = {"name": function["name"], "arguments": function["arguments"]}
    return f"{CALL_OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{CALL_CLOSE}"


def arguments_object(call: dict) -> dict | str:
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


# ---- the reply -----------------------------------------------------------------------------------
def new_call(name: str, arguments: str) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def call_from_json(text: str, tool_names: set[str]) -> dict | None:
    """One call from `{"name": ..., "arguments" (or "parameters"): {...}}`; None if the text is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in tool_names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return new_call(value["name"], json.dumps(arguments, ensure_ascii=False))


@dataclass
class ToolCallStream:
    """Turns a reply's text, increment by increment, into content and tool calls. `feed` and `finish`
    return the content to show and the calls' stream deltas (OpenAI's `delta.tool_calls` entries);
    `calls` holds every call, whole. A named tool's arguments stream as they are written; other calls
    come whole once their text is complete."""

    plan: ToolPlan
    calls: list[dict] = field(default_factory=list)
    buffer: str = ""
    started: bool = False  # a named call's first delta has gone out
    settled: bool = False  # auto: the reply is known not to be bare JSON
    # required: the reply has begun to repeat a call it made (a small model did so up to the cap), so its calls
    # are complete and the reply should stop
    repeating: bool = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        mode = self.plan.mode
        if mode == "named":
            if not self.started:
                self.started = True
                self.calls.append(new_call(self.plan.name, text))
                first = self.calls[0]
                return "", [
                    {
                        "index": 0,
                        "id": first["id"],
                        "type": "function",
                        "function": {"name": self.plan.name, "arguments": text},
                    }
                ]
            self.calls[0]["function"]["arguments"] += text
            return "", [{"index": 0, "function": {"arguments": text}}] if text else []
        self.buffer += text
        if mode == "required":
            if "}" in text:
                items = self._required_items(self.buffer)
                self.repeating = any(item in items[:i] for i, item in enumerate(items))
            return "", []
        return self._auto(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        mode = self.plan.mode
        if mode == "named":
            return self.feed("") if not self.started else ("", [])
        if mode == "required":
            return "", self._take(self._required_calls(self.buffer))
        return self._auto(final=True)

    @staticmethod
    def _required_items(text: str) -> list[dict]:
        """The complete items of the constrained array: of one cut short (by max_tokens, or by a repeat), those
        it completed."""
        decoder, items, at = json.JSONDecoder(), [], text.find("[") + 1
        while at > 0:
            while at < len(text) and text[at] in " ,\n\t\r":
                at += 1
            try:
                item, at = decoder.raw_decode(text, at)
            except ValueError:
                break
            items.append(item)
        return items

    def _required_calls(self, text: str) -> list[dict]:
        """The calls of the constrained array, each once: a repeated call ends the list."""
        calls = []
        for item in self._required_items(text):
            if item in calls:
                break
            calls.append(item)
        return [new_call(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in calls]

    def _take(self, calls: list[dict]) -> list[dict]:
        if not self.plan.parallel:
            calls = calls[: max(0, 1 - len(self.calls))]
        deltas = [{"index": len(self.calls) + i, **c} for i, c in enumerate(calls)]
        self.calls += calls
        return deltas

    def _auto(self, final: bool) -> tuple[str, list[dict]]:
        names = {t.name for t in self.plan.tools}
        if not self.settled:
            head = self.buffer.lstrip()
            if head.startswith(PYTHON_TAG) or head.startswith("{"):  # maybe Llama 3.1's bare JSON call
                if not final:
                    return "", []
                call = call_from_json(head.removeprefix(PYTHON_TAG).strip(), names)
                if call is not None:
                    self.buffer = ""
                    return "", self._take([call])
            elif len(head) < len(PYTHON_TAG) and PYTHON_TAG.startswith(head) and not final:
                return "", []
            self.settled = True
        content, deltas = [], []
        while True:
            start = self.buffer.find(CALL_OPEN)
            if start < 0:
                # held back while streaming: what may start a call, and the whitespace before it
                keep = 0
                if not final:
                    partial = partial_suffix(self.buffer, CALL_OPEN)
                    kept = self.buffer[: len(self.buffer) - partial]
                    keep = partial + len(kept) - len(kept.rstrip())
                content.append(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            end = self.buffer.find(CALL_CLOSE, start)
            if end < 0 and not final:
                text = self.buffer[:start].rstrip()
                content.append(text)
                self.buffer = self.buffer[len(text) :]
                break
            body = self.buffer[start + len(CALL_OPEN) : end if end >= 0 else None]
            call = call_from_json(body.strip(), names)
            if call is None:  # not a call after all: show it as it was written
                content.append(self.buffer[: end + len(CALL_CLOSE)] if end >= 0 else self.buffer)
            else:
                content.append(self.buffer[:start].rstrip())  # the whitespace that led up to the call
                deltas += self._take([call])
            self.buffer = self.buffer[end + len(CALL_CLOSE) :] if end >= 0 else ""
        text = "".join(content)
        if self.calls and not text.strip():
            text = ""
        return text, deltas
