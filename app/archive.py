"""Every chat in one file, and chats from other apps: Pagoda's archive (its format below), Open WebUI's export and
ChatGPT's conversations.json, each read into the same shape, a chat as a tree of messages, which the store merges
(app/store_archive.py): a chat or message already there (the same uid) is skipped, so importing twice adds nothing.

Pagoda's archive, format "pagoda.archive", version 1, is one JSON object:

    {"format": "pagoda.archive", "version": 1, "exported": <seconds since the epoch>,
     "presets": [{"name": ..., "system_prompt": ...}],
     "files": [{"sha256": ..., "data": <the file's bytes, base64>}],
     "chats": [{"uid": ..., "title": ..., "system_prompt": ..., "settings": {...}, "created": ..., "updated": ...,
                "leaf": <the uid of the last message of the branch the chat shows, or null>,
                "pinned": <true or false>, "folder": <a name, or "" for none>,
                "files": [{"sha256": ..., "name": ..., "keep_chars": <null, or the characters kept>}],
                "messages": [{"uid": ..., "parent": <a uid or null>, "role": "system" | "user" | "assistant",
                              "content": ..., "meta": {...}, "created": ...}]}]}

Messages come parents first. A chat exported alone (app/chat_export.py, format "pagoda.conversation") is read too.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from typing import Any

from app.chat_export import EXPORT_FORMAT, parse_chat_json
from app.chat_settings import imported_settings
from app.store_records import NEW_CHAT_TITLE, ROLES, clean_title, timestamp, to_json
from entrypoints.documents import DocumentError, content_hash, extract_text

__all__ = ["ARCHIVE_FORMAT", "ARCHIVE_VERSION", "Archive", "ArchivedChat", "TreeMessage", "read_archive"]

ARCHIVE_FORMAT = "pagoda.archive"
ARCHIVE_VERSION = 1


@dataclass
class TreeMessage:
    uid: str
    parent_uid: str | None
    role: str
    content: str
    meta_json: str
    created: float


@dataclass
class ArchivedChat:
    uid: str | None  # None: a chat exported alone, which has none (imported anew each time)
    title: str
    system_prompt: str
    settings_json: str
    created: float
    updated: float
    leaf_uid: str | None
    messages: list[TreeMessage]  # parents first
    files: list[tuple[str, str, int | None]] = field(default_factory=list)  # (sha256, name, keep_chars)
    pinned: bool = False
    folder: str = ""


@dataclass
class Archive:
    """What a file holds, checked: its chats, presets and files ((bytes, text) by sha256), and where it came from."""

    source: str  # "Pagoda", "Open WebUI" or "ChatGPT"
    chats: list[ArchivedChat]
    presets: list[tuple[str, str]] = field(default_factory=list)
    files: dict[str, tuple[bytes, str]] = field(default_factory=dict)


def read_archive(text: str) -> Archive:
    """Read and check an archive (Pagoda's, or a chat exported alone), an Open WebUI export or a ChatGPT
    conversations.json. ValueError says what is wrong; nothing is read in part."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"This is not JSON ({e}). {WHAT_IMPORTS}") from None
    try:
        if isinstance(data, dict) and data.get("format") == ARCHIVE_FORMAT:
            return _pagoda(data)
        if isinstance(data, dict) and data.get("format") == EXPORT_FORMAT:
            return _one_chat(text)
        if isinstance(data, list) and data and all(isinstance(c, dict) for c in data):
            if all("mapping" in c for c in data):
                return Archive("ChatGPT", [_chatgpt(c, i) for i, c in enumerate(data)])
            if all(isinstance(c.get("chat"), dict) for c in data):
                return Archive("Open WebUI", [_open_webui(c, i) for i, c in enumerate(data)])
    except (TypeError, AttributeError, KeyError) as e:  # a field of another type than its format's
        raise ValueError(f"This file has the shape of an export, but a field in it does not ({e!r}).") from None
    raise ValueError(f"This JSON is none of the kinds Pagoda imports. {WHAT_IMPORTS}")


WHAT_IMPORTS = (
    "Import a Pagoda archive (Export all) or chat export, an Open WebUI export (Settings → Chats → Export), or "
    "ChatGPT's conversations.json (from its data export)."
)


# ---- Pagoda's own -------------------------------------------------------------------------------------------


def _pagoda(data: dict) -> Archive:
    version = data.get("version")
    if not isinstance(version, int) or version < 1:
        raise ValueError('This archive has no valid "version".')
    if version > ARCHIVE_VERSION:
        raise ValueError(
            f"This archive is version {version}, written by a newer Pagoda; this one reads up to version "
            f"{ARCHIVE_VERSION}. Upgrade Pagoda to import it."
        )
    files = {}
    for i, f in enumerate(_list(data, "files")):
        try:
            raw = base64.b64decode(f.get("data", ""), validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"files.{i}: its data is not base64.") from None
        if content_hash(raw) != f.get("sha256"):
            raise ValueError(f"files.{i} is damaged: its bytes do not match its sha256.")
        files[f["sha256"]] = raw
    presets = []
    for i, p in enumerate(_list(data, "presets")):
        if not isinstance(p.get("name"), str) or not p["name"].strip() or not isinstance(p.get("system_prompt"), str):
            raise ValueError(f"presets.{i} needs a name and a system_prompt.")
        presets.append((p["name"].strip(), p["system_prompt"]))
    chats, names = [], {}
    for i, c in enumerate(_list(data, "chats")):
        chat = _pagoda_chat(c, f"chats.{i}")
        for sha, name, _ in chat.files:
            if sha not in files:
                raise ValueError(f"chats.{i} attaches a file ({name}) that the archive does not hold.")
            names.setdefault(sha, name)
        chats.append(chat)
    texts = {}
    for sha, raw in files.items():
        try:
            texts[sha] = (raw, extract_text(names.get(sha, "file.txt"), raw))
        except DocumentError as e:
            raise ValueError(f"A file of the archive cannot be read: {e}") from None
    return Archive("Pagoda", chats, presets, texts)


def _pagoda_chat(c: dict, where: str) -> ArchivedChat:
    uid = c.get("uid")
    if not isinstance(uid, str) or not uid:
        raise ValueError(f"{where} needs a uid.")
    messages, seen = [], set()
    for j, m in enumerate(c.get("messages", [])):
        if not isinstance(m, dict) or not isinstance(m.get("uid"), str) or m.get("role") not in ROLES:
            raise ValueError(f"{where}.messages.{j} needs a uid and a role in {ROLES}.")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"{where}.messages.{j} needs string content.")
        parent = m.get("parent")
        if parent is not None and parent not in seen:
            raise ValueError(f"{where}.messages.{j}: its parent must come before it.")
        seen.add(m["uid"])
        meta = to_json(m.get("meta", {}), f"{where}.messages.{j}.meta")
        messages.append(
            TreeMessage(m["uid"], parent, m["role"], m["content"], meta, timestamp(m.get("created"), where))
        )
    leaf = c.get("leaf", messages[-1].uid if messages else None)  # none said: the newest message
    if leaf is not None and leaf not in seen:
        raise ValueError(f"{where}: its leaf is not one of its messages.")
    files = []
    for j, f in enumerate(c.get("files", [])):
        keep = f.get("keep_chars") if isinstance(f, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("sha256"), str) or not isinstance(f.get("name"), str):
            raise ValueError(f"{where}.files.{j} needs a sha256 and a name.")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep <= 0):
            raise ValueError(f"{where}.files.{j}: keep_chars must be a positive number or null.")
        files.append((f["sha256"], f["name"], keep))
    return ArchivedChat(
        uid,
        clean_title(c.get("title") or NEW_CHAT_TITLE),
        _text(c.get("system_prompt", ""), f"{where}.system_prompt"),
        to_json(imported_settings(c.get("settings", {})), f"{where}.settings"),
        timestamp(c.get("created"), f"{where}.created"),
        timestamp(c.get("updated"), f"{where}.updated"),
        leaf,
        messages,
        files,
        bool(c.get("pinned", False)),
        _text(c.get("folder", ""), f"{where}.folder"),
    )


def _one_chat(text: str) -> Archive:
    chat = parse_chat_json(text)
    messages, parent = [], None
    for k, (role, content, meta, created) in enumerate(chat.rows):
        messages.append(TreeMessage(f"m{k}", parent, role, content, meta, created))
        parent = f"m{k}"
    files = {f.sha256: (f.data, f.text) for f in chat.files}
    refs = [(f.sha256, f.name, f.keep_chars) for f in chat.files]
    one = ArchivedChat(
        None, chat.title, chat.system_prompt, chat.settings_json, chat.created, chat.created, parent, messages, refs
    )
    return Archive("Pagoda", [one], files=files)


# ---- other apps -------------------------------------------------------------------------------------------


def _open_webui(c: dict, i: int) -> ArchivedChat:
    """One chat of Open WebUI's export: {"id", "title", "chat": {"history": {"messages": {id: {"id", "parentId",
    "role", "content", "timestamp"}}, "currentId"}}, "created_at", "updated_at"}; chats without a history have
    only chat.messages, a list in order."""
    where = f"chat {i} ({c.get('title', 'untitled')})"
    body = c["chat"]
    history = body.get("history") if isinstance(body.get("history"), dict) else None
    nodes = history.get("messages") if history else None
    if isinstance(nodes, dict) and nodes:
        raw = {str(k): {"parent": v.get("parentId"), **v} for k, v in nodes.items() if isinstance(v, dict)}
        leaf = history.get("currentId")
    else:
        listed = [m for m in body.get("messages", []) if isinstance(m, dict)]
        raw, parent = {}, None
        for k, m in enumerate(listed):
            raw[str(m.get("id", k))] = {**m, "parent": parent}
            parent = str(m.get("id", k))
        leaf = parent
    messages = _tree(raw, lambda m: (m.get("role"), m.get("content")), lambda m: m.get("timestamp"), where)
    created = _seconds(c.get("created_at") or body.get("timestamp"))
    return ArchivedChat(
        f"openwebui:{c.get('id', i)}",
        clean_title(c.get("title") or body.get("title") or NEW_CHAT_TITLE),
        _text(body.get("system", "") or "", f"{where}: system"),
        "{}",
        created,
        _seconds(c.get("updated_at")) if c.get("updated_at") else created,
        _kept_leaf(leaf, raw, messages),
        messages,
        pinned=bool(c.get("pinned")),
    )


def _chatgpt(c: dict, i: int) -> ArchivedChat:
    """One conversation of ChatGPT's conversations.json: {"title", "create_time", "update_time", "mapping": {id:
    {"id", "parent", "children", "message": {"author": {"role"}, "content": {"content_type", "parts"},
    "create_time"} or null}}, "current_node", "conversation_id" or "id"}. Only text parts are kept; tool and
    hidden system nodes are left out, their children joined to the nearest kept parent."""
    where = f"conversation {i} ({c.get('title', 'untitled')})"
    mapping = c.get("mapping")
    if not isinstance(mapping, dict):
        raise ValueError(f"{where} has no mapping of its messages.")

    def read(node: dict):
        message = node.get("message")
        if not isinstance(message, dict):
            return None, None
        role = (message.get("author") or {}).get("role")
        content = message.get("content") or {}
        if content.get("content_type") not in ("text", "multimodal_text"):
            return None, None
        text = "".join(p for p in content.get("parts", []) if isinstance(p, str))
        hidden = (message.get("metadata") or {}).get("is_visually_hidden_from_conversation")
        return (role, text) if text.strip() and not hidden else (None, None)

    raw = {str(k): v for k, v in mapping.items() if isinstance(v, dict)}
    messages = _tree(raw, read, lambda n: (n.get("message") or {}).get("create_time"), where)
    created = _seconds(c.get("create_time"))
    uid = c.get("conversation_id") or c.get("id") or f"{c.get('title', '')}-{created}"
    return ArchivedChat(
        f"chatgpt:{uid}",
        clean_title(c.get("title") or NEW_CHAT_TITLE),
        "",
        "{}",
        created,
        _seconds(c.get("update_time")) if c.get("update_time") else created,
        _kept_leaf(c.get("current_node"), raw, messages),
        messages,
    )


def _tree(raw: dict[str, dict], read, created_of, where: str) -> list[TreeMessage]:
    """Nodes {id: node with "parent"} as TreeMessages, parents first. A node `read` gives no (role, content) for is
    left out and its children hang from its nearest kept ancestor; roles other than ours are left out likewise."""
    kept: dict[str, tuple[str, str]] = {}
    for key, node in raw.items():
        role, content = read(node)
        if role in ("user", "assistant", "system") and isinstance(content, str):
            kept[key] = (role, content)

    def kept_parent(key: str) -> str | None:
        seen = set()
        parent = raw[key].get("parent")
        while parent is not None and str(parent) in raw and str(parent) not in kept and parent not in seen:
            seen.add(parent)
            parent = raw[str(parent)].get("parent")
        return str(parent) if parent is not None and str(parent) in kept else None

    parents = {key: kept_parent(key) for key in kept}
    ordered, placed = [], set()
    pending = list(kept)
    while pending:  # parents first: each pass places the nodes whose parent is placed
        ready = [k for k in pending if parents[k] is None or parents[k] in placed]
        if not ready:
            raise ValueError(f"{where}: its messages' parents form a loop.")
        for key in sorted(ready, key=lambda k: (_seconds(created_of(raw[k])), k)):
            role, content = kept[key]
            ordered.append(TreeMessage(key, parents[key], role, content, "{}", _seconds(created_of(raw[key]))))
            placed.add(key)
        pending = [k for k in pending if k not in placed]
    return ordered


def _kept_leaf(leaf: Any, raw: dict, messages: list[TreeMessage]) -> str | None:
    """The chat's current message, or its nearest kept ancestor; else the newest message."""
    kept = {m.uid for m in messages}
    seen = set()
    while leaf is not None and str(leaf) not in kept and str(leaf) in raw and leaf not in seen:
        seen.add(leaf)
        leaf = raw[str(leaf)].get("parent") or raw[str(leaf)].get("parentId")
    if leaf is not None and str(leaf) in kept:
        return str(leaf)
    return messages[-1].uid if messages else None


def _seconds(value: Any) -> float:
    """A time as the other apps write it (seconds, or milliseconds since the epoch), as seconds; None: now."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return timestamp(None, "")
    return float(value) / 1000 if value > 1e11 else float(value)


def _list(data: dict, key: str) -> list[dict]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ValueError(f'"{key}" must be a list of objects.')
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string.")
    return value
