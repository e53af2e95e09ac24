"""Conversations, messages and system-prompt presets, kept server-side in SQLite.

One SQLite file (WAL journal, foreign keys on) holds everything. Every write is its own
transaction, committed before the method returns, so a page reload, an app restart or a
``kill -9`` in the middle of a streamed reply loses nothing that a method already returned
from. WAL with ``synchronous=NORMAL`` is durable against a crash of the process; only a power
cut can drop the last few commits (the database stays consistent either way).

One connection is shared by all threads behind a lock: Gradio calls the store from many worker
threads, and a chat app's writes are tiny. Several processes may open the same file; SQLite's
own locking (with a busy timeout) serialises them.

A chat's messages form a tree (app/store_tree.py): Regenerate and an edit add siblings, and the old
branches stay. ``messages()`` is the one path the chat shows; ``show()`` switches it.

``updated`` orders the chat list. Every write to a conversation bumps it, except
``update_message``, which runs once per streamed token (the ``add_message`` that started the
reply has already bumped it), and ``show()``, which only looks at another branch. Within one
database ``updated`` is strictly increasing, so the chat touched last is always first in ``list()``.

The records it returns, and the checks a caller's value passes first, are in app/store_records.py; the
tables and their migrations in app/store_schema.py.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from app.chat_export import chat_json, chat_markdown, parse_chat_json
from app.store_archive import ChatArchive
from app.store_files import ChatFiles
from app.store_records import NEW_CHAT_TITLE, ROLES, Conversation, Message, NotFound, Preset, clean_title, to_json
from app.store_schema import DEFAULT_PRESETS, SCHEMA_VERSION, SchemaError, migrate
from app.store_settings import PresetsAndSettings
from app.store_tree import newest_under, path_rows, prune_unused_ancestors, shown_leaf, sibling_ids

__all__ = [
    "NEW_CHAT_TITLE",
    "ROLES",
    "SCHEMA_VERSION",
    "Conversation",
    "ConversationStore",
    "Message",
    "NotFound",
    "Preset",
    "SchemaError",
    "DEFAULT_PRESETS",
    "default_db_path",
]

DB_NAME = "pagoda.db"
INSERT_MESSAGE = (
    "INSERT INTO messages(conversation_id, role, content, meta, created, parent_id) VALUES (?, ?, ?, ?, ?, ?)"
)


def default_db_path() -> Path:
    """``$PAGODA_HOME/pagoda.db`` if PAGODA_HOME is set, else under platformdirs' user data dir."""
    home = os.environ.get("PAGODA_HOME")
    if home:
        return Path(home).expanduser() / DB_NAME
    import platformdirs

    return Path(platformdirs.user_data_dir("pagoda")) / DB_NAME


def fts_query(text: str) -> str:
    """A search box's text as an FTS5 query: each of its words, or a longer word it starts (all of them). Quoted,
    so that nothing the user types is read as FTS5's own syntax; no words match nothing."""
    words = re.findall(r"\w+", text)
    return " ".join(f'"{w}"*' for w in words) if words else '""'


def _contains(haystack: str | None, needle: str | None) -> bool:
    """Case-insensitive substring test for SQL (Unicode-aware, unlike SQLite's LIKE and lower())."""
    if haystack is None or needle is None:
        return False
    return needle in haystack.casefold()


class ConversationStore(ChatFiles, ChatArchive, PresetsAndSettings):
    """Chats, their messages and files, and shared system-prompt presets, in one SQLite file. Thread-safe."""

    def __init__(self, path: str | Path) -> None:
        self.path = path if str(path) == ":memory:" else Path(path).expanduser()
        if isinstance(self.path, Path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._last_stamp = 0.0
        conn = sqlite3.connect(str(self.path), timeout=30.0, isolation_level=None, check_same_thread=False)
        try:
            try:
                conn.execute("PRAGMA busy_timeout = 30000")
                self.journal_mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            except sqlite3.DatabaseError as e:
                raise SchemaError(
                    f"{self.path} is not a Pagoda database ({e}). Move it aside, or set PAGODA_HOME to another folder."
                ) from None
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("PRAGMA foreign_keys = ON")
            conn.create_function("pagoda_contains", 2, _contains, deterministic=True)
            self._conn: sqlite3.Connection | None = conn
            self._migrate()
        except BaseException:
            conn.close()
            self._conn = None
            raise

    # ---- plumbing ------------------------------------------------------------------------------

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("This ConversationStore is closed; open a new one.")
        return self._conn

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            yield self._db()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One committed transaction. IMMEDIATE takes the write lock up front (no upgrade deadlocks)."""
        with self._lock:
            conn = self._db()
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    def _migrate(self) -> None:
        with self._write() as conn:
            migrate(conn, self.path)

    def _stamp(self, conn: sqlite3.Connection) -> float:
        """A timestamp later than every ``updated`` in the database (call inside a write)."""
        latest = conn.execute("SELECT max(updated) FROM conversations").fetchone()[0] or 0.0
        now = max(time.time(), latest + 1e-6, self._last_stamp + 1e-6)
        self._last_stamp = now
        return now

    def _require_conversation(self, conn: sqlite3.Connection, conversation_id: int) -> None:
        if conn.execute("SELECT 1 FROM conversations WHERE id = ?", (conversation_id,)).fetchone() is None:
            raise NotFound(
                f"No chat with id {conversation_id!r}: it may have been deleted. "
                f"Pick one from list(), or create() a new one."
            )

    def _touch(self, conn: sqlite3.Connection, conversation_id: int) -> None:
        conn.execute("UPDATE conversations SET updated = ? WHERE id = ?", (self._stamp(conn), conversation_id))

    @staticmethod
    def _conversation(row: tuple) -> Conversation:
        return Conversation(row[0], row[1], row[2], json.loads(row[3]), row[4], row[5], bool(row[6]), row[7])

    @staticmethod
    def _message(row: tuple) -> Message:
        return Message(row[0], row[1], row[2], row[3], json.loads(row[4]), row[5], row[6])

    def _require_message(self, conn: sqlite3.Connection, conversation_id: int, message_id: int) -> tuple:
        row = conn.execute(f"SELECT {self._MSG_COLS} FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None or row[1] != conversation_id:
            self._require_conversation(conn, conversation_id)
            raise NotFound(
                f"Chat {conversation_id} has no message with id {message_id!r}. Use an id from "
                f"messages({conversation_id})."
            )
        return row

    @staticmethod
    def _insert_path(conn: sqlite3.Connection, conversation_id: int, rows: builtins.list[tuple]) -> None:
        """Add (role, content, meta JSON, created) rows to an empty chat as its one path, and show it."""
        parent = None
        for row in rows:
            parent = conn.execute(INSERT_MESSAGE, (conversation_id, *row, parent)).lastrowid
        conn.execute("UPDATE conversations SET leaf_id = ? WHERE id = ?", (parent, conversation_id))

    _CONV_COLS = "id, title, system_prompt, settings, created, updated, pinned, folder"
    _MSG_COLS = "id, conversation_id, role, content, meta, created, parent_id"

    # ---- conversations -------------------------------------------------------------------------

    def create(
        self, title: str = NEW_CHAT_TITLE, system_prompt: str = "", settings: dict | None = None
    ) -> Conversation:
        """Start a new, empty chat."""
        title = clean_title(title)
        if not isinstance(system_prompt, str):
            raise ValueError('system_prompt must be a string (use "" for none).')
        settings_json = to_json(settings, "settings")
        with self._write() as conn:
            now = self._stamp(conn)
            cur = conn.execute(
                "INSERT INTO conversations(title, system_prompt, settings, created, updated) VALUES (?, ?, ?, ?, ?)",
                (title, system_prompt, settings_json, now, now),
            )
            return Conversation(cur.lastrowid, title, system_prompt, json.loads(settings_json), now, now)

    def empty_chat(self, system_prompt: str = "") -> Conversation:
        """An empty chat with this system prompt, at the top of the list: the newest chat that is still empty
        and untitled (no messages, still "New chat"), started afresh, else a new one. New chat added another
        empty "New chat" to the list at each press."""
        if not isinstance(system_prompt, str):
            raise ValueError('system_prompt must be a string (use "" for none).')
        with self._write() as conn:
            row = conn.execute(
                """SELECT id FROM conversations c WHERE title = ?
                   AND NOT EXISTS (SELECT 1 FROM messages m WHERE m.conversation_id = c.id)
                   AND NOT EXISTS (SELECT 1 FROM chat_files f WHERE f.conversation_id = c.id)
                   AND NOT pinned AND folder = ''
                   ORDER BY updated DESC, id DESC LIMIT 1""",
                (NEW_CHAT_TITLE,),
            ).fetchone()
            now = self._stamp(conn)
            if row is None:
                cid = conn.execute(
                    "INSERT INTO conversations(title, system_prompt, settings, created, updated) "
                    "VALUES (?, ?, '{}', ?, ?)",
                    (NEW_CHAT_TITLE, system_prompt, now, now),
                ).lastrowid
            else:
                cid = row[0]
                conn.execute(
                    "UPDATE conversations SET system_prompt = ?, settings = '{}', updated = ? WHERE id = ?",
                    (system_prompt, now, cid),
                )
        return self.get(cid)

    def get(self, conversation_id: int) -> Conversation:
        """One chat; raises NotFound (a KeyError) if there is none with this id."""
        with self._read() as conn:
            row = conn.execute(
                f"SELECT {self._CONV_COLS} FROM conversations WHERE id = ?", (conversation_id,)
            ).fetchone()
            if row is None:
                self._require_conversation(conn, conversation_id)
            return self._conversation(row)

    def list(self, query: str = "") -> list[Conversation]:
        """Chats, pinned ones first, then the most recently updated. ``query`` matches titles and folders (any part
        of them, any case) and the words of any message in any branch (each word of the query, or a word's start:
        SQLite's full-text index)."""
        needle = (query or "").strip().casefold()
        order = "ORDER BY pinned DESC, updated DESC, id DESC"
        with self._read() as conn:
            if not needle:
                rows = conn.execute(f"SELECT {self._CONV_COLS} FROM conversations {order}").fetchall()
            else:
                rows = conn.execute(
                    f"""SELECT {self._CONV_COLS} FROM conversations c
                        WHERE pagoda_contains(c.title, :q) OR pagoda_contains(c.folder, :q)
                           OR c.id IN (SELECT m.conversation_id FROM messages m WHERE m.id IN
                                       (SELECT rowid FROM messages_fts WHERE messages_fts MATCH :words))
                        {order}""",
                    {"q": needle, "words": fts_query(query)},  # FTS folds case itself (casefold split ß, İ)
                ).fetchall()
        return [self._conversation(r) for r in rows]

    def place(self, conversation_id: int, *, pinned: bool | None = None, folder: str | None = None) -> None:
        """Pin a chat to the top of the list (or unpin it), and/or put it in a folder ("" for none). Only where it
        is listed changes: not when it was last updated."""
        if folder is not None and not isinstance(folder, str):
            raise ValueError('A folder is a name (use "" for none).')
        with self._write() as conn:
            self._require_conversation(conn, conversation_id)
            conn.execute(
                "UPDATE conversations SET pinned = coalesce(?, pinned), folder = coalesce(?, folder) WHERE id = ?",
                (
                    None if pinned is None else int(bool(pinned)),
                    None if folder is None else " ".join(folder.split()),
                    conversation_id,
                ),
            )

    def rename(self, conversation_id: int, title: str) -> None:
        """Give a chat a new title (whitespace runs collapse to one space)."""
        title = clean_title(title)
        with self._write() as conn:
            self._require_conversation(conn, conversation_id)
            conn.execute(
                "UPDATE conversations SET title = ?, updated = ? WHERE id = ?",
                (title, self._stamp(conn), conversation_id),
            )

    def delete(self, conversation_id: int) -> None:
        """Delete a chat and all its messages."""
        with self._write() as conn:
            self._require_conversation(conn, conversation_id)
            # Unlinked first: each message's cascade to its follower is a level of SQLite's trigger recursion,
            # which stops at 1,000 (a long chat failed to delete)
            conn.execute("UPDATE messages SET parent_id = NULL WHERE conversation_id = ?", (conversation_id,))
            conn.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
            self._forget_unused_files(conn)

    def update(self, conversation_id: int, *, system_prompt: str | None = None, settings: dict | None = None) -> None:
        """Replace a chat's system prompt and/or settings (None leaves that field as it is)."""
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ValueError('system_prompt must be a string (use "" for none).')
        settings_json = None if settings is None else to_json(settings, "settings")
        with self._write() as conn:
            self._require_conversation(conn, conversation_id)
            if system_prompt is None and settings_json is None:
                return
            conn.execute(
                "UPDATE conversations SET system_prompt = coalesce(?, system_prompt), "
                "settings = coalesce(?, settings), updated = ? WHERE id = ?",
                (system_prompt, settings_json, self._stamp(conn), conversation_id),
            )

    # ---- messages ------------------------------------------------------------------------------

    def add_message(
        self,
        conversation_id: int,
        role: str,
        content: str,
        meta: dict | None = None,
        *,
        after: int | None | Literal["end"] = "end",
    ) -> Message:
        """Add a message (role: system, user or assistant), show the path that ends with it, and bump the chat's
        ``updated``. It follows the shown path's last message ("end"), message `after` (a new branch beside the
        messages that follow that one already), or nothing (None: a first message, beside the chat's others)."""
        if role not in ROLES:
            raise ValueError(f"Unknown role {role!r}: use one of {', '.join(ROLES)}.")
        if not isinstance(content, str):
            raise ValueError(f"Message content must be a string, got {type(content).__name__}.")
        meta_json = to_json(meta, "meta")
        with self._write() as conn:
            self._require_conversation(conn, conversation_id)
            if after == "end":
                parent = shown_leaf(conn, conversation_id)
            elif after is None:
                parent = None
            else:
                parent = self._require_message(conn, conversation_id, after)[0]
            now = self._stamp(conn)
            cur = conn.execute(INSERT_MESSAGE, (conversation_id, role, content, meta_json, now, parent))
            conn.execute(
                "UPDATE conversations SET updated = ?, leaf_id = ? WHERE id = ?", (now, cur.lastrowid, conversation_id)
            )
            return Message(cur.lastrowid, conversation_id, role, content, json.loads(meta_json), now, parent)

    def update_message(self, message_id: int, content: str, meta: dict | None = None) -> None:
        """Replace a message's content (and its meta, if given). Committed before it returns."""
        if not isinstance(content, str):
            raise ValueError(f"Message content must be a string, got {type(content).__name__}.")
        meta_json = None if meta is None else to_json(meta, "meta")
        with self._write() as conn:
            cur = conn.execute(
                "UPDATE messages SET content = ?, meta = coalesce(?, meta) WHERE id = ?",
                (content, meta_json, message_id),
            )
            if cur.rowcount == 0:
                raise NotFound(
                    f"No message with id {message_id!r}: its chat may have been deleted. "
                    f"Stop writing to it, or add_message() again."
                )

    def messages(self, conversation_id: int) -> builtins.list[Message]:
        """The messages of the path the chat shows, oldest first (its other branches: ``siblings``, ``show``)."""
        with self._read() as conn:
            self._require_conversation(conn, conversation_id)
            leaf = shown_leaf(conn, conversation_id)
            return [] if leaf is None else [self._message(r) for r in path_rows(conn, leaf, self._MSG_COLS)]

    def path_to(self, conversation_id: int, message_id: int) -> builtins.list[Message]:
        """The messages from the chat's first down to `message_id`, oldest first."""
        with self._read() as conn:
            self._require_message(conn, conversation_id, message_id)
            return [self._message(r) for r in path_rows(conn, message_id, self._MSG_COLS)]

    def siblings(self, conversation_id: int, message_id: int) -> builtins.list[int]:
        """The ids of the message and its alternatives (the messages that follow the same one), oldest first."""
        with self._read() as conn:
            parent = self._require_message(conn, conversation_id, message_id)[6]
            return sibling_ids(conn, conversation_id, parent)

    def show(self, conversation_id: int, message_id: int) -> None:
        """Show the branch through `message_id`, down to the newest message under it (where the user wrote last in
        that branch). Only a view changes: the chat keeps its place in the list."""
        with self._write() as conn:
            self._require_message(conn, conversation_id, message_id)
            conn.execute(
                "UPDATE conversations SET leaf_id = ? WHERE id = ?", (newest_under(conn, message_id), conversation_id)
            )

    def branch(self, conversation_id: int, message_id: int) -> Conversation:
        """A new chat with this chat's title (marked as a branch), system prompt and settings, holding a copy of its
        path down to `message_id`; the chat itself stays as it is."""
        with self._write() as conn:
            self._require_message(conn, conversation_id, message_id)
            conv = self._conversation(
                conn.execute(f"SELECT {self._CONV_COLS} FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
            )
            now = self._stamp(conn)
            cid = conn.execute(
                "INSERT INTO conversations(title, system_prompt, settings, created, updated) VALUES (?, ?, ?, ?, ?)",
                (f"{conv.title} (branch)", conv.system_prompt, json.dumps(conv.settings), now, now),
            ).lastrowid
            self._insert_path(conn, cid, path_rows(conn, message_id, "role, content, meta, created"))
            self._copy_files(conn, conversation_id, cid)
        return self.get(cid)

    def drop_turns_before(self, conversation_id: int, message_id: int | None) -> None:
        """Take the messages above `message_id` off the path the chat shows (the oldest turns, when the context is
        full): it becomes a first message. None takes the whole path off. Each message taken off is deleted, unless
        another branch still goes through it."""
        with self._write() as conn:
            if message_id is None:
                self._require_conversation(conn, conversation_id)
                parent = shown_leaf(conn, conversation_id)
                conn.execute("UPDATE conversations SET leaf_id = NULL WHERE id = ?", (conversation_id,))
            else:
                parent = self._require_message(conn, conversation_id, message_id)[6]
                conn.execute("UPDATE messages SET parent_id = NULL WHERE id = ?", (message_id,))
            prune_unused_ancestors(conn, parent)
            self._touch(conn, conversation_id)

    # ---- export / import -----------------------------------------------------------------------

    def _snapshot(self, conversation_id: int, with_data: bool = False) -> tuple:
        """(The chat, its shown messages, its files), read as one; each file with its bytes when `with_data`."""
        with self._read():  # one consistent view: the lock is re-entrant
            files = self.chat_files(conversation_id)
            if with_data:
                files = [(f, self.file_data(f.sha256)) for f in files]
            return self.get(conversation_id), self.messages(conversation_id), files

    def export_markdown(self, conversation_id: int) -> str:
        """The chat as Markdown (app/chat_export.py)."""
        return chat_markdown(*self._snapshot(conversation_id))

    def export_json(self, conversation_id: int) -> str:
        """The chat, its messages and its files as JSON (app/chat_export.py); ``import_json`` reads it back."""
        return chat_json(*self._snapshot(conversation_id, with_data=True))

    def import_json(self, text: str) -> Conversation:
        """Create a new chat from ``export_json`` output (new ids; timestamps kept)."""
        chat = parse_chat_json(text)  # app/chat_export.py: ValueError says what is wrong
        with self._write() as conn:
            now = self._stamp(conn)
            cid = conn.execute(
                "INSERT INTO conversations(title, system_prompt, settings, created, updated) VALUES (?, ?, ?, ?, ?)",
                (chat.title, chat.system_prompt, chat.settings_json, chat.created, now),
            ).lastrowid
            self._insert_path(conn, cid, chat.rows)
            for f in chat.files:
                self._insert_file(conn, cid, f.name, f.sha256, f.data, f.text, f.keep_chars, now)
        return self.get(cid)

    # ---- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the database. Safe to call twice; later calls to other methods raise RuntimeError."""
        with self._lock:
            if self._conn is None:
                return
            try:
                self._conn.execute("PRAGMA optimize")
            except sqlite3.Error:
                pass
            self._conn.close()
            self._conn = None

    def __enter__(self) -> ConversationStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ConversationStore({str(self.path)!r})"
