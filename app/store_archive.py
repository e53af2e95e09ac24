"""Every chat at once, a part of ConversationStore (app/store.py): the archive of all of them (app/archive.py has its
format), and the merge of one read from a file. Chats and messages are known by their uid, so importing the same
archive twice adds nothing, and importing one that has more of a chat adds only what is new."""

from __future__ import annotations

import base64
import json
import sqlite3
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from app.archive import ARCHIVE_FORMAT, ARCHIVE_VERSION, Archive, ArchivedChat

__all__ = ["ChatArchive", "ImportReport"]


@dataclass
class ImportReport:
    source: str
    chats_added: int = 0
    chats_merged: int = 0  # already here: only their new messages were added
    chats_unchanged: int = 0
    messages_added: int = 0
    presets_added: int = 0

    def __str__(self) -> str:
        said = [f"{self.chats_added} new chat{'' if self.chats_added == 1 else 's'}"]
        if self.chats_merged:
            said.append(f"new messages in {self.chats_merged} chat{'' if self.chats_merged == 1 else 's'} already here")
        if self.chats_unchanged:
            said.append(f"{self.chats_unchanged} already here, unchanged")
        if self.presets_added:
            said.append(f"{self.presets_added} preset{'' if self.presets_added == 1 else 's'}")
        return f"Imported from {self.source}: " + ", ".join(said) + "."


class ChatArchive:
    """ConversationStore's archive methods; it provides the connection and the lock."""

    _read: Callable[[], AbstractContextManager[sqlite3.Connection]]
    _write: Callable[[], AbstractContextManager[sqlite3.Connection]]

    def export_all(self) -> str:
        """Every chat (all its branches and files) and every preset, as one archive (app/archive.py)."""
        with self._read() as conn:
            rows = conn.execute(
                "SELECT id, uid, title, system_prompt, settings, created, updated, leaf_id, pinned, folder "
                "FROM conversations ORDER BY id"
            ).fetchall()
            chats = [self._archived(conn, row) for row in rows]
            files = conn.execute("SELECT sha256, data FROM files ORDER BY sha256").fetchall()
            presets = conn.execute("SELECT name, system_prompt FROM presets ORDER BY rowid").fetchall()
        archive = {
            "format": ARCHIVE_FORMAT,
            "version": ARCHIVE_VERSION,
            "exported": time.time(),
            "presets": [{"name": n, "system_prompt": p} for n, p in presets],
            "files": [{"sha256": sha, "data": base64.b64encode(bytes(data)).decode("ascii")} for sha, data in files],
            "chats": chats,
        }
        return json.dumps(archive, ensure_ascii=False, indent=1)

    @staticmethod
    def _archived(conn: sqlite3.Connection, row: tuple) -> dict:
        cid, uid, title, system_prompt, settings, created, updated, leaf_id, pinned, folder = row
        rows = conn.execute(
            "SELECT id, uid, parent_id, role, content, meta, created FROM messages WHERE conversation_id = ? "
            "ORDER BY id",
            (cid,),
        ).fetchall()
        uids = {r[0]: r[1] for r in rows}
        files = conn.execute(
            "SELECT sha256, name, keep_chars FROM chat_files WHERE conversation_id = ? ORDER BY added, rowid", (cid,)
        ).fetchall()
        return {
            "uid": uid,
            "title": title,
            "system_prompt": system_prompt,
            "settings": json.loads(settings),
            "created": created,
            "updated": updated,
            "leaf": uids.get(leaf_id),
            "pinned": bool(pinned),
            "folder": folder,
            "files": [{"sha256": sha, "name": name, "keep_chars": keep} for sha, name, keep in files],
            "messages": [
                {
                    "uid": m_uid,
                    "parent": uids.get(parent),
                    "role": role,
                    "content": content,
                    "meta": json.loads(meta),
                    "created": m_created,
                }
                for _, m_uid, parent, role, content, meta, m_created in rows
            ],
        }

    def import_archive(self, archive: Archive) -> ImportReport:
        """Merge an archive read by app/archive.py's read_archive, in one transaction: new chats are added whole,
        chats already here (the same uid) get only the messages they lack, presets only the names they lack."""
        report = ImportReport(archive.source)
        with self._write() as conn:
            now = time.time()
            for name, prompt in archive.presets:
                cur = conn.execute(
                    "INSERT INTO presets(name, system_prompt) VALUES (?, ?) ON CONFLICT(name) DO NOTHING",
                    (name, prompt),
                )
                report.presets_added += cur.rowcount
            for sha, (data, text) in archive.files.items():
                conn.execute(
                    "INSERT INTO files(sha256, data, text, created) VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                    (sha, data, text, now),
                )
            for chat in archive.chats:
                self._merge_chat(conn, chat, report)
        return report

    @staticmethod
    def _merge_chat(conn: sqlite3.Connection, chat: ArchivedChat, report: ImportReport) -> None:
        row = conn.execute("SELECT id FROM conversations WHERE uid = ?", (chat.uid,)).fetchone() if chat.uid else None
        if row is None:
            cid = conn.execute(
                "INSERT INTO conversations(uid, title, system_prompt, settings, created, updated, pinned, folder) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    chat.uid,
                    chat.title,
                    chat.system_prompt,
                    chat.settings_json,
                    chat.created,
                    chat.updated,
                    int(chat.pinned),
                    chat.folder,
                ),
            ).lastrowid
            ids = {}
        else:
            cid = row[0]
            ids = dict(conn.execute("SELECT uid, id FROM messages WHERE conversation_id = ?", (cid,)).fetchall())
        added = 0
        for m in chat.messages:
            if m.uid in ids:
                continue
            ids[m.uid] = conn.execute(
                "INSERT INTO messages(conversation_id, uid, parent_id, role, content, meta, created) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (cid, m.uid, ids.get(m.parent_uid), m.role, m.content, m.meta_json, m.created),
            ).lastrowid
            added += 1
        for sha, name, keep in chat.files:
            conn.execute(
                "INSERT INTO chat_files(conversation_id, sha256, name, keep_chars, added) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT DO NOTHING",
                (cid, sha, name, keep, chat.created),
            )
        if row is None:
            conn.execute("UPDATE conversations SET leaf_id = ? WHERE id = ?", (ids.get(chat.leaf_uid), cid))
            report.chats_added += 1
        elif added:
            report.chats_merged += 1
        else:
            report.chats_unchanged += 1
        report.messages_added += added
