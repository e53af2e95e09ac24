"""New chat opens the empty chat already in the list instead of adding another empty "New chat"."""

from app.model_host import ModelHost
from app.store import ConversationStore
from app.ui import PagodaUI


def titles(ui: PagodaUI) -> list[str]:
    return [title for title, _ in ui.conversation_choices()]


def test_pressing_new_chat_twice_lists_one_empty_chat(tmp_path):
    ui = PagodaUI(ConversationStore(tmp_path / "chats.db"), ModelHost())
    answered = ui.store.create()
    ui.store.add_message(answered.id, "user", "Name a fruit.")
    ui.store.rename(answered.id, "Name a fruit.")

    first = ui.new_chat("You are terse.", "")["value"]
    second = ui.new_chat("You are a poet.", "")["value"]
    assert second == first
    assert titles(ui) == ["New chat", "Name a fruit."]  # the empty chat on top, once
    assert ui.store.get(first).system_prompt == "You are a poet."  # started afresh with the prompt asked for


def test_an_empty_chat_that_was_renamed_or_written_in_is_not_reused(tmp_path):
    ui = PagodaUI(ConversationStore(tmp_path / "chats.db"), ModelHost())
    named = ui.new_chat("", "")["value"]
    ui.store.rename(named, "Ideas")  # the user named it: theirs to keep
    fresh = ui.new_chat("", "")["value"]
    assert fresh != named
    ui.store.add_message(fresh, "user", "Hi")
    assert ui.new_chat("", "")["value"] not in (named, fresh)
    assert sorted(titles(ui)) == ["Ideas", "New chat", "New chat"]
