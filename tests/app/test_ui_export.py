"""The Export buttons' files: each holds the chat it was made for, whichever chats are exported after it."""

import gc
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pytest

from app.model_host import ModelHost
from app.store import ConversationStore
from app.ui import PagodaUI


def test_each_chats_export_files_hold_that_chat_and_no_other(tmp_path):
    store = ConversationStore(tmp_path / "chats.db")
    ui = PagodaUI(store, ModelHost())
    chats = {}
    for name in ("Alpha", "Beta", "Gamma"):  # all titled "New chat", as chats are until their first message
        chat = store.create()
        store.add_message(chat.id, "user", f"{name} question?")
        store.add_message(chat.id, "assistant", f"{name} answer.")
        chats[name] = chat
    store.rename(chats["Gamma"].id, "Gamma")
    # Each chat exported in turn, as a page's Export buttons make the files (at the click, for the chat chosen):
    # a later export must not change an earlier chat's files, nor give one chat another's messages.
    files = {name: (ui.export(chats[name].id, "md"), ui.export(chats[name].id, "json")) for name in chats}

    for name, (md_path, json_path) in files.items():
        chat = chats[name]
        data = json.loads(Path(json_path).read_text(encoding="utf-8"))
        assert (data["id"], data["title"]) == (chat.id, store.get(chat.id).title)
        assert [(m["role"], m["content"]) for m in data["messages"]] == [
            ("user", f"{name} question?"),
            ("assistant", f"{name} answer."),
        ]
        md = Path(md_path).read_text(encoding="utf-8")
        assert md.startswith(f"# {store.get(chat.id).title}\n") and f"{name} question?" in md
        assert not any(f"{other} question?" in md for other in chats if other != name)
    assert Path(files["Gamma"][1]).name == "Gamma.json"
    store.close()


def test_an_export_clicked_after_a_rename_waits_for_it_whichever_request_arrives_first(tmp_path):
    """Rename and Export reach the server as two requests, in either order (CI saw the Export first, and the file had
    the old title): the page numbers its Renames, and an Export waits for those clicked before it."""
    store = ConversationStore(tmp_path / "chats.db")
    ui = PagodaUI(store, ModelHost())
    chat = store.create().id
    page = SimpleNamespace(session_hash="page-1")
    files = []
    export = threading.Thread(target=lambda: files.append(ui.export(chat, "json", renames_before=1, request=page)))
    export.start()  # the Export request came first
    export.join(timeout=0.3)
    assert export.is_alive(), "the Export did not wait for the Rename clicked before it"
    ui.rename(chat, "Lighthouses", number=1, request=page)
    export.join(timeout=10)
    assert json.loads(Path(files[0]).read_text(encoding="utf-8"))["title"] == "Lighthouses"
    assert Path(files[0]).name == "Lighthouses.json"
    # A Rename refused (an empty title) still lets the Export clicked after it go on, with the title unchanged
    with pytest.raises(gr.Error, match="cannot be empty"):
        ui.rename(chat, "  ", number=2, request=page)
    assert Path(ui.export(chat, "md", renames_before=2, request=page)).name == "Lighthouses.md"
    store.close()


def test_exported_files_leave_with_the_app(tmp_path):
    """Exported chats are private: the folder that holds them is removed when the UI goes (and at exit)."""
    store = ConversationStore(tmp_path / "chats.db")
    ui = PagodaUI(store, ModelHost())
    chat = store.create()
    store.add_message(chat.id, "user", "a private question")
    folder = Path(ui.export(chat.id, "md")).parent.parent
    assert folder.is_dir() and folder == ui.export_dir
    del ui
    gc.collect()
    assert not folder.exists()
    store.close()
