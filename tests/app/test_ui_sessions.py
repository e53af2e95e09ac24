"""The page's per-session state and its running replies stay consistent under Gradio's worker threads and
on_unload's timer thread."""

import itertools
import sys
import threading
from types import SimpleNamespace

import pytest

import app.reply_events
from app.backend import ReplyDelta
from app.chat_settings import ChatSettings
from app.model_host import ModelHost
from app.reply_events import UNCHANGED
from app.sessions import Replies, Sessions
from app.store import ConversationStore
from app.ui import PagodaUI, slider_values
from tests.processes import wait_until


@pytest.fixture
def busy_switching():
    """Switch threads every few microseconds, so that an unguarded read-modify-write shows up in a short test."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def test_a_chat_recorded_while_its_page_ends_is_never_lost(busy_switching):
    """end() hands the session over whole: a chat lands either in what it returned or in a session opened
    after it, never in an ended one behind on_unload's back."""
    sessions = Sessions()
    pages = [f"page-{i}" for i in range(4)]
    ended: list[tuple[object, frozenset]] = []  # (the Session end() returned, its chats as end() returned it)
    ended_lock = threading.Lock()
    stop = threading.Event()
    next_chat = itertools.count()

    def record(page: str, chats: list[int]) -> None:
        for _ in range(10000):
            chat = next(next_chat)
            with sessions.edit(page) as session:
                session.viewing = chat
                session.chats.add(chat)
            chats.append(chat)

    def unload() -> None:
        for page in itertools.cycle(pages):
            if stop.is_set():
                return
            session = sessions.end(page)
            if session is not None:
                with ended_lock:
                    ended.append((session, frozenset(session.chats)))

    recorded: list[list[int]] = [[] for _ in range(8)]
    recorders = [threading.Thread(target=record, args=(pages[i % len(pages)], recorded[i])) for i in range(8)]
    unloaders = [threading.Thread(target=unload) for _ in range(2)]
    for t in [*unloaders, *recorders]:
        t.start()
    for t in recorders:
        t.join()
    stop.set()
    for t in unloaders:
        t.join()

    late = [(s.chats - at_end) for s, at_end in ended if s.chats != at_end]
    assert not late, f"chats recorded in a session after it ended: {late[:3]}"
    handed_over = [c for _, at_end in ended for c in at_end]
    live = [c for page in pages if (s := sessions.get(page)) is not None for c in s.chats]
    assert sorted(handed_over + live) == sorted(c for chats in recorded for c in chats)  # each exactly once


def test_get_is_a_copy_and_end_forgets():
    sessions = Sessions()
    with sessions.edit("page") as session:
        session.chats.add(1)
    copy = sessions.get("page")
    copy.chats.add(2)
    copy.viewing = 2
    assert sessions.get("page").chats == {1} and sessions.get("page").viewing is None
    assert sessions.end("page").chats == {1}
    assert sessions.get("page") is None and sessions.end("page") is None and len(sessions) == 0


def test_a_finished_reply_does_not_take_the_next_reply_of_its_chat_with_it():
    """A page still drawing the end of reply 1 may forget it after reply 2 of the same chat has started."""
    replies = Replies()
    first = SimpleNamespace(stream=SimpleNamespace(request_id="r1"))
    second = SimpleNamespace(stream=SimpleNamespace(request_id="r2"))
    replies.start(7, first, label="#7 one")
    replies.start(7, second, label="#7 one")
    replies.finish(7, first)
    assert replies.get(7) is second and replies.labels() == {"r2": "#7 one"}
    replies.finish(7, second)
    assert replies.get(7) is None and replies.labels() == {}


# ---- on_unload, through the real reply path -----------------------------------------------------------
class EndlessStream:
    """A reply that streams one token, then runs until it is cancelled."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.cancelled = threading.Event()

    def __iter__(self):
        yield ReplyDelta("Once", 1)
        self.cancelled.wait(30)
        yield ReplyDelta("", 0, finished=True, finish_reason="abort")

    def cancel(self) -> None:
        self.cancelled.set()

    def prefill_progress(self) -> None:
        return None


class EndlessBackend:
    kind, label, model, models, url, thinks = "local", "endless", "endless", ["endless"], None, False
    max_model_len = 512

    def __init__(self):
        self.streams: list[EndlessStream] = []

    def submit(self, messages: list[dict], settings: dict) -> tuple[EndlessStream, int]:
        self.streams.append(EndlessStream(f"req-{len(self.streams)}"))
        return self.streams[-1], 3

    def context_meter(self, system_prompt, stored) -> str:
        return ""

    def kv_panel(self, owners: dict[str, str]) -> str:
        return repr(sorted(owners.values()))

    def device_label(self) -> str:
        return ""

    def close(self) -> None:
        pass


def start_reply(ui: PagodaUI, conversation_id: int, page: SimpleNamespace):
    """Send a message from `page` and leave the reply running without following it (a closed tab)."""
    reply = ui.respond(conversation_id, "Tell me a story.", "", *slider_values(ChatSettings()), page)
    next(reply)  # the reply has started; the box is cleared
    reply.close()
    return ui.replies.get(conversation_id)


def test_an_ended_page_aborts_only_the_replies_it_started_that_nobody_watches(tmp_path, monkeypatch):
    monkeypatch.setattr(app.reply_events, "UNLOAD_GRACE_S", 0.05)
    monkeypatch.setattr(app.reply_events, "UNWATCHED_S", 30.0)  # "watched" stays true however slow the machine is
    host = ModelHost()
    host.backend = EndlessBackend()
    ui = PagodaUI(ConversationStore(tmp_path / "chats.db"), host)
    watched, unwatched, elsewhere = (ui.store.create().id for _ in range(3))
    closing, other = SimpleNamespace(session_hash="closing"), SimpleNamespace(session_hash="other")
    tasks = {
        watched: start_reply(ui, watched, closing),
        unwatched: start_reply(ui, unwatched, closing),
        elsewhere: start_reply(ui, elsewhere, other),
    }
    assert ui.sessions.get("closing").chats == {watched, unwatched}
    assert len(ui.replies.labels()) == 3
    tasks[unwatched].last_followed -= 60  # no page has drawn it for a minute
    tasks[elsewhere].last_followed -= 60  # likewise, but another page started it

    ui.on_unload(closing)

    assert ui.sessions.get("closing") is None and ui.sessions.get("other") is not None
    assert wait_until(tasks[unwatched].done.is_set, timeout=10)
    assert ui.store.messages(unwatched)[-1].meta["finish_reason"] == "abort"
    assert not wait_until(lambda: tasks[watched].done.is_set() or tasks[elsewhere].done.is_set(), timeout=0.5)
    for task in tasks.values():
        task.cancel()


@pytest.mark.parametrize("action", ["edit", "regenerate"])
def test_editing_or_regenerating_while_a_reply_streams_stops_it_first(tmp_path, action):
    host = ModelHost()
    host.backend = EndlessBackend()
    ui = PagodaUI(ConversationStore(tmp_path / "chats.db"), host)
    conv = ui.store.create().id
    page = SimpleNamespace(session_hash="page")
    running = start_reply(ui, conv, page)
    assert not running.done.is_set()
    drawing = ui.follow(conv, page)  # the page still draws the reply when the click comes
    next(drawing)
    question, first_reply = ui.store.messages(conv)
    if action == "edit":
        box = ui.edit_message(conv, question.id, page)
        assert box == "Tell me a story." and ui.sessions.get("page").editing == (conv, question.id)
        assert [m.id for m in ui.store.messages(conv)] == [question.id, first_reply.id]  # kept until a new one is sent
    else:
        regenerated = ui.regenerate(conv, "", *slider_values(ChatSettings()), page)
        next(regenerated)
        regenerated.close()
        shown = ui.store.messages(conv)
        assert [(m.role, m.content) for m in shown] == [("user", "Tell me a story."), ("assistant", "")]
        assert ui.store.siblings(conv, shown[-1].id) == [first_reply.id, shown[-1].id]  # the old one is a branch
        ui.replies.get(conv).cancel()
    assert running.done.is_set() and running.turn.error is None  # stopped, not failed on a deleted message
    assert host.backend.streams[0].cancelled.is_set()
    # Its drawing ends without a last frame: that frame, with the deleted rows, landed after the edit's
    assert next(drawing) == UNCHANGED and next(drawing, None) is None


def test_a_reply_cut_short_by_a_crash_says_interrupted_and_a_streaming_one_does_not(tmp_path):
    store = ConversationStore(tmp_path / "chats.db")
    conv = store.create().id
    store.add_message(conv, "user", "Tell me a story.")
    cut = store.add_message(conv, "assistant", "Once upon")
    # What a streaming reply saves every half second; the process then died before its last save.
    store.update_message(cut.id, "Once upon", {"finished": False, "ttft_s": 0.1, "output_tokens": 2})
    host = ModelHost()
    host.backend = EndlessBackend()
    ui = PagodaUI(store, host)  # a restart: nothing runs
    assert "interrupted: Pagoda stopped before this reply finished" in ui.history(conv)[-1]["content"]

    other = store.create().id
    running = start_reply(ui, other, SimpleNamespace(session_hash="page"))
    streaming = store.messages(other)[-1]
    store.update_message(streaming.id, "Once", {"finished": False, "ttft_s": 0.1})  # as its half-second saves
    assert "interrupted" not in ui.history(other)[-1]["content"]  # it is still streaming
    running.cancel()
    assert wait_until(running.done.is_set, timeout=10)
    assert "interrupted" not in ui.history(other)[-1]["content"]  # stopped: it says so, as before
