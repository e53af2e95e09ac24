"""What the store keeps, as Python sees it: chats, messages and presets as records, the error for an unknown one,
and the checks a caller's value passes before app/store.py writes it to SQLite."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

__all__ = [
    "NEW_CHAT_TITLE",
    "ROLES",
    "ChatFile",
    "Conversation",
    "Message",
    "NotFound",
    "Preset",
    "clean_title",
    "timestamp",
    "to_json",
]

ROLES = ("system", "user", "assistant")
NEW_CHAT_TITLE = "New chat"  # a chat's title until its first message (or a rename) gives it one


class NotFound(KeyError, ValueError):
    """An unknown conversation, message or preset. Both a KeyError and a ValueError."""

    def __str__(self) -> str:  # KeyError would show the message in quotes
        return str(self.args[0]) if self.args else ""


@dataclass
class Conversation:
    id: int
    title: str
    system_prompt: str
    settings: dict
    created: float
    updated: float
    pinned: bool = False  # listed first
    folder: str = ""  # "" for none


@dataclass
class Message:
    id: int
    conversation_id: int
    role: str
    content: str
    meta: dict
    created: float
    parent_id: int | None = None  # the message it follows (None: the chat's first); siblings are other branches

    def as_chat(self) -> dict[str, str]:
        """The ``{"role", "content"}`` dict that chat templates and gr.Chatbot take."""
        return {"role": self.role, "content": self.content}


@dataclass
class ChatFile:
    """A file attached to a chat: its name there, and the text the prompt carries (cut short, when the user chose
    to keep only its start)."""

    sha256: str
    name: str
    text: str
    total_chars: int  # the whole text's length
    size: int  # bytes
    added: float

    @property
    def shortened(self) -> bool:
        return len(self.text) < self.total_chars


@dataclass
class Preset:
    name: str
    system_prompt: str


def to_json(value: dict | None, what: str) -> str:
    """A settings or meta dict as the JSON text its column holds (None: {}); `what` names it in the error."""
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a dict (JSON object), got {type(value).__name__}.")
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must hold only JSON values (str, int, float, bool, None, list, dict): {e}") from None


def timestamp(value: Any, what: str) -> float:
    """An imported time as seconds since the epoch (None: now); `what` names it in the error."""
    if value is None:
        return time.time()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number of seconds since the epoch, got {value!r}.")
    return float(value)


def clean_title(title: str) -> str:
    """A chat title with its whitespace runs collapsed to one space; an empty one is refused."""
    if not isinstance(title, str) or not title.strip():
        raise ValueError("A chat title cannot be empty: give it at least one visible character.")
    return " ".join(title.split())
