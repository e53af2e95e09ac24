"""A chat as a file: Markdown to read or share, JSON that ConversationStore.import_json reads back."""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import datetime
from typing import TYPE_CHECKING

from app.markdown_text import close_open_fence

if TYPE_CHECKING:
    from app.store_records import Conversation, Message

__all__ = ["EXPORT_FORMAT", "chat_markdown", "chat_json"]

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
    """The chat and its messages as JSON, in EXPORT_FORMAT."""
    data = {"format": EXPORT_FORMAT, "version": 1, **asdict(conv), "messages": [asdict(m) for m in msgs]}
    return json.dumps(data, ensure_ascii=False, indent=2)
