"""A page's reply streams draw only into the chat it shows, whatever order events arrive in."""
import threading
import time
from types import SimpleNamespace

import gradio as gr

from app.chat import Turn
from app.model_host import ModelHost
from app.store import ConversationStore
from app.ui import UNCHANGED, PagodaUI


def streaming_task(text: str) -> SimpleNamespace:
    """Stands in for a ReplyTask whose reply is still being written."""
    return SimpleNamespace(done=threading.Event(), turn=Turn(prompt_tokens=3, text=text),
                           last_followed=time.time(), stream=SimpleNamespace(request_id="r"))


def make_ui(tmp_path):
    store = ConversationStore(tmp_path / "chats.db")
    ui = PagodaUI(store, ModelHost())
    first, second = store.create(title="lighthouse"), store.create(title="cat")
    store.add_message(first.id, "user", "Tell me about the lighthouse.")
    store.add_message(first.id, "assistant", "")
    return ui, first.id, second.id


def test_a_stream_stops_drawing_once_its_page_opens_another_chat(tmp_path):
    ui, first, second = make_ui(tmp_path)
    page = SimpleNamespace(session_hash="page-1")
    ui.open(first, page)
    ui.replies.start(first, streaming_task("Once upon a time"), label="#1 lighthouse")
    stream = ui.follow(first, page)
    chatbot = next(stream)[0]
    assert chatbot[-1] == {"role": "assistant", "content": "Once upon a time"}
    assert chatbot[0]["content"] == "Tell me about the lighthouse."

    ui.open(second, page)  # the user clicks the other chat; this stream's cancel has not landed yet
    assert next(stream) == UNCHANGED  # it leaves the open chat's chatbot alone
    assert next(stream, None) is None  # and ends
    assert not ui.replies.get(first).done.is_set()  # the reply itself runs on in the background


def test_another_page_and_api_clients_still_see_the_stream(tmp_path):
    ui, first, second = make_ui(tmp_path)
    ui.replies.start(first, streaming_task("Once"), label="#1 lighthouse")
    ui.open(second, SimpleNamespace(session_hash="other-page"))
    watcher = SimpleNamespace(session_hash="watcher")
    ui.open(first, watcher)
    api_client = SimpleNamespace(session_hash="api")  # opens no chat
    for request in (watcher, api_client, None):
        assert next(ui.follow(first, request))[0][-1]["content"] == "Once"


def test_a_closed_page_forgets_which_chat_it_showed(tmp_path):
    ui, first, second = make_ui(tmp_path)
    page = SimpleNamespace(session_hash="page-1")
    ui.open(second, page)
    ui.on_unload(page)
    assert ui.sessions.get("page-1") is None


def test_the_kv_grid_is_sent_only_to_a_page_showing_it_and_only_when_it_changed(tmp_path, monkeypatch):
    ui, _, _ = make_ui(tmp_path)
    grids = iter(["<grid 1>", "<grid 1>", "<grid 2>"])
    monkeypatch.setattr(ui, "kv_panel", lambda: next(grids))
    page = SimpleNamespace(session_hash="page-1")
    unchanged = gr.update()
    html, header, titles = ui.panels("", page)  # on the Chat tab: no grid rendered; header and titles once
    assert html == unchanged and "Pagoda" in header and titles["choices"] == ui.conversation_choices()
    ui.show_kv_tab(True, page)
    assert ui.panels("", page) == ("<grid 1>", unchanged, unchanged)
    assert ui.panels("", page) == (unchanged, unchanged, unchanged)  # the same grid again: nothing sent
    assert ui.panels("", page)[0] == "<grid 2>"
    ui.show_kv_tab(False, page)
    assert ui.panels("", page) == (unchanged, unchanged, unchanged)  # hidden: not even rendered (the iterator is spent)


def test_a_new_chat_takes_its_title_from_the_first_message_while_the_reply_streams(tmp_path):
    ui, _, _ = make_ui(tmp_path)
    fresh = ui.store.create().id  # "New chat"
    page = SimpleNamespace(session_hash="page-1")
    ui.panels("", page)
    ui._title_from_first_message(fresh, "Tell me about the cat of the lighthouse keeper")
    titles = ui.panels("", page)[2]["choices"]
    assert ("Tell me about the cat of the lighthouse …", fresh) in titles
    # Only the list changes (filtered by the search box), never the open chat.
    assert "value" not in ui.panels("cat", page)[2]
