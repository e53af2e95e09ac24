"""A chat as a file: Markdown to read or share, JSON that ConversationStore.import_json reads back."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from app.markdown_text import close_open_fence
from app.store_records import ROLES, clean_title, timestamp, to_json

if TYPE_CHECKING:
    from app.store_records import Conversation, Message

__all__ = ["EXPORT_FORMAT", "ImportedChat", "chat_json", "chat_markdown", "parse_chat_json"]

EXPORT_FORMAT = "pagoda.conversation"


def chat_markdown(conv: Conversation, msgs: list[Message]) -> str:
    """The chat as Markdown: the title, then one ``## Role`` heading per message."""
    created = datetime.fromtimestamp(conv.created).strftime("%Y-%m-%d %H:%M")
    parts = [f"# {conv.title}", f"*Exported from Pagoda. Chat started {created}.*"]
    if conv.system_prompt:
        parts.append(f"## System\n\n{conv.system_prompt}")
    for m in msgs:  # a reply cut inside a code block: closed, or every heading after it read as code
        parts.append(f"## {m.role.capitalize()}\n\n{close_open_fence(m.content)}")
    return "\n\n".join(parts) + "\n"


def chat_json(conv: Conversation, msgs: list[Message]) -> str:
    """The chat and the messages it shows (one path through its branches) as JSON, in EXPORT_FORMAT."""
    data = {"format": EXPORT_FORMAT, "version": 1, **asdict(conv), "messages": [asdict(m) for m in msgs]}
    return json.dumps(data, ensure_ascii=False, indent=2)


@dataclass
class ImportedChat:
    """A chat read from ``chat_json`` output, checked and ready for the store: its messages as
    (role, content, meta JSON, created) rows, in order."""

    title: str
    system_prompt: str
    settings_json: str
    created: float
    rows: list[tuple[str, str, str, float]]


def parse_chat_json(text: str) -> ImportedChat:
    """Read and check a chat exported by ``chat_json``; ValueError says what is wrong with it."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"This is not JSON ({e}); import a file made by Pagoda's JSON export.") from None
    if not isinstance(data, dict) or data.get("format") != EXPORT_FORMAT:
        raise ValueError(f'This JSON is not a Pagoda chat export (no "format": "{EXPORT_FORMAT}").')
    raw_msgs: Any = data.get("messages", [])
    if not isinstance(raw_msgs, list) or not all(isinstance(m, dict) for m in raw_msgs):
        raise ValueError('"messages" must be a list of objects with role and content.')
    title = clean_title(data.get("title", ""))
    system_prompt = data.get("system_prompt", "")
    if not isinstance(system_prompt, str):
        raise ValueError('"system_prompt" must be a string.')
    settings_json = to_json(data.get("settings", {}), "settings")
    rows = []
    for i, m in enumerate(raw_msgs):
        if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"Message {i} needs a role in {ROLES} and string content.")
        meta = to_json(m.get("meta", {}), f"message {i} meta")
        rows.append((m["role"], m["content"], meta, timestamp(m.get("created"), f"message {i} created")))
    return ImportedChat(title, system_prompt, settings_json, timestamp(data.get("created"), "created"), rows)
