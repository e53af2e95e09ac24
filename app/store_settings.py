"""System-prompt presets (shared by every chat) and the app's own settings, a part of ConversationStore
(app/store.py), which provides the connection and the lock."""

from __future__ import annotations

import builtins
import json
import sqlite3
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from app.store_records import NotFound, Preset

__all__ = ["PresetsAndSettings"]


class PresetsAndSettings:
    """ConversationStore's preset and app-setting methods."""

    _read: Callable[[], AbstractContextManager[sqlite3.Connection]]
    _write: Callable[[], AbstractContextManager[sqlite3.Connection]]

    # ---- presets -------------------------------------------------------------------------------

    def presets(self) -> builtins.list[Preset]:
        """All system-prompt presets (shared by every chat), oldest first."""
        with self._read() as conn:
            rows = conn.execute("SELECT name, system_prompt FROM presets ORDER BY rowid").fetchall()
        return [Preset(*r) for r in rows]

    def save_preset(self, name: str, system_prompt: str) -> None:
        """Add a preset, or replace the prompt of the one with this name."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError("A preset needs a name: give it at least one visible character.")
        if not isinstance(system_prompt, str):
            raise ValueError("A preset's system_prompt must be a string.")
        with self._write() as conn:
            conn.execute(
                "INSERT INTO presets(name, system_prompt) VALUES (?, ?) "
                "ON CONFLICT(name) DO UPDATE SET system_prompt = excluded.system_prompt",
                (name.strip(), system_prompt),
            )

    def delete_preset(self, name: str) -> None:
        """Remove a preset by name."""
        if not isinstance(name, str):
            raise ValueError(f"A preset name is a string, got {type(name).__name__}.")
        with self._write() as conn:
            if conn.execute("DELETE FROM presets WHERE name = ?", (name.strip(),)).rowcount == 0:
                raise NotFound(f"No preset named {name!r}. Pick a name from presets().")

    # ---- app settings --------------------------------------------------------------------------

    def app_setting(self, key: str) -> Any:
        """The app setting stored under `key` (a JSON value), or None when none is."""
        with self._read() as conn:
            row = conn.execute("SELECT value FROM app_settings WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row is not None else None

    def set_app_setting(self, key: str, value: Any) -> None:
        """Store an app setting (any JSON value) under `key`, replacing what was there."""
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"App setting {key!r} must be a JSON value (str, number, bool, None, list, dict): {e}"
            ) from None
        with self._write() as conn:
            conn.execute(
                "INSERT INTO app_settings(key, value) VALUES (?, ?) "
                "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                (key, text),
            )
