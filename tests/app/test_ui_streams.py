"""A page's reply streams draw only into the chat it shows, whatever order events arrive in."""

import threading
import time
from types import SimpleNamespace

import gradio as gr

from app.chat import Turn
from app.model_host import ModelHost
from app.reply_events import UNCHANGED
from app.store import ConversationStore
from app.ui import PagodaUI
from tests.app.chat_text import without_links
from tests.processes import wait_until


def streaming_task(text: str) -> SimpleNamespace:
    """Stands in for a ReplyTask whose reply is still being written."""
    return SimpleNamespace(
        done=threading.Event(),
        turn=Turn(prompt_tokens=3, text=text),
        withdrawn=False,
        last_followed=time.time(),
        stream=SimpleNamespace(request_id="r"),
        calling=False,  # no tool calls between rounds
        version=0,
    )


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
    assert without_links(chatbot[0]["content"]) == "Tell me about the lighthouse."

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
    chatbot, *_, meter, _edit = next(frames)
    assert chatbot[-1] == {"role": "assistant", "content": "*Reading the prompt: 2,048 / 4,400 tokens…*"}
    assert meter == "Context: 4,400 / 8,192 tokens"
    progress[0] = None  # the first token is out
    task.turn = Turn(prompt_tokens=4400, text="Once", output_tokens=3)
    chatbot, *_, meter, _edit = next(frames)
    assert chatbot[-1]["content"] == "Once" and meter == "Context: 4,403 / 8,192 tokens"


def test_a_short_prompt_shows_no_progress_line_and_a_servers_reply_leaves_the_meter(tmp_path):
    ui, first, _ = make_ui(tmp_path)
    ui.host.backend = SimpleNamespace(max_model_len=None)
    task = streaming_task("")
    task.turn = Turn(prompt_tokens=0)  # a server counts the prompt itself, at the end
    task.stream = SimpleNamespace(request_id="r", prefill_progress=lambda: (0, 40))
    ui.replies.start(first, task, label="#1 lighthouse")
    chatbot, *_, meter, _edit = next(ui.follow(first, None))
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
    assert without_links(chatbot[-1]["content"]).endswith("· stopped</sub>")
    assert ui.replies.get(first) is None  # done with: the chat can answer again


def test_a_reply_stopped_before_its_first_token_says_so():
    from app.chat import summary

    assert summary({"finish_reason": "abort", "ttft_s": None}) == "stopped before its first token"
    assert summary({"finish_reason": None, "ttft_s": None}) == ""  # still reading its prompt


class ScriptedStream:
    """A reply stream that gives these increments and then ends."""

    request_id = "r"

    def __init__(self, *deltas):
        self.deltas, self.cancelled = deltas, False

    def __iter__(self):
        yield from self.deltas

    def cancel(self):
        self.cancelled = True

    def prefill_progress(self):
        return None


def test_a_cut_reply_is_saved_unfinished_and_a_finished_one_finished(tmp_path, monkeypatch):
    """What the store keeps of a reply that finished, of one the process died under (its last save was a
    mid-stream one) and of one stopped, and what a restarted app then shows for each."""
    import app.chat
    from app.backend import ReplyDelta
    from app.chat import stream_reply

    monkeypatch.setattr(app.chat, "SAVE_EVERY_S", 0.0)  # every increment is saved, as a long reply's are
    store = ConversationStore(tmp_path / "chats.db")
    conv = store.create().id

    def new_reply() -> int:
        store.add_message(conv, "user", "Tell me a story.")
        return store.add_message(conv, "assistant", "").id

    finished = new_reply()
    list(
        stream_reply(
            ScriptedStream(ReplyDelta("Once", 1), ReplyDelta(" upon.", 1, finished=True, finish_reason="stop")),
            store,
            finished,
            5,
        )
    )
    interrupted = new_reply()
    dying = stream_reply(
        ScriptedStream(*[ReplyDelta(w, 1) for w in ("Once", " upon", " a", " time")]), store, interrupted, 5
    )
    next(dying), next(dying)  # the process dies here: nothing after this runs, not even stream_reply's cleanup
    stopped = new_reply()
    stopping = stream_reply(
        ScriptedStream(*[ReplyDelta(w, 1) for w in ("Once", " upon", " a", " time")]), store, stopped, 5
    )
    next(stopping), next(stopping)
    stopping.close()  # the page stops reading: Stop, or the chat deleted

    restarted = ConversationStore(tmp_path / "chats.db")  # what the next start reads
    saved = {m.id: (m.content, m.meta) for m in restarted.messages(conv)}
    assert saved[finished][0] == "Once upon." and saved[finished][1]["finished"] is True
    assert saved[finished][1]["finish_reason"] == "stop"
    assert saved[interrupted][0] == "Once upon" and saved[interrupted][1].get("finished") is False
    assert saved[stopped][0] == "Once upon" and saved[stopped][1]["finish_reason"] == "abort"
    assert saved[stopped][1]["finished"] is True  # stopped is an end: it is not shown as interrupted

    shown = [
        without_links(row["content"])
        for row in PagodaUI(restarted, ModelHost()).history(conv)
        if row["role"] == "assistant"
    ]
    assert "interrupted" not in shown[0] and "stopped" not in shown[0]
    assert "interrupted: Pagoda stopped before this reply finished" in shown[1]
    assert shown[2].endswith("· stopped</sub>") and "interrupted" not in shown[2]
    dying.close()
    restarted.close()
