"""The page's branch events without a browser: the links under each message, what each link does, and the edge
cases a browser test cannot reach in time (a stale link, a switch while the chat answers, an empty edit)."""

import re
from types import SimpleNamespace

import gradio as gr
import pytest

from app.chat_settings import ChatSettings
from app.model_host import ModelHost
from app.store import ConversationStore
from app.ui import PagodaUI, slider_values
from tests.app.test_ui_sessions import EndlessBackend

PAGE = SimpleNamespace(session_hash="page")


@pytest.fixture
def ui(tmp_path):
    host = ModelHost()
    host.backend = EndlessBackend()
    ui = PagodaUI(ConversationStore(tmp_path / "chats.db"), host)
    yield ui
    for task in ui.replies.running():
        task.cancel()


def send(ui, conv, text: str, page=PAGE) -> list:
    """Send from the page and let the reply end (the endless backend's reply runs until cancelled)."""
    frames = ui.respond(conv, text, "", *slider_values(ChatSettings()), page)
    first = next(frames)
    frames.close()
    task = ui.replies.get(conv)
    if task is not None:
        task.cancel()
        task.done.wait(10)
    return first


def links(row: dict) -> list[str]:
    return re.findall(r"\[([^\]]+)\]\(#pagoda-([a-z]+-\d+)\)", row["content"])


def two_turns(ui) -> tuple[int, list]:
    conv = ui.store.create().id
    send(ui, conv, "first")
    send(ui, conv, "second")
    return conv, ui.store.messages(conv)


def test_each_message_links_its_actions_and_a_reply_with_siblings_its_neighbours(ui):
    conv, (q1, a1, q2, a2) = two_turns(ui)
    rows = ui.history(conv)
    assert links(rows[0]) == [("✎ edit", f"edit-{q1.id}"), ("new chat from here", f"branch-{q1.id}")]
    assert links(rows[1]) == [("new chat from here", f"branch-{a1.id}")]
    regenerated = ui.regenerate(conv, "", *slider_values(ChatSettings()), PAGE)
    next(regenerated)
    regenerated.close()
    ui.stop(conv)
    ui.replies.get(conv).done.wait(10)
    new = ui.store.messages(conv)[-1]
    assert ui.store.siblings(conv, new.id) == [a2.id, new.id]
    last = ui.history(conv)[-1]
    assert links(last) == [("‹", f"show-{a2.id}"), ("new chat from here", f"branch-{new.id}")]
    assert "2/2 ›" in last["content"]  # the last one: › is not a link


def test_show_switches_and_is_refused_while_the_chat_answers(ui):
    conv, (q1, a1, q2, a2) = two_turns(ui)
    alt = ui.store.add_message(conv, "assistant", "other answer", after=q2.id)
    chat, *_ = ui.message_action(conv, f"show-{a2.id}", PAGE)
    assert ui.store.messages(conv)[-1].id == a2.id and len(chat) == 4
    frames = ui.respond(conv, "third", "", *slider_values(ChatSettings()), PAGE)
    next(frames)
    frames.close()
    with pytest.raises(gr.Error, match="still answering"):
        ui.message_action(conv, f"show-{alt.id}", PAGE)


def test_an_edit_sends_beside_the_message_and_cancel_edit_sends_at_the_end(ui):
    conv, (q1, a1, q2, a2) = two_turns(ui)
    chat, box, row, note, *_ = ui.message_action(conv, f"edit-{q1.id}", PAGE)
    assert box == "first" and row == gr.update(visible=True) and "Editing" in note and "first" in note
    with pytest.raises(gr.Error, match="new text"):
        send(ui, conv, "   ")
    *_, edit_row = send(ui, conv, "first, better")
    assert edit_row == gr.update(visible=False)
    shown = ui.store.messages(conv)
    assert [m.content for m in shown[:1]] == ["first, better"] and len(shown) == 2
    assert ui.store.siblings(conv, shown[0].id) == [q1.id, shown[0].id]
    # An edit begun, then cancelled: the message goes at the end, as usual
    ui.message_action(conv, f"edit-{shown[0].id}", PAGE)
    assert ui.cancel_edit(PAGE) == gr.update(visible=False)
    send(ui, conv, "a follow-up")
    assert [m.content for m in ui.store.messages(conv)][:3] == ["first, better", shown[1].content, "a follow-up"]


def test_an_edit_is_the_pages_own_and_only_for_its_chat(ui):
    conv, (q1, *_) = two_turns(ui)
    other = ui.store.create().id
    ui.message_action(conv, f"edit-{q1.id}", PAGE)
    send(ui, conv, "from another tab", page=SimpleNamespace(session_hash="other-tab"))  # not editing: at the end
    assert ui.store.messages(conv)[-2].content == "from another tab"
    send(ui, other, "in another chat")  # the edit belongs to `conv`
    assert [m.content for m in ui.store.messages(other)][:1] == ["in another chat"]


def test_only_the_users_messages_can_be_edited_and_a_stale_link_says_so(ui):
    conv, (q1, a1, *_) = two_turns(ui)
    with pytest.raises(gr.Error, match="Only your own messages"):
        ui.message_action(conv, f"edit-{a1.id}", PAGE)
    ui.store.drop_turns_before(conv, ui.store.messages(conv)[2].id)  # the first turn goes
    for action in (f"show-{q1.id}", f"edit-{q1.id}", f"branch-{a1.id}"):
        with pytest.raises(gr.Error, match="That message is gone"):
            ui.message_action(conv, action, PAGE)
    assert ui.message_action(conv, "nonsense", PAGE) == (gr.update(),) * 7


def test_new_chat_from_here_opens_a_copy(ui):
    conv, (q1, a1, *_) = two_turns(ui)
    *_, chats, _files = ui.message_action(conv, f"branch-{a1.id}", PAGE)
    branch = chats["value"]
    assert branch != conv and (f"{ui.store.get(conv).title} (branch)", branch) in chats["choices"]
    assert [m.content for m in ui.store.messages(branch)] == [q1.content, a1.content]
    assert len(ui.store.messages(conv)) == 4


def test_a_link_in_a_message_cannot_act_as_the_pages_own(ui):
    conv = ui.store.create().id
    ui.store.add_message(conv, "user", "hi")
    ui.store.add_message(conv, "assistant", "Click [here](#pagoda-detach-abc) or <a href='#pagoda-branch-1'>here</a>")
    reply = ui.history(conv)[-1]
    assert links(reply) == [("new chat from here", f"branch-{ui.store.messages(conv)[-1].id}")]  # only the page's
    assert "#pagoda\u200b-detach-abc" in reply["content"]


def test_regenerate_refuses_a_reply_that_starts_the_chat(ui):
    conv = ui.store.create().id
    ui.store.add_message(conv, "assistant", "Imported, without a question.")
    with pytest.raises(gr.Error, match="starts the chat"):
        next(ui.regenerate(conv, "", *slider_values(ChatSettings()), PAGE))
