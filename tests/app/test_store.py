"""The SQLite conversation store: CRUD, search, presets, export, schema, threads and kill -9."""

import json
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from app.store import (
    DEFAULT_PRESETS,
    SCHEMA_VERSION,
    Conversation,
    ConversationStore,
    Message,
    NotFound,
    Preset,
    SchemaError,
    default_db_path,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path):
    s = ConversationStore(tmp_path / "pagoda.db")
    yield s
    s.close()


# ---- location & file settings ------------------------------------------------------------------


def test_default_db_path_honours_pagoda_home(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path / "home"))
    assert default_db_path() == tmp_path / "home" / "pagoda.db"


def test_default_db_path_uses_platformdirs(monkeypatch):
    import platformdirs

    monkeypatch.delenv("PAGODA_HOME", raising=False)
    assert default_db_path() == Path(platformdirs.user_data_dir("pagoda")) / "pagoda.db"


def test_creates_parent_folder_wal_foreign_keys_and_version(tmp_path):
    path = tmp_path / "deep" / "er" / "pagoda.db"
    with ConversationStore(path) as s:
        assert s.journal_mode == "wal"
        assert s._conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 1
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    raw.close()


def test_newer_schema_is_refused_with_a_clear_error(tmp_path):
    path = tmp_path / "pagoda.db"
    ConversationStore(path).close()
    raw = sqlite3.connect(path)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    raw.commit()
    raw.close()
    with pytest.raises(SchemaError, match="newer Pagoda"):
        ConversationStore(path)


def test_foreign_files_are_refused(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(SchemaError, match="not a Pagoda database"):
        ConversationStore(junk)
    other = tmp_path / "other.db"
    raw = sqlite3.connect(other)
    raw.execute("CREATE TABLE t (x)")
    raw.commit()
    raw.close()
    with pytest.raises(SchemaError, match="not a Pagoda one"):
        ConversationStore(other)


def test_reopen_keeps_data_and_does_not_reseed_presets(tmp_path):
    path = tmp_path / "pagoda.db"
    with ConversationStore(path) as s:
        c = s.create("Kept")
        s.add_message(c.id, "user", "still here")
        for p in s.presets():
            s.delete_preset(p.name)
    with ConversationStore(path) as s:
        assert [m.content for m in s.messages(c.id)] == ["still here"]
        assert s.presets() == []


def test_closed_store_says_so(tmp_path):
    s = ConversationStore(tmp_path / "pagoda.db")
    s.close()
    s.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        s.list()


def test_in_memory_database_works():
    with ConversationStore(":memory:") as s:
        c = s.create()
        s.add_message(c.id, "user", "hi")
        assert s.messages(c.id)[0].content == "hi"


# ---- conversations -----------------------------------------------------------------------------


def test_create_get_rename_update(store):
    c = store.create("First", system_prompt="Be nice.", settings={"temperature": 0.7, "max_tokens": 256})
    assert isinstance(c, Conversation) and c.id > 0
    assert (c.title, c.system_prompt, c.settings) == ("First", "Be nice.", {"temperature": 0.7, "max_tokens": 256})
    assert store.get(c.id) == c
    assert store.create().title == "New chat"

    store.rename(c.id, "  Renamed\n chat ")
    got = store.get(c.id)
    assert got.title == "Renamed chat" and got.updated > c.updated

    store.update(c.id, system_prompt="Be terse.")
    assert store.get(c.id).settings == {"temperature": 0.7, "max_tokens": 256}
    store.update(c.id, settings={"temperature": 0.0})
    got = store.get(c.id)
    assert (got.system_prompt, got.settings) == ("Be terse.", {"temperature": 0.0})
    store.update(c.id)  # nothing to change is fine


def test_validation_errors_say_what_to_do(store):
    c = store.create()
    with pytest.raises(ValueError, match="cannot be empty"):
        store.create("   ")
    with pytest.raises(ValueError, match="cannot be empty"):
        store.rename(c.id, "")
    with pytest.raises(ValueError, match="use one of system, user, assistant"):
        store.add_message(c.id, "bot", "hi")
    with pytest.raises(ValueError, match="JSON"):
        store.create("x", settings={"f": object()})
    with pytest.raises(ValueError, match="dict"):
        store.add_message(c.id, "user", "hi", meta=[1, 2])
    with pytest.raises(KeyError, match="No chat with id 999"):
        store.get(999)
    for call in (
        lambda: store.rename(999, "x"),
        lambda: store.delete(999),
        lambda: store.update(999, settings={}),
        lambda: store.add_message(999, "user", "x"),
        lambda: store.messages(999),
        lambda: store.update_message(999, "x"),
        lambda: store.delete_preset("nope"),
        lambda: store.export_json(999),
    ):
        with pytest.raises(ValueError) as info:
            call()
        assert isinstance(info.value, NotFound) and "No " in str(info.value)
    assert len(store.list()) == 1  # failed calls wrote nothing


def test_list_orders_by_most_recent_activity(store):
    a, b, c = store.create("a"), store.create("b"), store.create("c")
    assert [x.title for x in store.list()] == ["c", "b", "a"]
    store.add_message(a.id, "user", "bump")
    assert [x.title for x in store.list()] == ["a", "c", "b"]
    store.rename(b.id, "b2")
    assert [x.title for x in store.list()] == ["b2", "a", "c"]
    m = store.add_message(c.id, "assistant", "")
    store.update_message(m.id, "streamed tokens do not reorder")  # c is first since add_message
    store.add_message(a.id, "user", "again")
    store.update_message(m.id, "still streaming")
    assert [x.title for x in store.list()] == ["a", "c", "b2"]
    updated = [x.updated for x in store.list()]
    assert updated == sorted(updated, reverse=True) and len(set(updated)) == 3


def test_search_titles_and_content_case_insensitively(store):
    rust = store.create("Learning Rust")
    cook = store.create("Dinner ideas")
    store.add_message(cook.id, "user", "How long do I boil PASTA?")
    store.add_message(cook.id, "assistant", "About 10 minutes; 100% of the time, salt the water.")
    umlaut = store.create("Grüße")
    store.add_message(umlaut.id, "user", "ÄRGER im Büro")
    store.create("Empty")

    def titles(q):
        return [c.title for c in store.list(q)]

    assert titles("rust") == ["Learning Rust"]
    assert titles("pasta") == ["Dinner ideas"]
    assert titles("BOIL") == ["Dinner ideas"]
    assert titles("100%") == ["Dinner ideas"]  # LIKE wildcards are plain text here
    assert titles("_") == []
    assert titles("ärger") == ["Grüße"]  # beyond ASCII
    assert titles("grüsse") == ["Grüße"]  # casefold: ß == ss
    assert titles("no such thing") == []
    assert titles("   ") == titles("") == ["Empty", "Grüße", "Dinner ideas", "Learning Rust"]
    store.delete(cook.id)
    assert titles("pasta") == []
    assert rust.id in [c.id for c in store.list("learn")]


def test_delete_cascades_to_messages(store):
    c, keep = store.create("gone"), store.create("kept")
    m = store.add_message(c.id, "user", "bye")
    store.add_message(keep.id, "user", "stay")
    store.delete(c.id)
    with pytest.raises(KeyError):
        store.get(c.id)
    assert store._conn.execute("SELECT count(*) FROM messages WHERE conversation_id = ?", (c.id,)).fetchone()[0] == 0
    with pytest.raises(NotFound, match="deleted"):
        store.update_message(m.id, "late token from a reply that was still streaming")
    assert [x.content for x in store.messages(keep.id)] == ["stay"]
    assert store.create("new").id != c.id  # ids are never reused


# ---- messages ----------------------------------------------------------------------------------


def test_messages_in_order_with_meta(store):
    c = store.create()
    assert store.messages(c.id) == []
    s = store.add_message(c.id, "system", "sys")
    u = store.add_message(c.id, "user", "hello")
    a = store.add_message(c.id, "assistant", "")
    assert isinstance(a, Message) and a.conversation_id == c.id and a.meta == {}
    store.update_message(a.id, "Hi", {"ttft_s": 0.12})
    store.update_message(a.id, "Hi there")  # meta kept when not given
    meta = {"ttft_s": 0.12, "tokens_per_s": 41.5, "cached_prompt_tokens": 32, "finish_reason": "stop"}
    store.update_message(a.id, "Hi there!", meta)
    got = store.messages(c.id)
    assert [m.id for m in got] == [s.id, u.id, a.id]
    assert [m.as_chat() for m in got] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Hi there!"},
    ]
    assert got[2].meta == meta
    assert got[0].created <= got[1].created <= got[2].created


# ---- presets -----------------------------------------------------------------------------------


def test_presets_seeded_saved_replaced_deleted(store):
    seeded = store.presets()
    assert [p.name for p in seeded] == [n for n, _ in DEFAULT_PRESETS]
    assert Preset("Helpful assistant", "You are a helpful assistant.") in seeded
    store.save_preset("Pirate", "Talk like a pirate.")
    store.save_preset(" Pirate ", "Talk like a pirate, briefly.")  # same name: replaced in place
    store.save_preset("Coder", "Only Python.")
    names = [p.name for p in store.presets()]
    assert names == [n for n, _ in DEFAULT_PRESETS] + ["Pirate"]
    assert {p.name: p.system_prompt for p in store.presets()}["Pirate"] == "Talk like a pirate, briefly."
    store.delete_preset("Pirate")
    assert "Pirate" not in [p.name for p in store.presets()]
    with pytest.raises(ValueError, match="needs a name"):
        store.save_preset("  ", "x")
    with pytest.raises(KeyError, match="No preset named"):
        store.delete_preset("Pirate")


# ---- export ------------------------------------------------------------------------------------


def _filled(store):
    c = store.create("Trip plan", system_prompt="You plan trips.", settings={"temperature": 0.5})
    store.add_message(c.id, "user", "Three days in Kyoto?")
    store.add_message(
        c.id, "assistant", "Day 1: **Fushimi Inari**.\n\n```\nnot a heading\n```", {"finish_reason": "stop"}
    )
    return store.get(c.id)


def test_export_markdown(store):
    c = _filled(store)
    md = store.export_markdown(c.id)
    assert md.startswith("# Trip plan\n")
    headings = [line for line in md.splitlines() if line.startswith("## ")]
    assert headings == ["## System", "## User", "## Assistant"]
    assert "You plan trips." in md and "Three days in Kyoto?" in md and "**Fushimi Inari**" in md
    assert md.index("## User") < md.index("Three days") < md.index("## Assistant") < md.index("Fushimi")


def test_export_json_round_trips(store):
    c = _filled(store)
    text = store.export_json(c.id)
    data = json.loads(text)
    assert data["format"] == "pagoda.conversation"
    assert Conversation(**{k: data[k] for k in ("id", "title", "system_prompt", "settings", "created", "updated")}) == c
    assert [Message(**m) for m in data["messages"]] == store.messages(c.id)

    copy = store.import_json(text)
    assert copy.id != c.id
    assert (copy.title, copy.system_prompt, copy.settings) == (c.title, c.system_prompt, c.settings)
    assert [(m.role, m.content, m.meta) for m in store.messages(copy.id)] == [
        (m.role, m.content, m.meta) for m in store.messages(c.id)
    ]
    with pytest.raises(ValueError, match="not a Pagoda chat export"):
        store.import_json('{"title": "x"}')
    with pytest.raises(ValueError, match="not JSON"):
        store.import_json("# Trip plan")


# ---- threads -----------------------------------------------------------------------------------


def test_concurrent_writers_and_readers(tmp_path):
    path = tmp_path / "pagoda.db"
    shared = ConversationStore(path)
    second = ConversationStore(path)  # a second connection, as another process would have
    n_threads, n_msgs = 8, 40
    errors: list[BaseException] = []
    start = threading.Barrier(n_threads + 2)

    def writer(i):
        try:
            s = shared if i % 2 else second
            start.wait()
            c = s.create(f"chat {i}")
            reply = s.add_message(c.id, "assistant", "")
            for j in range(n_msgs):
                s.add_message(c.id, "user", f"t{i} m{j}")
                s.update_message(reply.id, f"t{i} reply {j}", {"step": j})
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def reader():
        try:
            start.wait()
            for _ in range(60):
                for c in shared.list("m1"):
                    shared.messages(c.id)
                shared.presets()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(n_threads)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    chats = shared.list()
    assert len(chats) == n_threads
    for c in chats:
        msgs = shared.messages(c.id)
        i = int(c.title.split()[1])
        assert len(msgs) == n_msgs + 1
        assert msgs[0].content == f"t{i} reply {n_msgs - 1}" and msgs[0].meta == {"step": n_msgs - 1}
        assert [m.content for m in msgs[1:]] == [f"t{i} m{j}" for j in range(n_msgs)]
    shared.close()
    second.close()


# ---- durability --------------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import sys
    from app.store import ConversationStore

    store = ConversationStore(sys.argv[1])
    chat = store.create("Crash test " + sys.argv[2])
    store.add_message(chat.id, "user", "Tell me a long story.")
    reply = store.add_message(chat.id, "assistant", "")
    print("ids", chat.id, reply.id, flush=True)
    text, i = "", 0
    while True:
        i += 1
        text += "tok%d " % i
        store.update_message(reply.id, text, {"tokens": i})
        print("committed", i, flush=True)
""")


def _expected(n):
    return "".join(f"tok{j} " for j in range(1, n + 1))


def _hard_kill(proc):
    if hasattr(signal, "SIGKILL"):
        os.kill(proc.pid, signal.SIGKILL)
    else:  # Windows: TerminateProcess is just as abrupt
        proc.kill()


def test_committed_updates_survive_kill_9(tmp_path):
    path = tmp_path / "pagoda.db"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    reader = None
    results = []
    for round_ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path), str(round_)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put("")], daemon=True).start()
        try:
            first = lines.get(timeout=30)
            assert first.startswith("ids"), f"child failed: {first!r} {proc.stderr.read() if not first else ''}"
            chat_id, reply_id = map(int, first.split()[1:])
            reported = 0
            target = 30 + 40 * round_
            while reported < target:
                line = lines.get(timeout=30)
                assert line, f"child died early: {proc.stderr.read()}"
                reported = int(line.split()[1])
            if reader is None:
                reader = ConversationStore(path)  # like a page reload while the reply streams
            live = reader.messages(chat_id)[-1]
            assert live.meta["tokens"] >= reported and live.content == _expected(live.meta["tokens"])
            _hard_kill(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        if hasattr(signal, "SIGKILL"):
            assert proc.returncode == -signal.SIGKILL
        results.append((chat_id, reply_id, reported))
    reader.close()

    with ConversationStore(path) as s:  # the app restarts
        assert s._conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert len(s.list()) == 3
        for chat_id, reply_id, reported in results:
            user, reply = s.messages(chat_id)
            assert user.content == "Tell me a long story."
            assert reply.id == reply_id
            n = reply.meta["tokens"]
            assert n >= reported  # nothing reported as committed was lost ...
            assert reply.content == _expected(n)  # ... and content and meta come from the same commit


def test_markdown_export_closes_the_code_block_a_cut_reply_left_open(store):
    """A reply stopped inside a code block left it open, and every later heading and message was code."""
    from markdown_it import MarkdownIt

    chat = store.create(title="Code").id
    store.add_message(chat, "user", "Write a program.")
    store.add_message(chat, "assistant", "Here:\n\n```python\ndef main():\n    print(1)", {"finish_reason": "abort"})
    store.add_message(chat, "user", "Thanks, go on.")
    tokens = MarkdownIt("commonmark").parse(store.export_markdown(chat))
    code = [t.content for t in tokens if t.type == "fence"]
    headings = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]
    assert code == ["def main():\n    print(1)\n"]
    assert headings == ["Code", "User", "Assistant", "User"]
    assert store.messages(chat)[1].content.endswith("print(1)")  # the stored reply is left as it was
