"""A chat that outgrows the context: the message that does not fit stays out of the chat (and in the box), and
"Drop the oldest turn" drops it and sends the message, so the one offered action finishes the job."""

import pytest

from app.model_host import ModelHost
from app.store import ConversationStore
from app.ui import PagodaUI

GREEDY = (0.0, 1.0, -1, 0.0, 1.0)  # temperature, top_p, top_k, min_p, repetition_penalty
WORDS = "the quick brown fox jumps over the lazy dog " * 4  # 93 tokens of the tests' tokenizer


@pytest.fixture(scope="module")
def ui(tiny_llama, tmp_path_factory):
    host = ModelHost()
    host.load(str(tiny_llama), label="tiny", wait=True, dtype="float32", num_kvcache_blocks=64, max_model_len=320)
    yield PagodaUI(ConversationStore(tmp_path_factory.mktemp("overflow") / "chats.db"), host)
    host.unload()


def run(events) -> tuple:
    *_, last = events
    return last


def test_the_message_that_does_not_fit_stays_out_and_drop_sends_it(ui):
    conv = ui.store.create().id
    run(ui.respond(conv, WORDS, "", *GREEDY, 16, None))
    assert [m.role for m in ui.store.messages(conv)] == ["user", "assistant"]
    chat, box, overflow, actions, _meter, _edit = run(ui.respond(conv, WORDS + WORDS, "", *GREEDY, 16, None))
    assert overflow["visible"] and "Drop the oldest messages" in overflow["value"] and actions["visible"]
    assert box == WORDS + WORDS  # kept for Drop, or for an edit
    assert [m.role for m in ui.store.messages(conv)] == ["user", "assistant"]  # not saved into the chat
    before = ui.context_meter(conv)

    frames = list(ui.drop_oldest_and_answer(conv, box, "", *GREEDY, 16, None))  # to the end of the reply
    messages = ui.store.messages(conv)
    assert [(m.role, m.content) for m in messages][:1] == [("user", WORDS + WORDS)] and len(messages) == 2
    assert messages[1].meta["finish_reason"] in ("stop", "length")  # answered
    assert frames[0][1] == ""  # sent: the box is cleared
    assert not frames[-1][2]["visible"] and not frames[-1][3]["visible"]  # and the offer is gone
    assert ui.context_meter(conv) != before


def test_a_message_longer_than_the_context_alone_says_so_without_an_error(ui):
    conv = ui.store.create().id
    *_, (chat, box, overflow, actions, _meter, _edit) = ui.respond(conv, WORDS * 4, "", *GREEDY, 16, None)
    assert box == WORDS * 4 and ui.store.messages(conv) == []
    chat, box, overflow, actions, _meter, _edit = run(ui.drop_oldest_and_answer(conv, box, "", *GREEDY, 16, None))
    assert "This message alone is longer" in overflow["value"] and not actions["visible"] and chat == []


def test_drop_removes_the_oldest_turn_of_several_and_keeps_the_rest_in_order(ui):
    """With one earlier turn, dropping the oldest and dropping the newest are the same: three tell them apart."""
    conv = ui.store.create().id
    turns = [(f"Question {n}?", f"Answer {n}.") for n in (1, 2, 3)]
    for question, answer in turns:
        ui.store.add_message(conv, "user", question)
        ui.store.add_message(conv, "assistant", answer, {"finished": True, "finish_reason": "stop"})
    kept = [(m.id, m.role, m.content) for m in ui.store.messages(conv)[2:]]

    run(ui.drop_oldest_and_answer(conv, "Question 4?", "", *GREEDY, 4, None))
    messages = ui.store.messages(conv)
    assert [(m.id, m.role, m.content) for m in messages[:4]] == kept  # turns 2 and 3, untouched and in order
    assert [(m.role, m.content) for m in messages[4:5]] == [("user", "Question 4?")] and len(messages) == 6
    assert messages[5].role == "assistant" and messages[5].meta["finish_reason"] in ("stop", "length")
    assert not {"Question 1?", "Answer 1."} & {m.content for m in messages}
