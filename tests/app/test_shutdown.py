"""Ctrl-C or a SIGTERM while a reply streams (issue 28, item 5): the app exits within seconds and the reply reads
"interrupted" (Pagoda stopped under it), not "stopped" as if the user had pressed Stop."""

import signal
import threading
import time

import pytest

from app.backend import ReplyDelta
from app.chat import ReplyTask
from app.model_host import ModelHost
from app.store import ConversationStore, default_db_path
from app.ui import PagodaUI
from tests.app.app_process import AppProcess
from tests.app.chat_text import without_links
from tests.processes import wait_until

pytestmark = pytest.mark.timeout(600)
EXIT_WITHIN_S = 5.0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_reply_exits_promptly_and_the_reply_reads_interrupted(
    bundled_model, tmp_path, monkeypatch, signum
):
    app = AppProcess(bundled_model, tmp_path)
    client = app.start()
    try:
        conv = client.predict("", "", api_name="/new_chat")["value"]
        client.submit(
            conv, "Write a very long poem about the sea.", "", 0.0, 1.0, -1, 0.0, 1.0, 2000, api_name="/respond"
        )
        written = lambda: [m["content"] for m in client.predict(conv, api_name="/messages")][1:2] not in ([], [""])
        assert wait_until(written, timeout=120)
        sent = time.monotonic()
        app.proc.send_signal(signum)
        app.proc.wait(60)
        took = time.monotonic() - sent
    finally:
        app.kill()
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path))
    with ConversationStore(default_db_path()) as store:
        reply = store.messages(conv)[-1]
    log = app.log.read_text()
    assert took < EXIT_WITHIN_S, f"took {took:.1f} s to exit:\n{log[-3000:]}"
    assert reply.role == "assistant" and reply.content
    assert reply.meta.get("finish_reason") != "abort", reply.meta  # not "stopped", as by the Stop button
    assert reply.meta.get("finished") is False, reply.meta  # the chat reads "interrupted: Pagoda stopped …"
    assert "Traceback" not in log, log[-3000:]


class EndlessStream:
    """A reply that writes until it is cancelled, then ends with "abort", as the engine's do."""

    request_id = "r"

    def __init__(self):
        self.cancelled = threading.Event()

    def __iter__(self):
        while not self.cancelled.wait(0.02):
            yield ReplyDelta("wave ", 1)
        yield ReplyDelta("", 0, finished=True, finish_reason="abort")

    def cancel(self):
        self.cancelled.set()

    def prefill_progress(self):
        return None


def test_shutting_down_keeps_the_replies_streaming_as_interrupted_and_stop_still_says_stopped(tmp_path, monkeypatch):
    ui = PagodaUI(ConversationStore(tmp_path / "chats.db"), ModelHost())
    saved = []  # every write of a reply, in order: the process may end after any of them
    write = ui.store.update_message
    monkeypatch.setattr(ui.store, "update_message", lambda *args: (saved.append(args), write(*args))[1])
    chats = [ui.store.create().id for _ in range(3)]
    tasks = []
    for chat in chats:
        reply = ui.store.add_message(chat, "assistant", "")
        tasks.append(ReplyTask(EndlessStream(), ui.store, reply.id, 12))
        ui.replies.start(chat, tasks[-1], label=f"#{chat}")
    assert wait_until(lambda: all(task.turn.output_tokens >= 2 for task in tasks), timeout=10)
    ui.stop_and_show(chats[0])  # the user's Stop, before the shutdown
    before = len(saved)
    ui.interrupt_replies()
    assert saved[before:] and all(meta["finished"] is False for _, _, meta in saved[before:])  # never "abort"
    assert all(task.done.is_set() for task in tasks)
    stopped, *interrupted = [without_links(ui.history(chat)[-1]["content"]) for chat in chats]
    assert stopped.startswith("wave wave") and stopped.endswith("· stopped</sub>")
    for shown in interrupted:
        assert shown.startswith("wave wave") and "<sub>interrupted: Pagoda stopped before this reply finished" in shown
        assert "stopped</sub>" not in shown
