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
    # A page opens Alpha (the buttons get its files); Beta and Gamma are opened or answered after it, on this
    # page or another: Alpha's buttons must still download Alpha.
    *_, alpha_md, alpha_json, _think, _json_output, _schema = ui.open(chats["Alpha"].id)
    files = {"Alpha": (alpha_md, alpha_json), **{n: ui.export_files(chats[n].id) for n in ("Beta", "Gamma")}}

    for name, (md_path, json_path) in files.items():
        chat = chats[name]
        data = json.loads(Path(json_path).read_text(encoding="utf-8"))
        assert (data["id"], data["title"]) == (chat.id, store.get(chat.id).title)
        assert [(m["role"], m["content"]) for m in data["messages"]] == [("user", f"{name} question?"),
                                                                           ("assistant", f"{name} answer.")]
        md = Path(md_path).read_text(encoding="utf-8")
        assert md.startswith(f"# {store.get(chat.id).title}\n") and f"{name} question?" in md
        assert not any(f"{other} question?" in md for other in chats if other != name)
    assert Path(files["Gamma"][1]).name == "Gamma.json"
    store.close()
