"""A chat's settings: its sampling settings and its switches, one typed object that the page, the store and both
backends share. The store keeps them as a JSON object; `from_dict` reads one back (a missing key: its default, as
for a chat saved by an older Pagoda; an unknown key, a newer Pagoda's: dropped) and `to_dict` writes it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ChatSettings:
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 512  # "Max reply tokens"
    seed: int | None = None  # None: a fresh random seed for each reply
    think: bool = True  # let a thinking model reason first (Qwen3, R1 distills)
    json_output: bool = False  # hold the replies to JSON
    json_schema: str = ""  # and to this schema, when given
    tools: tuple[str, ...] = ()  # the MCP tools the chat may call, as "server/tool" (app/chat_tools.py)
    tool_choice: str = "auto"  # "auto": the model decides; "first": it calls a tool before each answer
    tool_rounds: int = 5  # the most rounds of calls one reply makes before it must answer
    tools_always: tuple[str, ...] = ()  # tools the user allowed for every call in this chat ("Always")

    def __post_init__(self) -> None:
        # Sliders and JSON hand over floats for whole numbers, and "" or -1 for "no seed": typed once, here
        for name, kind in (
            ("temperature", float),
            ("top_p", float),
            ("top_k", int),
            ("min_p", float),
            ("repetition_penalty", float),
            ("max_tokens", int),
            ("tool_rounds", int),
            ("seed", int),
        ):
            value = getattr(self, name)
            if name == "seed" and value in (None, "", -1):
                object.__setattr__(self, name, None)
                continue
            try:
                object.__setattr__(self, name, kind(value))
            except (TypeError, ValueError):
                raise ValueError(
                    f"The chat setting {name} must be a number, got {value!r}: set it again in "
                    "System prompt and sampling."
                ) from None
        for name in ("think", "json_output"):
            object.__setattr__(self, name, bool(getattr(self, name)))
        object.__setattr__(self, "json_schema", self.json_schema or "")
        for name in ("tools", "tools_always"):
            value = getattr(self, name) or ()
            if isinstance(value, str) or not all(isinstance(key, str) for key in value):
                raise ValueError(f'The chat setting {name} must be a list of "server/tool" names, got {value!r}.')
            object.__setattr__(self, name, tuple(dict.fromkeys(value)))
        if self.tool_choice not in ("auto", "first"):
            raise ValueError(f'The chat setting tool_choice must be "auto" or "first", got {self.tool_choice!r}.')
        if self.tool_rounds < 1:
            raise ValueError(f"The chat setting tool_rounds must be 1 or more, got {self.tool_rounds}.")

    @classmethod
    def from_dict(cls, stored: dict[str, Any] | None) -> ChatSettings:
        """The settings a chat stored (see the module's note on missing and unknown keys)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in (stored or {}).items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> ChatSettings:
        return dataclasses.replace(self, **changes)


def as_chat_settings(settings: ChatSettings | dict[str, Any] | None) -> ChatSettings:
    """`settings` as ChatSettings: scripts (and tests outside the app) hand the backends a plain dict."""
    return settings if isinstance(settings, ChatSettings) else ChatSettings.from_dict(settings)


def imported_settings(settings: Any) -> Any:
    """A chat's settings as an import keeps them: without the tools its author allowed to run without asking. A
    chat file from elsewhere must not run a tool without the user's own click."""
    if isinstance(settings, dict):
        return {k: v for k, v in settings.items() if k != "tools_always"}
    return settings  # not an object: the import says so (to_json)
