"""The SQLite schema of Pagoda's store, and its migrations: a database is brought up to this Pagoda's version as
it opens, inside one transaction, and one written by a newer Pagoda (or not by Pagoda) is refused with what to do."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

__all__ = ["DEFAULT_PRESETS", "MIGRATIONS", "SCHEMA_VERSION", "SchemaError", "migrate"]

DEFAULT_PRESETS: tuple[tuple[str, str], ...] = (
    ("Helpful assistant", "You are a helpful assistant."),
    (
        "Concise",
        "You are a helpful assistant. Answer briefly and directly: short sentences, no preamble, "
        "no repetition of the question. Use a list only when it is clearer than prose.",
    ),
    (
        "Coder",
        "You are an expert programmer. Give correct, idiomatic, runnable code in fenced code blocks "
        "with the language named. Explain only what is not obvious from the code, and point out "
        "edge cases and bugs you notice.",
    ),
)


class SchemaError(RuntimeError):
    """The file is not a Pagoda database, or was written by a newer Pagoda."""


def _create_v1(conn: sqlite3.Connection) -> None:
    conn.execute("""
        CREATE TABLE conversations (
            id            INTEGER PRIMARY KEY AUTOINCREMENT,
            title         TEXT NOT NULL,
            system_prompt TEXT NOT NULL DEFAULT '',
            settings      TEXT NOT NULL DEFAULT '{}',
            created       REAL NOT NULL,
            updated       REAL NOT NULL
        )""")
    conn.execute("CREATE INDEX conversations_by_updated ON conversations(updated DESC, id DESC)")
    conn.execute("""
        CREATE TABLE messages (
            id              INTEGER PRIMARY KEY AUTOINCREMENT,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            role            TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
            content         TEXT NOT NULL,
            meta            TEXT NOT NULL DEFAULT '{}',
            created         REAL NOT NULL
        )""")
    conn.execute("CREATE INDEX messages_by_conversation ON messages(conversation_id, id)")
    conn.execute("""
        CREATE TABLE presets (
            name          TEXT PRIMARY KEY,
            system_prompt TEXT NOT NULL
        )""")
    conn.executemany("INSERT INTO presets(name, system_prompt) VALUES (?, ?)", DEFAULT_PRESETS)


def _add_app_settings_v2(conn: sqlite3.Connection) -> None:
    """The app's own settings, one JSON value per key (the model loaded last, app/last_model.py)."""
    conn.execute("CREATE TABLE app_settings (key TEXT PRIMARY KEY, value TEXT NOT NULL)")


def _message_tree_v3(conn: sqlite3.Connection) -> None:
    """Messages form a tree: each follows its parent (NULL for a first message), so a regenerated reply or an edited
    message is a sibling and the old branch stays. A chat shows one path, remembered by its last message (leaf_id).
    Every message of an older database is put on its chat's one path, in the order it was written."""
    conn.execute("ALTER TABLE messages ADD COLUMN parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE")
    conn.execute("ALTER TABLE conversations ADD COLUMN leaf_id INTEGER REFERENCES messages(id) ON DELETE SET NULL")
    conn.execute("""
        UPDATE messages SET parent_id = (
            SELECT max(p.id) FROM messages p WHERE p.conversation_id = messages.conversation_id AND p.id < messages.id
        )""")
    conn.execute(
        "UPDATE conversations SET leaf_id = (SELECT max(id) FROM messages WHERE conversation_id = conversations.id)"
    )
    conn.execute("CREATE INDEX messages_by_parent ON messages(parent_id, id)")


def _chat_files_v4(conn: sqlite3.Connection) -> None:
    """Files attached to chats, kept once per content (sha256) however many chats attach them: the bytes as
    given and their text. A chat's document may be cut to its first keep_chars characters (the user's choice, when
    the whole did not fit the context)."""
    conn.execute("""
        CREATE TABLE files (
            sha256  TEXT PRIMARY KEY,
            data    BLOB NOT NULL,
            text    TEXT NOT NULL,
            created REAL NOT NULL
        )""")
    conn.execute("""
        CREATE TABLE chat_files (
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            sha256          TEXT NOT NULL REFERENCES files(sha256),
            name            TEXT NOT NULL,
            keep_chars      INTEGER,
            added           REAL NOT NULL,
            PRIMARY KEY (conversation_id, sha256)
        )""")
    conn.execute("CREATE INDEX chat_files_by_file ON chat_files(sha256)")


def _uids_v5(conn: sqlite3.Connection) -> None:
    """A uid for every chat and message, unique (a message's within its chat), so that an archive imported twice
    (app/store_archive.py) finds what it already holds. Triggers give a new row one, so no INSERT has to."""
    for table in ("conversations", "messages"):
        conn.execute(f"ALTER TABLE {table} ADD COLUMN uid TEXT")
        conn.execute(f"UPDATE {table} SET uid = lower(hex(randomblob(16)))")
        conn.execute(f"""
            CREATE TRIGGER {table}_uid AFTER INSERT ON {table} WHEN NEW.uid IS NULL BEGIN
                UPDATE {table} SET uid = lower(hex(randomblob(16))) WHERE id = NEW.id;
            END""")
    conn.execute("CREATE UNIQUE INDEX conversations_by_uid ON conversations(uid)")
    conn.execute("CREATE UNIQUE INDEX messages_by_uid ON messages(conversation_id, uid)")


def _search_pins_folders_v6(conn: sqlite3.Connection) -> None:
    """Search over every message's words (FTS5, an index the triggers keep in step with the messages, built here
    from those there are), and chats pinned to the top of the list or put in a folder."""
    conn.execute("""
        CREATE VIRTUAL TABLE messages_fts USING fts5(
            content, content='messages', content_rowid='id', tokenize='unicode61 remove_diacritics 2'
        )""")
    conn.execute("""
        CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
            INSERT INTO messages_fts(rowid, content) VALUES (NEW.id, NEW.content);
        END""")
    conn.execute("""
        CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
            INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', OLD.id, OLD.content);
        END""")
    conn.execute("""
        CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages BEGIN
            INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', OLD.id, OLD.content);
            INSERT INTO messages_fts(rowid, content) VALUES (NEW.id, NEW.content);
        END""")
    conn.execute("INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')")
    conn.execute("ALTER TABLE conversations ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0")
    conn.execute("ALTER TABLE conversations ADD COLUMN folder TEXT NOT NULL DEFAULT ''")


# MIGRATIONS[v] upgrades a database at user_version v to v + 1, inside one transaction.
# Version 0 is a brand-new file. To change the schema, append a function and bump nothing else.
MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [
    _create_v1,
    _add_app_settings_v2,
    _message_tree_v3,
    _chat_files_v4,
    _uids_v5,
    _search_pins_folders_v6,
]
SCHEMA_VERSION = len(MIGRATIONS)


def migrate(conn: sqlite3.Connection, path: Path | str) -> None:
    """Bring the database open on `conn` (inside a write transaction) to SCHEMA_VERSION. `path` names it in errors."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise SchemaError(
            f"{path} has schema version {version}, but this Pagoda only understands up to "
            f"version {SCHEMA_VERSION}: it was written by a newer Pagoda. Upgrade Pagoda, or set "
            f"PAGODA_HOME to another folder to start a separate history."
        )
    if version == 0:
        tables = conn.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0]
        if tables:
            raise SchemaError(
                f"{path} is an SQLite database but not a Pagoda one. Move it aside, or set "
                f"PAGODA_HOME to another folder."
            )
    for v in range(version, SCHEMA_VERSION):
        MIGRATIONS[v](conn)
        conn.execute(f"PRAGMA user_version = {v + 1}")
