"""The store's message tree: regenerated replies and edits as siblings, switching branches, branching into a new
chat, dropping turns without losing other branches, and the migration of a database from before the tree."""

import sqlite3

import pytest

from app.store import ConversationStore, NotFound
from app.store_schema import MIGRATIONS, SCHEMA_VERSION


@pytest.fixture
def store(tmp_path):
    s = ConversationStore(tmp_path / "pagoda.db")
    yield s
    s.close()


def texts(store, cid) -> list[str]:
    return [m.content for m in store.messages(cid)]


def three_turns(store):
    c = store.create("Trip")
    ids = [store.add_message(c.id, r, t).id for r, t in zip(["user", "assistant"] * 3, "q1 a1 q2 a2 q3 a3".split())]
    return c.id, ids


def test_a_regenerated_reply_is_a_sibling_and_each_branch_can_be_shown_again(store):
    cid, ids = three_turns(store)
    q3, a3 = ids[4], ids[5]
    b = store.add_message(cid, "assistant", "a3 again", after=q3)
    c = store.add_message(cid, "assistant", "a3 third", after=q3)
    assert texts(store, cid) == ["q1", "a1", "q2", "a2", "q3", "a3 third"]
    assert store.siblings(cid, c.id) == store.siblings(cid, a3) == [a3, b.id, c.id]
    assert store.siblings(cid, q3) == [q3]
    store.show(cid, a3)
    assert texts(store, cid) == ["q1", "a1", "q2", "a2", "q3", "a3"]
    store.show(cid, b.id)
    assert texts(store, cid)[-1] == "a3 again"
    assert [m.parent_id for m in store.messages(cid)] == [None, *ids[:4], q3]


def test_editing_the_first_message_starts_a_branch_and_the_old_one_comes_back_whole(store):
    cid, ids = three_turns(store)
    q1b = store.add_message(cid, "user", "q1 edited", after=None)
    store.add_message(cid, "assistant", "a1 new")
    assert texts(store, cid) == ["q1 edited", "a1 new"]
    assert store.siblings(cid, q1b.id) == [ids[0], q1b.id]
    store.show(cid, ids[0])  # the old first message: its whole branch, down to where it was written last
    assert texts(store, cid) == ["q1", "a1", "q2", "a2", "q3", "a3"]
    store.show(cid, q1b.id)
    assert texts(store, cid) == ["q1 edited", "a1 new"]


def test_show_follows_the_branch_written_to_last(store):
    cid, ids = three_turns(store)
    store.add_message(cid, "user", "q2 edited", after=ids[1])
    store.add_message(cid, "assistant", "a2 edited")
    store.show(cid, ids[2])
    store.add_message(cid, "user", "q4")  # the old branch grows
    store.show(cid, ids[0])
    assert texts(store, cid) == ["q1", "a1", "q2", "a2", "q3", "a3", "q4"]


def test_show_does_not_reorder_the_chat_list_but_adding_does(store):
    cid, ids = three_turns(store)
    other = store.create("other")
    store.show(cid, ids[1])
    assert store.list()[0].id == other.id
    store.add_message(cid, "assistant", "again", after=ids[4])
    assert store.list()[0].id == cid


def test_branch_copies_the_path_into_a_new_chat_and_leaves_the_chat_alone(store):
    c = store.create("Trip", system_prompt="You plan trips.", settings={"temperature": 0.3})
    ids = [
        store.add_message(c.id, r, t, {"n": i}).id
        for i, (r, t) in enumerate(zip(["user", "assistant"] * 2, "q1 a1 q2 a2".split()))
    ]
    copy = store.branch(c.id, ids[1])
    assert copy.id != c.id and copy.title == "Trip (branch)"
    assert (copy.system_prompt, copy.settings) == ("You plan trips.", {"temperature": 0.3})
    got = store.messages(copy.id)
    assert [(m.role, m.content, m.meta) for m in got] == [("user", "q1", {"n": 0}), ("assistant", "a1", {"n": 1})]
    assert not {m.id for m in got} & set(ids)
    assert texts(store, c.id) == ["q1", "a1", "q2", "a2"]
    store.add_message(copy.id, "user", "q2 elsewhere")
    assert texts(store, c.id) == ["q1", "a1", "q2", "a2"]


def test_dropping_the_oldest_turn_keeps_branches_that_still_go_through_it(store):
    cid, ids = three_turns(store)
    alt = store.add_message(cid, "user", "q2 other", after=ids[1])  # a branch through q1/a1
    store.show(cid, ids[2])
    store.drop_turns_before(cid, ids[2])
    assert texts(store, cid) == ["q2", "a2", "q3", "a3"]
    store.show(cid, alt.id)
    assert texts(store, cid) == ["q1", "a1", "q2 other"]  # still whole
    store.drop_turns_before(cid, alt.id)
    assert texts(store, cid) == ["q2 other"]
    with pytest.raises(NotFound):
        store.path_to(cid, ids[0])  # nothing goes through q1 any more: gone


def test_messages_of_another_chat_are_refused(store):
    cid, ids = three_turns(store)
    other = store.create("other")
    for call in (
        lambda: store.add_message(other.id, "user", "x", after=ids[0]),
        lambda: store.show(other.id, ids[0]),
        lambda: store.branch(other.id, ids[0]),
        lambda: store.siblings(other.id, ids[0]),
        lambda: store.drop_turns_before(other.id, ids[0]),
    ):
        with pytest.raises(NotFound, match="has no message"):
            call()
    assert texts(store, cid) == ["q1", "a1", "q2", "a2", "q3", "a3"] and texts(store, other.id) == []


def test_deleting_a_chat_deletes_every_branch(store):
    cid, ids = three_turns(store)
    store.add_message(cid, "assistant", "alt", after=ids[4])
    store.delete(cid)
    assert store._conn.execute("SELECT count(*) FROM messages").fetchone()[0] == 0


def test_a_database_from_before_the_tree_opens_with_every_message_on_its_chat_path(tmp_path):
    """Written as the previous release wrote it: its migrations (v1, v2) and its INSERTs, messages of two chats
    interleaved."""
    path = tmp_path / "old.db"
    raw = sqlite3.connect(path, isolation_level=None)
    raw.execute("PRAGMA foreign_keys = ON")
    raw.execute("BEGIN")
    for v, step in enumerate(MIGRATIONS[:2]):
        step(raw)
        raw.execute(f"PRAGMA user_version = {v + 1}")
    raw.execute("COMMIT")
    for title in ("First", "Second"):
        raw.execute("INSERT INTO conversations(title, created, updated) VALUES (?, 1, 1)", (title,))
    written = []
    for i in range(10):
        cid, role = 1 + i % 2, ["user", "assistant"][(i // 2) % 2]
        text = f"chat {cid} message {i // 2} {'ü' * i}"
        raw.execute(
            "INSERT INTO messages(conversation_id, role, content, meta, created) VALUES (?, ?, ?, '{\"k\": 1}', ?)",
            (cid, role, text, float(i)),
        )
        written.append((cid, role, text))
    raw.execute("INSERT INTO conversations(title, created, updated) VALUES ('Empty', 1, 1)")
    raw.close()

    with ConversationStore(path) as store:
        assert store._conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        for cid in (1, 2):
            got = store.messages(cid)
            assert [(m.conversation_id, m.role, m.content) for m in got] == [w for w in written if w[0] == cid]
            assert all(m.meta == {"k": 1} for m in got)
            assert [m.parent_id for m in got] == [None] + [m.id for m in got[:-1]]
        assert store.messages(3) == []
        assert store._conn.execute("SELECT count(*) FROM messages").fetchone()[0] == len(written)
        store.add_message(1, "user", "after the upgrade")
        assert texts(store, 1)[-1] == "after the upgrade" and len(store.messages(1)) == 6


def test_dropping_the_whole_path_leaves_other_branches_and_the_next_message_starts_anew(store):
    cid, ids = three_turns(store)
    alt = store.add_message(cid, "assistant", "a1 other", after=ids[0])
    store.show(cid, ids[5])
    store.drop_turns_before(cid, None)
    assert store.messages(cid) == []
    first = store.add_message(cid, "user", "fresh")
    assert first.parent_id is None and texts(store, cid) == ["fresh"]
    assert [m.content for m in store.path_to(cid, alt.id)] == ["q1", "a1 other"]  # q1 is kept for it
    with pytest.raises(NotFound):
        store.path_to(cid, ids[1])


def test_a_chat_longer_than_sqlites_trigger_depth_deletes(store):
    """Each message's cascade to its follower was a level of trigger recursion, which SQLite stops at 1,000."""
    c = store.create("long")
    for i in range(1100):
        store.add_message(c.id, "user" if i % 2 == 0 else "assistant", f"m{i}")
    store.delete(c.id)
    assert store._conn.execute("SELECT count(*) FROM messages").fetchone()[0] == 0


def test_new_chat_does_not_reuse_an_empty_chat_that_has_files_or_a_place(store):
    with_file = store.create()
    store.attach_file(with_file.id, "a.txt", "ab" * 32, b"a", "a")
    pinned = store.create()
    store.place(pinned.id, pinned=True)
    fresh = store.empty_chat()
    assert fresh.id not in (with_file.id, pinned.id)
