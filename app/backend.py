"""What answers the chats: the Backend protocol, its one kind of reply increment, and the local
implementation over the embedded engine (the remote one, over an OpenAI-compatible server, is in
app/remote.py).

The page and the chat flow talk to a Backend only: they never ask which kind it is. A local
backend turns a chat into token ids through the engine's one chat encoder (so chats and /v1 calls
with the same system prompt share KV blocks); a remote server applies its own template.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from app.chat_settings import ChatSettings, as_chat_settings
from app.chat_tools import ToolPrompt, chat_turns
from app.visualizer import render_kv_cache
from engine import EngineThread, RequestStream, SamplingParams, StructuredOutputsParams
from entrypoints.gemma4_format import template_speaks_gemma4
from entrypoints.openai.tool_calls import CALL_OPEN, prompt_messages, template_knows_tools
from entrypoints.reasoning import ReasoningSplitter, prompt_opens_reasoning, template_thinks
from entrypoints.token_formats import TokenFormatStream, template_speaks_tokens, token_format_stream

if TYPE_CHECKING:
    from app.store_records import Message

COUNTS_KEPT = 256  # prompt token counts a local backend keeps (prompt_tokens)
MIN_REPLY_ROOM = 64  # tokens of room a chat needs for its reply before it is refused as too long


@dataclass
class ReplyDelta:
    """One increment of a reply, from either backend."""

    text: str
    num_tokens: int  # tokens this increment brings (a remote server: one per streamed chunk, about right)
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort", on the last increment
    cached_tokens: int | None = None  # prompt tokens the prefix cache served, once known
    prompt_tokens: int | None = None  # the server's own count, on a remote reply's last increment
    completion_tokens: int | None = None  # likewise
    reasoning: str = ""  # a thinking model's reasoning this increment brings (the answer is in `text`)
    # Speculative decoding, on the last increment: (steps that checked drafts, drafted, accepted); None: it did not
    speculation: tuple[int, int, int] | None = None


class ReplyStream(Protocol):
    """The increments of one reply. Iterate it; stop early or call cancel() to abort it."""

    request_id: str

    def __iter__(self) -> Iterator[ReplyDelta]: ...

    def cancel(self) -> None: ...

    def prefill_progress(self) -> tuple[int, int] | None:
        """(prompt tokens read, prompt tokens) before the first token; None when unknown (a server) or past."""


class Backend(Protocol):
    kind: str  # "local" or "remote": for status reports only, never for branching
    label: str  # what the header and status lines call it
    model: str  # the served model's name
    models: list[str]  # every model it could serve (a server may have several)
    url: str | None  # a server's API address; None for the embedded engine
    quantization: str  # how the weights are stored when not at full precision ("GGUF Q4_K, Q6_K", "int4 (groups
    # of 64)"); "" when they are not quantized or only a server knows
    thinks: bool  # whether the model may reason before it answers (a server's model: assumed so)
    max_model_len: int | None  # the longest prompt plus reply it serves (None: a server that does not say)

    def submit(
        self, messages: list[dict], settings: ChatSettings, tools: ToolPrompt | None = None
    ) -> tuple[ReplyStream, int]:
        """Start the assistant's reply to `messages` (system prompt included) with the chat's sampling
        settings, offered `tools` when given: (its stream, prompt tokens, or 0 when only a server knows). Raises
        ContextOverflow, BadSettings or RemoteError before anything streams when the chat cannot be answered."""

    def context_meter(self, system_prompt: str, stored: list[Message]) -> str:
        """The line under a chat: how much of the context its messages use."""

    def prompt_tokens(self, messages: list[dict], settings: ChatSettings) -> int | None:
        """The tokens `messages` (system prompt included) take as a prompt; None when only a server knows."""

    def kv_panel(self, owners: dict[str, str]) -> str:
        """The KV cache tab's HTML (owners: request id -> conversation label)."""

    def device_label(self) -> str:
        """The processor the replies are computed on, for the header ("" when the label says it all)."""

    def close(self) -> None:
        """Stop serving: replies still streaming end as stopped, memory and connections go back."""


class ContextOverflow(Exception):
    """The conversation plus the reply would not fit the model's context."""

    def __init__(self, needed: int, limit: int):
        self.needed, self.limit = needed, limit
        super().__init__(
            f"This chat needs {needed:,} tokens (history plus room for the reply) but the model's context "
            f"holds {limit:,}. Drop the oldest messages, lower the reply length, or start a new chat."
        )


def meter_text(used: int, limit: int | None) -> str:
    """The context meter's line: tokens a chat uses of what the model holds."""
    return f"Context: {used:,}" + (f" / {limit:,}" if limit else "") + " tokens"


def chat_messages(system_prompt: str, messages: list[dict]) -> list[dict]:
    """The conversation a backend answers: the chat's system prompt (when it has one) first."""
    return ([{"role": "system", "content": system_prompt}] if (system_prompt or "").strip() else []) + messages


class BadSettings(ValueError):
    """A chat setting that cannot be used as it is (an invalid JSON schema): the message says which and why."""


def json_constraint(settings: ChatSettings) -> StructuredOutputsParams | None:
    """The chat's "JSON output" switch as a constraint: any JSON object, or its schema when one is given."""
    if not settings.json_output:
        return None
    schema = settings.json_schema.strip()
    try:
        return StructuredOutputsParams(json=schema) if schema else StructuredOutputsParams(json_object=True)
    except ValueError as e:
        raise BadSettings(
            f"The chat's JSON schema cannot be used: {str(e).removeprefix('StructuredOutputsParams: ')}."
            " Fix it, or clear it for any JSON object."
        ) from None


def sampling_params(settings: ChatSettings) -> SamplingParams:
    return SamplingParams(
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        min_p=settings.min_p,
        repetition_penalty=settings.repetition_penalty,
        max_tokens=settings.max_tokens,
        seed=settings.seed,
        structured_outputs=json_constraint(settings),
    )


def reply_room(max_tokens: int) -> int:
    """The room a prompt must leave for its reply: at least one token, and a little more so that answers are not
    cut at once."""
    return min(int(max_tokens), MIN_REPLY_ROOM)


def check_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    needed = num_prompt_tokens + reply_room(max_tokens)
    if needed > max_model_len:
        raise ContextOverflow(needed, max_model_len)


class LocalReplyStream:
    """An engine request's increments as ReplyDeltas; a thinking model's reasoning split from its answer."""

    def __init__(
        self,
        stream: RequestStream,
        reasoning: ReasoningSplitter | None = None,
        channels: TokenFormatStream | None = None,
    ):
        self._stream = stream
        self.request_id = stream.request_id
        self._reasoning = reasoning
        self._channels = channels  # gpt-oss, Gemma 4: reasoning and answer read from the reply's tokens

    def __iter__(self) -> Iterator[ReplyDelta]:
        for out in self._stream:
            reasoning, text = "", out.new_text
            if self._channels is not None:
                reasoning, text, _ = self._channels.feed(out.new_token_ids)
                if out.finished:
                    held_reasoning, held_text, _ = self._channels.finish()
                    reasoning, text = reasoning + held_reasoning, text + held_text
            elif self._reasoning is not None:
                reasoning, text = self._reasoning.feed(text)
                if out.finished:
                    held_reasoning, held_text = self._reasoning.finish()
                    reasoning, text = reasoning + held_reasoning, text + held_text
            yield ReplyDelta(
                text,
                len(out.new_token_ids),
                out.finished,
                out.finish_reason,
                cached_tokens=out.num_cached_tokens,
                reasoning=reasoning,
                speculation=out.speculation,
            )

    def cancel(self) -> None:
        self._stream.cancel()

    def prefill_progress(self) -> tuple[int, int] | None:
        return self._stream.prefill_progress()

    @property
    def calls(self) -> list[dict] | None:
        """The tool calls a reply in a token format (gpt-oss, Gemma 4) made, read from its tokens; None for a reply
        whose calls are in its text (app/tool_rounds.py reads them there)."""
        return self._channels.calls if self._channels is not None else None


class LocalBackend:
    """The embedded engine: one EngineThread that every chat (and the /v1 API) shares."""

    kind = "local"
    url = None

    def __init__(self, engine: EngineThread, label: str):
        self.engine, self.label, self.model, self.models = engine, label, label, [label]
        weights = engine.stats().quantization  # fixed at load: read once, not at every header refresh
        self.quantization = "" if weights == "none" else weights
        template = engine.tokenizer.chat_template
        self.thinks = template_thinks(template) or template_speaks_gemma4(template)  # Qwen3, R1 distills, Gemma 4
        self.token_format = template_speaks_tokens(template)  # gpt-oss, Gemma 4
        self.max_model_len = engine.max_model_len
        self._last_rate = (time.time(), 0)  # (when, generated tokens) at the last KV panel, for tok/s
        self._counted: dict[bytes, int] = {}  # prompt_tokens' counts, by the conversation's hash; oldest first

    def submit(
        self, messages: list[dict], settings: ChatSettings | dict, tools: ToolPrompt | None = None
    ) -> tuple[LocalReplyStream, int]:
        settings = as_chat_settings(settings)  # a script's dict too
        params = sampling_params(settings)  # first: a bad schema is refused before anything is tokenized
        if tools is not None:
            params.structured_outputs = self._tool_constraint(settings, tools)
        ids = self._encode(messages, settings, tools)
        check_fits(len(ids), params.max_tokens, self.engine.max_model_len)
        reasoning = channels = None
        if self.token_format and params.structured_outputs is None:
            channels = token_format_stream(self.engine.tokenizer)
        elif self.thinks and (params.structured_outputs is None or (tools is not None and tools.mode != "first")):
            # a tools grammar leaves the reply free until a call, so a thinking model may reason first
            reasoning = ReasoningSplitter(prompt_opens_reasoning(self.engine.tokenizer.decode(ids[-8:])))
        try:
            stream = self.engine.submit(ids, params)
        except ValueError as e:  # a schema that parses but does not compile
            if tools is not None:  # a tool's, from its server
                raise BadSettings(f"{e}. A tool's arguments schema cannot be used: turn it off in Tools.") from None
            raise BadSettings(f"{e}. Fix the chat's JSON schema, or clear it.") from None
        return LocalReplyStream(stream, reasoning, channels), len(ids)

    def _tool_constraint(self, settings: ChatSettings, tools: ToolPrompt) -> StructuredOutputsParams | None:
        """What a reply offered tools is held to: the Hermes calls' grammar (chat_tools.py), for a template that
        writes calls that way or has no tools of its own (Pagoda then describes them in Hermes form); None for a
        template with calls of another form, whose calls are read from the reply as written."""
        if settings.json_output:
            raise BadSettings("A chat cannot hold replies to JSON and call tools at once: turn JSON output off.")
        template = self.engine.tokenizer.chat_template
        if self.token_format or (template_knows_tools(template) and CALL_OPEN not in template):
            return None  # gpt-oss and Gemma 4 frame calls in their own tokens, read apart (LocalReplyStream.calls)
        return tools.constraint()

    def _encode(self, messages: list[dict], settings: ChatSettings, tools: ToolPrompt | None = None) -> list[int]:
        kwargs = {"enable_thinking": settings.think} if self.thinks else {}
        if tools is not None or any(m["role"] == "tool" for m in messages):
            # Calls and their results as the template takes them; for a template without tools, in Hermes form
            knows = template_knows_tools(self.engine.tokenizer.chat_template)
            specs = tools.specs() if tools is not None else None
            messages = prompt_messages(messages, specs, knows)
            if specs and knows:
                kwargs["tools"] = specs
        return self.engine.encode_chat(messages, **kwargs)

    def prompt_tokens(self, messages: list[dict], settings: ChatSettings | dict) -> int:
        """Counted once per conversation and Think setting: the file list counts each file at every chat opened,
        and a long file took 0.1 s a time."""
        settings = as_chat_settings(settings)
        key = hashlib.sha256(json.dumps([messages, settings.think], ensure_ascii=False).encode()).digest()
        if key not in self._counted:
            self._counted[key] = len(self._encode(messages, settings))
            while len(self._counted) > COUNTS_KEPT:
                del self._counted[next(iter(self._counted))]
        return self._counted[key]

    def context_meter(self, system_prompt: str, stored: list[Message]) -> str:
        messages = chat_messages(system_prompt, chat_turns(stored))
        # transformers refuses to template an empty conversation (a new chat without a system prompt)
        used = len(self._encode(messages, ChatSettings())) if messages else 0
        return meter_text(used, self.max_model_len)

    def kv_panel(self, owners: dict[str, str]) -> str:
        stats, blocks = self.engine.stats(), self.engine.kv_blocks()
        now = time.time()
        then, before = self._last_rate
        rate = (stats.num_generated_tokens - before) / (now - then) if now > then else 0.0
        self._last_rate = (now, stats.num_generated_tokens)
        return render_kv_cache(blocks, stats, owners=owners, tokens_per_s=rate)

    def device_label(self) -> str:
        if self.engine.device.startswith("cuda"):
            import torch

            return torch.cuda.get_device_name(self.engine.device)
        if self.engine.stats().decode == "eager (compiling)":  # a minute after a first load, on a laptop's CPU
            return "CPU (compiling faster decode steps…)"
        return "CPU"

    def close(self) -> None:
        self.engine.shutdown()  # aborts what is still streaming, then releases the engine's memory
