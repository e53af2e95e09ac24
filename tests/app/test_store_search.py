"""Finding chats: the words of every message of every branch (SQLite FTS5, kept in step by triggers), titles and
folders; pinned chats first; and a database from before the index finds its old messages too."""

import sqlite3

import pytest

from app.model_host import ModelHost
from app.store import ConversationStore
from app.store_schema import MIGRATIONS
from app.ui import PagodaUI


@pytest.fixture
def store(tmp_path):
    s = ConversationStore(tmp_path / "pagoda.db")
    yield s
    s.close()


def titles(store, query: str = "") -> list[str]:
    return [c.title for c in store.list(query)]


def test_search_finds_words_and_word_starts_in_every_branch(store):
    boats = store.create("Boats")
    q = store.add_message(boats.id, "user", "Which sailboat should I buy?")
    store.add_message(boats.id, "assistant", "A catamaran is stable.")
    store.add_message(boats.id, "assistant", "Consider a trimaran instead.", after=q.id)  # the shown branch
    store.show(boats.id, q.id)
    cooking = store.create("Cooking")
    store.add_message(cooking.id, "user", "Pasta for four people?")
    assert titles(store, "catamaran") == ["Boats"]  # in a branch the chat does not show
    assert titles(store, "trimaran") == ["Boats"]
    assert titles(store, "SAILB") == ["Boats"]  # a word's start, any case
    assert titles(store, "pasta four") == ["Cooking"]  # every word
    assert titles(store, "pasta catamaran") == []
    assert titles(store, "cook") == ["Cooking"]  # the title, any part of it
    assert titles(store, "oking") == ["Cooking"]


def test_what_the_user_types_is_never_read_as_search_syntax(store):
    c = store.create("Quotes")
    store.add_message(c.id, "user", 'She said "NEAR the AND gate" (really)*')
    for query in ('"', "AND", "NEAR(", "*", "(really", 'said "near', "-", "^gate", "OR OR"):
        assert titles(store, query) in ([], ["Quotes"])  # no error; it matches or not
    assert titles(store, 'said "near') == ["Quotes"]


def test_a_reply_streamed_into_a_message_is_found_by_its_last_words_and_a_deleted_chat_by_none(store):
    c = store.create("Live")
    m = store.add_message(c.id, "assistant", "")
    store.update_message(m.id, "The answer is forty")
    store.update_message(m.id, "The answer is forty-two, said the computer")
    assert titles(store, "computer") == ["Live"]
    store.delete(c.id)
    assert titles(store, "computer") == []
    assert (
        store._conn.execute("SELECT count(*) FROM messages_fts WHERE messages_fts MATCH 'computer'").fetchone()[0] == 0
    )


def test_pinned_chats_come_first_and_pinning_or_a_folder_keeps_the_order_of_the_rest(store):
    a, b, c = store.create("a"), store.create("b"), store.create("c")
    store.place(a.id, pinned=True)
    store.place(b.id, folder="  Work   stuff ")
    assert titles(store) == ["a", "c", "b"]
    assert store.get(b.id).folder == "Work stuff" and store.get(b.id).updated == b.updated
    assert titles(store, "work") == ["b"]  # a folder's name finds its chats
    store.add_message(c.id, "user", "bump")
    assert titles(store) == ["a", "c", "b"]  # pinned stays on top
    store.place(a.id, pinned=False)
    assert titles(store) == ["c", "b", "a"]
    with pytest.raises(ValueError, match="A folder is a name"):
        store.place(a.id, folder=3)


def test_the_chat_list_marks_pinned_chats_and_names_folders(store):
    ui = PagodaUI(store, ModelHost())
    a, b = store.create("Taxes").id, store.create("Ideas").id
    ui.toggle_pin(a)
    ui.move_to_folder(b, "Work")
    assert ui.conversation_choices() == [("📌 Taxes", a), ("Work › Ideas", b)]
    assert ui.chat_place(a)[0]["value"] == "Unpin" and ui.chat_place(b) == (
        {"__type__": "update", "value": "Pin to top"},
        "Work",
    )


def test_messages_written_before_the_index_are_found_after_the_upgrade(tmp_path):
    path = tmp_path / "old.db"
    raw = sqlite3.connect(path, isolation_level=None)
    raw.execute("PRAGMA foreign_keys = ON")
    raw.execute("BEGIN")
    for v, step in enumerate(MIGRATIONS[:5]):  # the database as the release before the index left it
        step(raw)
        raw.execute(f"PRAGMA user_version = {v + 1}")
    raw.execute("COMMIT")
    raw.execute("INSERT INTO conversations(title, created, updated) VALUES ('Old', 1, 1)")
    raw.execute("INSERT INTO messages(conversation_id, role, content, created) VALUES (1, 'user', 'an okapi', 1)")
    raw.close()
    with ConversationStore(path) as store:
        assert titles(store, "okapi") == ["Old"]
        assert store.get(1).pinned is False and store.get(1).folder == ""


def test_words_with_letters_that_casefold_changes_are_found(store):
    c = store.create("Trip")
    store.add_message(c.id, "user", "Die Straße nach İstanbul")
    assert titles(store, "straße") == ["Trip"] and titles(store, "İstanbul") == ["Trip"]
