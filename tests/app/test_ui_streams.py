"""A page's reply streams draw only into the chat it shows, whatever order events arrive in."""
import threading
import time
from types import SimpleNamespace

import gradio as gr

from app.chat import Turn
from app.model_host import ModelHost
from app.store import ConversationStore
from app.ui import UNCHANGED, PagodaUI
from tests.processes import wait_until


def streaming_task(text: str) -> SimpleNamespace:
    """Stands in for a ReplyTask whose reply is still being written."""
    return SimpleNamespace(done=threading.Event(), turn=Turn(prompt_tokens=3, text=text), withdrawn=False,
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
    html, header, titles, _title = ui.panels("", page)  # on the Chat tab: no grid rendered; header and titles once
    assert html == unchanged and "Pagoda" in header and titles["choices"] == ui.conversation_choices()
    ui.show_kv_tab(True, page)
    assert ui.panels("", page) == ("<grid 1>", unchanged, unchanged, unchanged)
    assert ui.panels("", page) == (unchanged,) * 4  # the same grid again: nothing sent
    assert ui.panels("", page)[0] == "<grid 2>"
    ui.show_kv_tab(False, page)
    assert ui.panels("", page) == (unchanged,) * 4  # hidden: not even rendered (the iterator is spent)


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


def test_a_long_prompt_shows_how_much_is_read_and_the_meter_counts_the_reply_as_it_streams(tmp_path):
    """A 4,400-token paste was 8.5 s of an empty bubble, and the meter stayed at the count before the message."""
    ui, first, _ = make_ui(tmp_path)
    ui.host.backend = SimpleNamespace(max_model_len=8192)
    progress = [(2048, 4400)]
    task = streaming_task("")
    task.turn = Turn(prompt_tokens=4400)
    task.stream = SimpleNamespace(request_id="r", prefill_progress=lambda: progress[0])
    ui.replies.start(first, task, label="#1 lighthouse")
    frames = ui.follow(first, None)
    chatbot, *_, meter = next(frames)
    assert chatbot[-1] == {"role": "assistant", "content": "*Reading the prompt: 2,048 / 4,400 tokens…*"}
    assert meter == "Context: 4,400 / 8,192 tokens"
    progress[0] = None  # the first token is out
    task.turn = Turn(prompt_tokens=4400, text="Once", output_tokens=3)
    chatbot, *_, meter = next(frames)
    assert chatbot[-1]["content"] == "Once" and meter == "Context: 4,403 / 8,192 tokens"


def test_a_short_prompt_shows_no_progress_line_and_a_servers_reply_leaves_the_meter(tmp_path):
    ui, first, _ = make_ui(tmp_path)
    ui.host.backend = SimpleNamespace(max_model_len=None)
    task = streaming_task("")
    task.turn = Turn(prompt_tokens=0)  # a server counts the prompt itself, at the end
    task.stream = SimpleNamespace(request_id="r", prefill_progress=lambda: (0, 40))
    ui.replies.start(first, task, label="#1 lighthouse")
    chatbot, *_, meter = next(ui.follow(first, None))
    assert chatbot[-1]["content"] == "" and meter == gr.update()


def test_stop_shows_the_reply_as_it_ended_with_its_stopped_line(tmp_path):
    """Stop ends the page's drawing of the stream too: the last frame stayed without its "stopped" line."""
    from app.backend import ReplyDelta
    from app.chat import ReplyTask

    class EndlessStream:
        request_id = "r"

        def __init__(self):
            self.cancelled = threading.Event()

        def __iter__(self):
            while not self.cancelled.wait(0.02):
                yield ReplyDelta("word ", 1)

        def cancel(self):
            self.cancelled.set()

        def prefill_progress(self):
            return None

    ui, first, _ = make_ui(tmp_path)
    reply = ui.store.messages(first)[-1]
    task = ReplyTask(EndlessStream(), ui.store, reply.id, 12)
    ui.replies.start(first, task, label="#1 lighthouse")
    assert wait_until(lambda: task.turn.output_tokens >= 3, timeout=10)
    chatbot, _meter = ui.stop_and_show(first)
    assert chatbot[-1]["content"].startswith("word word word")
    assert chatbot[-1]["content"].endswith("· stopped</sub>")
    assert ui.replies.get(first) is None  # done with: the chat can answer again


def test_a_reply_stopped_before_its_first_token_says_so():
    from app.chat import summary

    assert summary({"finish_reason": "abort", "ttft_s": None}) == "stopped before its first token"
    assert summary({"finish_reason": None, "ttft_s": None}) == ""  # still reading its prompt
