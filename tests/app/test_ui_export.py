"""The Export buttons' files: each holds the chat it was made for, whichever chats are exported after it."""

import json
from pathlib import Path

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
