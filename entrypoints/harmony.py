"""gpt-oss's harmony format, read back from the reply's tokens: reasoning, answer and tool calls apart.

A harmony reply is a run of messages, each a header and a body between special tokens:

    <|channel|>analysis<|message|>Let me think.<|end|>
    <|start|>assistant<|channel|>final<|message|>The answer.<|return|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>

The `analysis` channel is the reasoning (`reasoning_content`), `final` the answer, and a message addressed
`to=functions.NAME` (in its header, before or after the channel) a tool call whose body is the arguments. The
engine's text leaves special tokens out, so this reads token ids: the header's tokens decoded with them, a body's
without, its new text given as it grows (a character split across tokens waits for its last byte).
"""

import json
import re
from dataclasses import dataclass, field

from entrypoints.openai.tool_calls import new_call

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")  # a body ends at any of them; the last two also end the reply
RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_.\-]+)")


def special_token_ids(tokenizer, tokens: tuple[str, ...]) -> dict[int, str]:
    """id -> text of each of `tokens` the tokenizer has as a token of its own."""
    ids = {}
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids[token_id] = token
    return ids


def unread_text(tokenizer, tokens: list[int], prefix: int, read: int, final: bool) -> tuple[str, int, int]:
    """(the text of tokens[read:], the new prefix and read): decoded in a short window from `prefix` beside the
    tokens given out already (vLLM's incremental detokenizing, so a long body costs the same per token); none while
    a last character misses bytes, unless `final`."""
    if read == len(tokens):
        return "", prefix, read
    given = tokenizer.decode(tokens[prefix:read], skip_special_tokens=True)
    text = tokenizer.decode(tokens[prefix:], skip_special_tokens=True)
    if not final and text.endswith("\ufffd"):
        return "", prefix, read
    return text[len(given) :], read, len(tokens)


def template_speaks_harmony(chat_template: str | None) -> bool:
    """Whether a chat template is gpt-oss's (it frames messages in harmony's channels)."""
    return bool(chat_template) and f"{CHANNEL}analysis{MESSAGE}" in chat_template


@dataclass
class HarmonyStream:
    """Turns a harmony reply's tokens, increment by increment, into (reasoning, content, tool-call deltas), as
    ToolCallStream and ReasoningSplitter do for text: `feed` and `finish` return what is new; `reasoning`,
    `calls` and `content` hold everything so far."""

    tokenizer: object
    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)
    _specials: dict[int, str] = field(default_factory=dict)
    _header: list[int] = field(default_factory=list)
    _body: list[int] = field(default_factory=list)
    # The body's tokens whose text is given out: up to _read, decoded from _prefix on beside the new ones (vLLM's
    # incremental detokenizing: a short window, so a long body costs the same per token)
    _prefix: int = 0
    _read: int = 0
    _in_body: bool = False
    _channel: str = ""
    _recipient: str | None = None

    def __post_init__(self) -> None:
        tokens = (START, END, MESSAGE, CHANNEL, "<|constrain|>", "<|return|>", "<|call|>")
        self._specials = special_token_ids(self.tokenizer, tokens)

    def feed(self, token_ids: list[int]) -> tuple[str, str, list[dict]]:
        reasoning, content, calls = [], [], []
        for token in token_ids:
            special = self._specials.get(token)
            if not self._in_body:
                if special == MESSAGE:
                    self._open_body()
                elif special == START:
                    self._header = []
                elif special not in ENDS:
                    self._header.append(token)
                continue
            if special in ENDS:
                self._route(self._grow(final=True), reasoning, content)
                if self._recipient is not None:
                    calls.append(self._call())
                self._in_body, self._header = False, []
                continue
            self._body.append(token)
        if self._in_body:
            self._route(self._grow(final=False), reasoning, content)
        return "".join(reasoning), "".join(content), calls

    def finish(self) -> tuple[str, str, list[dict]]:
        """The reply ended (max_tokens may cut a body): what is left. A cut tool call is not a call."""
        reasoning, content = [], []
        if self._in_body and self._recipient is None:
            self._route(self._grow(final=True), reasoning, content)
        self._in_body = False
        return "".join(reasoning), "".join(content), []

    def _open_body(self) -> None:
        header = self.tokenizer.decode(self._header, skip_special_tokens=False)
        channel = header.split(CHANNEL, 1)[1] if CHANNEL in header else ""
        self._channel = channel.split()[0] if channel.split() else ""
        recipient = RECIPIENT.search(header)
        self._recipient = recipient.group(1) if recipient else None
        self._in_body, self._body, self._prefix, self._read = True, [], 0, 0

    def _grow(self, final: bool) -> str:
        """The body's text not given out yet; while it grows, none while a last character misses bytes."""
        text, self._prefix, self._read = unread_text(self.tokenizer, self._body, self._prefix, self._read, final)
        return text

    def _route(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if not text or self._recipient is not None:  # a call's arguments come whole, with the call
            return
        if self._channel == "analysis":
            reasoning.append(text)
            self.reasoning += text
        else:  # final, and commentary addressed to nobody (a preamble the user may read)
            content.append(text)
            self.content += text

    def _call(self) -> dict:
        arguments = self.tokenizer.decode(self._body, skip_special_tokens=True).strip()
        try:
            arguments = json.dumps(json.loads(arguments), ensure_ascii=False)
        except ValueError:
            pass  # as the model wrote it: the client sees what it meant to send
        call = new_call(self._recipient, arguments)
        self.calls.append(call)
        return {"index": len(self.calls) - 1, **call}
