"""A message that alone is longer than the context (issue 28, item 5): said at once, with its size and the
context's, and without offering "Drop the oldest turn" or "Start a new chat", which cannot help."""

import re

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
    yield PagodaUI(ConversationStore(tmp_path_factory.mktemp("too_long") / "chats.db"), host)
    host.unload()


def last(events) -> tuple:
    *_, frame = events
    return frame


@pytest.mark.parametrize("history", [False, True], ids=["a new chat", "a chat with turns"])
def test_a_message_longer_than_the_context_alone_says_so_at_once(ui, history):
    conv = ui.store.create().id
    if history:
        last(ui.respond(conv, WORDS, "", *GREEDY, 16, None))
    before = [m.id for m in ui.store.messages(conv)]
    chat, box, overflow, actions, _meter, _edit = last(ui.respond(conv, WORDS * 4, "Be brief.", *GREEDY, 16, None))
    assert overflow["visible"] and "This message alone is too long" in overflow["value"]
    size = re.search(
        r"with the system prompt it is ([\d,]+) tokens, and the model's context holds 320,", overflow["value"]
    )
    assert size and 372 < int(size[1].replace(",", "")) < 450  # the message's 372 tokens, the prompt and template
    assert not actions["visible"]  # no Drop the oldest turn, no Start a new chat
    assert box == WORDS * 4  # kept, to be shortened
    assert [m.id for m in ui.store.messages(conv)] == before  # and not saved


def test_a_message_that_fits_alone_is_still_offered_the_oldest_turn_dropped(ui):
    conv = ui.store.create().id
    last(ui.respond(conv, WORDS, "", *GREEDY, 16, None))
    chat, box, overflow, actions, _meter, _edit = last(ui.respond(conv, WORDS + WORDS, "", *GREEDY, 16, None))
    assert "Drop the oldest messages" in overflow["value"] and actions["visible"]
