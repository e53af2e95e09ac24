"""The message tree's queries, on a connection app/store.py holds (inside its lock): the path a chat shows, the
newest branch under a message, a message's siblings, and what a dropped turn leaves behind.

Each message has a parent (NULL for a chat's first), so a regenerated reply or an edited message is a sibling of
the one it replaces, and the old branch stays. A chat remembers the path it shows by its last message, leaf_id."""

from __future__ import annotations

import sqlite3

__all__ = ["newest_under", "path_rows", "prune_unused_ancestors", "shown_leaf", "sibling_ids"]


def shown_leaf(conn: sqlite3.Connection, conversation_id: int) -> int | None:
    """The last message of the path the chat shows; None when it shows none (a new chat, or one whose whole path
    was dropped: its next message is a first one)."""
    row = conn.execute("SELECT leaf_id FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
    return row[0] if row is not None else None


def path_rows(conn: sqlite3.Connection, message_id: int, cols: str) -> list[tuple]:
    """The rows (`cols` of messages) from the first message of the chat down to `message_id`, in that order."""
    return conn.execute(
        f"""WITH RECURSIVE path(id, depth) AS (
                SELECT id, 0 FROM messages WHERE id = ?
                UNION ALL
                SELECT m.parent_id, p.depth + 1 FROM messages m JOIN path p ON m.id = p.id
                WHERE m.parent_id IS NOT NULL
            )
            SELECT {cols} FROM messages JOIN path USING (id) ORDER BY depth DESC""",
        (message_id,),
    ).fetchall()


def newest_under(conn: sqlite3.Connection, message_id: int) -> int:
    """The newest message in the subtree under `message_id` (itself when it has none): the end of the branch
    written to last. Ids only grow, and a message is newer than its parent, so the newest is always a leaf."""
    return conn.execute(
        """WITH RECURSIVE below(id) AS (
               SELECT ? UNION ALL SELECT m.id FROM messages m JOIN below b ON m.parent_id = b.id
           )
           SELECT max(id) FROM below""",
        (message_id,),
    ).fetchone()[0]


def sibling_ids(conn: sqlite3.Connection, conversation_id: int, parent_id: int | None) -> list[int]:
    """The messages of the chat that follow `parent_id` (None: its first messages), oldest first."""
    rows = conn.execute(
        "SELECT id FROM messages WHERE conversation_id = ? AND parent_id IS ? ORDER BY id", (conversation_id, parent_id)
    ).fetchall()
    return [r[0] for r in rows]


def prune_unused_ancestors(conn: sqlite3.Connection, message_id: int | None) -> None:
    """Delete `message_id` and then each of its ancestors, from the bottom up, for as long as no other message
    follows the one at hand: a turn taken off a path goes, unless another branch still goes through it."""
    while message_id is not None:
        if conn.execute("SELECT 1 FROM messages WHERE parent_id = ? LIMIT 1", (message_id,)).fetchone() is not None:
            return
        parent = conn.execute("SELECT parent_id FROM messages WHERE id = ?", (message_id,)).fetchone()
        conn.execute("DELETE FROM messages WHERE id = ?", (message_id,))
        message_id = parent[0] if parent is not None else None
