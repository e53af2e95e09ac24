"""Gemma 4's reply format, read back from the reply's tokens: reasoning, answer and tool calls apart.

A Gemma 4 reply frames its parts in special tokens (its chat template writes them, llama.cpp's gemma4 parser
reads them the same way):

    <|channel>thought
    Let me think.<channel|>The answer.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

A channel named `thought` is the reasoning (`reasoning_content`); the text outside channels the answer; a
`<|tool_call>` block one call, its arguments in Gemma's own notation: keys bare, strings between `<|"|>` marks,
numbers, booleans, null, lists and nested objects as in JSON. They are given to the client as JSON. The reply
ends at `<turn|>`, or at `<|tool_response>` after calls (the engine stops on both: they are end-of-turn tokens).
"""

import json
import re
from dataclasses import dataclass, field

from entrypoints.harmony import special_token_ids, unread_text
from entrypoints.openai.tool_calls import new_call

CHANNEL_OPEN, CHANNEL_CLOSE = "<|channel>", "<channel|>"
CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
QUOTE = '<|"|>'
ENDS = ("<turn|>", "<|tool_response>")
CALL = re.compile(r"\s*call:([A-Za-z0-9_.\-]+)\s*(\{.*\})\s*", re.DOTALL)


def template_speaks_gemma4(chat_template: str | None) -> bool:
    """Whether a chat template is Gemma 4's (its replies frame reasoning and tool calls in special tokens)."""
    return bool(chat_template) and f"{CALL_OPEN}call:" in chat_template and CHANNEL_OPEN in chat_template


@dataclass
class Gemma4Stream:
    """Turns a Gemma 4 reply's tokens, increment by increment, into (reasoning, content, tool-call deltas), as
    HarmonyStream does for gpt-oss: `feed` and `finish` return what is new; `reasoning`, `content` and `calls`
    hold everything so far."""

    tokenizer: object
    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)
    _specials: dict[int, str] = field(default_factory=dict)
    _part: str = "content"  # "content", "channel" (its name still arriving), "thought", "call"
    _body: list[int] = field(default_factory=list)
    # The part's tokens whose text is given out: up to _read, decoded from _prefix on beside the new ones
    _prefix: int = 0
    _read: int = 0
    _strip: bool = False  # the whitespace that opens the part belongs to neither side
    _drop: int = 0  # characters of the part's text that are no one's: a channel's name

    def __post_init__(self) -> None:
        self._specials = special_token_ids(
            self.tokenizer, (CHANNEL_OPEN, CHANNEL_CLOSE, CALL_OPEN, CALL_CLOSE, QUOTE, *ENDS)
        )

    def feed(self, token_ids: list[int]) -> tuple[str, str, list[dict]]:
        reasoning, content, calls = [], [], []
        for token in token_ids:
            special = self._specials.get(token)
            if special is None or (self._part == "call" and special == QUOTE):
                self._body.append(token)
                if self._part == "channel":
                    self._name_channel()
                continue
            if self._part == "call":
                if special == CALL_CLOSE:
                    calls.append(self._call())
                self._open("content")  # a call cut by another special token is not a call
            elif special in (CHANNEL_OPEN, CALL_OPEN):
                self._route(self._grow(final=True), reasoning, content)
                self._open("channel" if special == CHANNEL_OPEN else "call")
            elif special == CHANNEL_CLOSE:
                self._route(self._grow(final=True), reasoning, content)
                self._open("content")
        self._route(self._grow(final=False), reasoning, content)
        return "".join(reasoning), "".join(content), calls

    def finish(self) -> tuple[str, str, list[dict]]:
        """The reply ended (max_tokens may cut a part): what is left. A cut tool call is not a call."""
        reasoning, content = [], []
        self._route(self._grow(final=True), reasoning, content)
        self._open("content")
        return "".join(reasoning), "".join(content), []

    def _open(self, part: str) -> None:
        self._part, self._body, self._prefix, self._read, self._drop = part, [], 0, 0, 0
        self._strip = part != "call"

    def _name_channel(self) -> None:
        """Once the channel's name is whole (text then whitespace), what follows it is the channel's body."""
        name = re.match(r"\s*\S+\s", self.tokenizer.decode(self._body, skip_special_tokens=True))
        if name is not None:
            self._part = "thought"  # every channel's body is reasoning; Gemma 4 writes only `thought`
            self._drop = name.end(0)

    def _grow(self, final: bool) -> str:
        """The part's text not given out yet; while it grows, none while a last character misses bytes."""
        if self._part in ("channel", "call"):
            return ""
        text, self._prefix, self._read = unread_text(self.tokenizer, self._body, self._prefix, self._read, final)
        dropped = min(self._drop, len(text))
        text, self._drop = text[dropped:], self._drop - dropped
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        return text

    def _route(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if not text:
            return
        if self._part == "thought":
            reasoning.append(text)
            self.reasoning += text
        else:
            content.append(text)
            self.content += text

    def _call(self) -> dict:
        text = self.tokenizer.decode(self._body, skip_special_tokens=False)
        match = CALL.fullmatch(text)
        name, arguments = (match.group(1), match.group(2)) if match else ("", text.strip())
        try:
            arguments = json.dumps(parse_arguments(arguments), ensure_ascii=False)
        except ValueError:
            pass  # as the model wrote it: the client sees what it meant to send
        call = new_call(name, arguments)
        self.calls.append(call)
        return {"index": len(self.calls) - 1, **call}


def parse_arguments(text: str) -> object:
    """A value in Gemma 4's argument notation, as Python (dicts, lists, strings, numbers, booleans, None).
    Raises ValueError where the text is not one."""
    value, end = _value(text, _skip(text, 0))
    if _skip(text, end) != len(text):
        raise ValueError(f"text after the arguments at {end}")
    return value


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _value(text: str, i: int) -> tuple[object, int]:
    if text.startswith(QUOTE, i):
        end = text.find(QUOTE, i + len(QUOTE))
        if end < 0:
            raise ValueError("a string is not closed")
        return text[i + len(QUOTE) : end], end + len(QUOTE)
    if text.startswith("{", i):
        return _sequence(text, i + 1, "}", keyed=True)
    if text.startswith("[", i):
        return _sequence(text, i + 1, "]", keyed=False)
    literal = re.compile(r"true|false|null|-?\d+(\.\d+)?([eE][-+]?\d+)?").match(text, i)
    if literal is None:
        raise ValueError(f"no value at {i}")
    return json.loads(literal.group(0)), literal.end()


def _sequence(text: str, i: int, close: str, keyed: bool) -> tuple[object, int]:
    items: dict | list = {} if keyed else []
    i = _skip(text, i)
    if text.startswith(close, i):
        return items, i + 1
    while True:
        if keyed:
            colon = text.find(":", i)
            if colon < 0 or "}" in text[i:colon]:
                raise ValueError(f"no key at {i}")
            key, i = text[i:colon].strip().strip('"').replace(QUOTE, ""), colon + 1
        value, i = _value(text, _skip(text, i))
        if keyed:
            items[key] = value
        else:
            items.append(value)
        i = _skip(text, i)
        if text.startswith(close, i):
            return items, i + 1
        if not text.startswith(",", i):
            raise ValueError(f"expected ',' or {close!r} at {i}")
        i = _skip(text, i + 1)
