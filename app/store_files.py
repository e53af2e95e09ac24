"""The files attached to chats, a part of ConversationStore (app/store.py): one copy of each file's bytes and text
however many chats attach it (keyed by its sha256), and each chat's list of them. A file no chat attaches any more
is deleted with its last link."""

from __future__ import annotations

import builtins
import sqlite3
from collections.abc import Callable
from contextlib import AbstractContextManager

from app.store_records import ChatFile, NotFound

__all__ = ["ChatFiles"]

# ChatFile's fields: the text as the chat's prompt carries it (its first keep_chars characters, when cut)
FILE_COLS = (
    "f.sha256, c.name, substr(f.text, 1, coalesce(c.keep_chars, length(f.text))), length(f.text), length(f.data), "
    "c.added"
)


class ChatFiles:
    """ConversationStore's file methods; it provides the connection, the lock and the checks these use."""

    _read: Callable[[], AbstractContextManager[sqlite3.Connection]]
    _write: Callable[[], AbstractContextManager[sqlite3.Connection]]
    _require_conversation: Callable[[sqlite3.Connection, int], None]
    _stamp: Callable[[sqlite3.Connection], float]
    _touch: Callable[[sqlite3.Connection, int], None]

    def attach_file(
        self, conversation_id: int, name: str, sha256: str, data: bytes, text: str, keep_chars: int | None = None
    ) -> ChatFile:
        """Attach a file (its bytes, their sha256 and their text) to a chat, after the ones it has; the prompt
        carries its first `keep_chars` characters (None: all). Attaching it again renames or re-cuts it."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError("A file needs a name.")
        if keep_chars is not None and not (isinstance(keep_chars, int) and 0 < keep_chars):
            raise ValueError(f"keep_chars must be a positive number of characters or None, got {keep_chars!r}.")
        with self._write() as conn:
            self._require_conversation(conn, conversation_id)
            self._insert_file(conn, conversation_id, name.strip(), sha256, data, text, keep_chars, self._stamp(conn))
            self._touch(conn, conversation_id)
        return next(f for f in self.chat_files(conversation_id) if f.sha256 == sha256)

    def chat_files(self, conversation_id: int) -> builtins.list[ChatFile]:
        """The chat's files, in the order they were attached."""
        with self._read() as conn:
            self._require_conversation(conn, conversation_id)
            rows = conn.execute(
                f"SELECT {FILE_COLS} FROM chat_files c JOIN files f USING (sha256) "
                "WHERE c.conversation_id = ? ORDER BY c.added, c.rowid",
                (conversation_id,),
            ).fetchall()
        return [ChatFile(*row) for row in rows]

    def detach_file(self, conversation_id: int, sha256: str) -> None:
        """Take a file off a chat (and out of the store, when no other chat has it)."""
        with self._write() as conn:
            self._require_conversation(conn, conversation_id)
            cur = conn.execute(
                "DELETE FROM chat_files WHERE conversation_id = ? AND sha256 = ?", (conversation_id, sha256)
            )
            if cur.rowcount == 0:
                raise NotFound(f"Chat {conversation_id} has no file {sha256[:12]}…: it was taken off already.")
            self._forget_unused_files(conn)
            self._touch(conn, conversation_id)

    def file_data(self, sha256: str) -> bytes:
        """A file's bytes, as they were attached."""
        with self._read() as conn:
            row = conn.execute("SELECT data FROM files WHERE sha256 = ?", (sha256,)).fetchone()
        if row is None:
            raise NotFound(f"No file {sha256[:12]}… is stored: no chat attaches it any more.")
        return bytes(row[0])

    @staticmethod
    def _insert_file(
        conn: sqlite3.Connection,
        conversation_id: int,
        name: str,
        sha256: str,
        data: bytes,
        text: str,
        keep_chars: int | None,
        now: float,
    ) -> None:
        conn.execute(
            "INSERT INTO files(sha256, data, text, created) VALUES (?, ?, ?, ?) ON CONFLICT(sha256) DO NOTHING",
            (sha256, data, text, now),
        )
        conn.execute(
            "INSERT INTO chat_files(conversation_id, sha256, name, keep_chars, added) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT DO UPDATE SET name = excluded.name, keep_chars = excluded.keep_chars",
            (conversation_id, sha256, name, keep_chars, now),
        )

    @staticmethod
    def _copy_files(conn: sqlite3.Connection, source: int, target: int) -> None:
        """Attach the files of chat `source` to chat `target` too (a branch of it)."""
        conn.execute(
            "INSERT INTO chat_files(conversation_id, sha256, name, keep_chars, added) "
            "SELECT ?, sha256, name, keep_chars, added FROM chat_files WHERE conversation_id = ?",
            (target, source),
        )

    @staticmethod
    def _forget_unused_files(conn: sqlite3.Connection) -> None:
        conn.execute("DELETE FROM files WHERE NOT EXISTS (SELECT 1 FROM chat_files c WHERE c.sha256 = files.sha256)")
