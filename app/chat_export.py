"""A chat as a file: Markdown to read or share, JSON that ConversationStore.import_json reads back."""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from app.chat_settings import imported_settings
from app.markdown_text import close_open_fence, fenced
from app.store_records import ROLES, clean_title, timestamp, to_json
from entrypoints.documents import DocumentError, content_hash, extract_text

if TYPE_CHECKING:
    from app.store_records import ChatFile, Conversation, Message

__all__ = ["EXPORT_FORMAT", "ImportedChat", "ImportedFile", "chat_json", "chat_markdown", "parse_chat_json"]

EXPORT_FORMAT = "pagoda.conversation"


def chat_markdown(conv: Conversation, msgs: list[Message], files: list[ChatFile] = ()) -> str:
    """The chat as Markdown: the title, the files attached, then one ``## Role`` heading per message."""
    created = datetime.fromtimestamp(conv.created).strftime("%Y-%m-%d %H:%M")
    parts = [f"# {conv.title}", f"*Exported from Pagoda. Chat started {created}.*"]
    if files:
        parts.append("Attached: " + ", ".join(f"{f.name}{' (its start only)' if f.shortened else ''}" for f in files))
    if conv.system_prompt:
        parts.append(f"## System\n\n{conv.system_prompt}")
    for m in msgs:  # a reply cut inside a code block: closed, or every heading after it read as code
        parts.append(f"## {m.role.capitalize()}\n\n{close_open_fence(m.content)}")
        for call in m.meta.get("tool_calls") or []:  # what it called, and what came back
            tool = f"{call.get('server', '?')} › {call.get('tool', call.get('name', '?'))}"
            parts.append(
                f"**Tool call** {tool} ({call.get('status', '?')})\n\n{fenced(call.get('arguments', ''), 'json')}"
            )
            if call.get("result"):
                parts.append(fenced(call["result"]))
    return "\n\n".join(parts) + "\n"


def chat_json(conv: Conversation, msgs: list[Message], files: list[tuple[ChatFile, bytes]] = ()) -> str:
    """The chat, the messages it shows (one path through its branches) and its files (bytes in base64) as JSON, in
    EXPORT_FORMAT."""
    data = {"format": EXPORT_FORMAT, "version": 1, **asdict(conv), "messages": [asdict(m) for m in msgs]}
    data["files"] = [
        {
            "name": f.name,
            "sha256": f.sha256,
            "keep_chars": len(f.text) if f.shortened else None,
            "data": base64.b64encode(raw).decode("ascii"),
        }
        for f, raw in files
    ]
    return json.dumps(data, ensure_ascii=False, indent=2)


@dataclass
class ImportedFile:
    name: str
    sha256: str
    data: bytes
    text: str
    keep_chars: int | None


@dataclass
class ImportedChat:
    """A chat read from ``chat_json`` output, checked and ready for the store: its messages as
    (role, content, meta JSON, created) rows, in order, and its files with their text read again."""

    title: str
    system_prompt: str
    settings_json: str
    created: float
    rows: list[tuple[str, str, str, float]]
    files: list[ImportedFile] = field(default_factory=list)


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
    settings_json = to_json(imported_settings(data.get("settings", {})), "settings")
    rows = []
    for i, m in enumerate(raw_msgs):
        if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"Message {i} needs a role in {ROLES} and string content.")
        meta = to_json(m.get("meta", {}), f"message {i} meta")
        rows.append((m["role"], m["content"], meta, timestamp(m.get("created"), f"message {i} created")))
    created = timestamp(data.get("created"), "created")
    return ImportedChat(title, system_prompt, settings_json, created, rows, parse_files(data.get("files", [])))


def parse_files(raw: Any) -> list[ImportedFile]:
    """An export's "files", each checked against its sha256 and read again (as attaching it read it)."""
    if not isinstance(raw, list) or not all(isinstance(f, dict) for f in raw):
        raise ValueError('"files" must be a list of objects with name, sha256 and data.')
    files = []
    for i, f in enumerate(raw):
        name, keep = f.get("name"), f.get("keep_chars")
        if not isinstance(name, str) or not name.strip() or not isinstance(f.get("data"), str):
            raise ValueError(f"File {i} needs a name and its data in base64.")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep <= 0):
            raise ValueError(f"File {i} ({name}): keep_chars must be a positive number or null.")
        try:
            data = base64.b64decode(f["data"], validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"File {i} ({name}): its data is not base64.") from None
        if content_hash(data) != f.get("sha256"):
            raise ValueError(f"File {i} ({name}) is damaged: its bytes do not match its sha256.")
        try:
            text = extract_text(name, data)
        except DocumentError as e:
            raise ValueError(f"File {i}: {e}") from None
        files.append(ImportedFile(name.strip(), content_hash(data), data, text, keep))
    return files
