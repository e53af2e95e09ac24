"""Every chat in one file and back: Pagoda's archive (all branches, files, presets) survives export, wipe and import
whole; importing twice adds nothing; Open WebUI's and ChatGPT's exports (made here from their documented shapes) come
in as trees; a file of the wrong kind or a newer version changes nothing and says why."""

import json

import pytest

from app.archive import read_archive
from app.store import ConversationStore
from entrypoints.documents import content_hash, extract_text
from tests.app.document_files import pdf_bytes


@pytest.fixture
def store(tmp_path):
    s = ConversationStore(tmp_path / "a.db")
    yield s
    s.close()


@pytest.fixture
def other(tmp_path):
    s = ConversationStore(tmp_path / "b.db")
    yield s
    s.close()


def everything(store) -> dict:
    """Everything a user could lose, by title: each chat's settings, files, every message of every branch (as a
    path of contents from the first message) and the branch it shows; and the presets."""
    chats = {}
    for conv in store.list():
        rows = store._conn.execute(
            "SELECT id, parent_id, role, content, meta FROM messages WHERE conversation_id = ? ORDER BY id", (conv.id,)
        ).fetchall()
        by_id = {r[0]: r for r in rows}

        def path(mid):
            out = []
            while mid is not None:
                out.append(by_id[mid][3])
                mid = by_id[mid][1]
            return tuple(reversed(out))

        chats[conv.title] = {
            "place": (conv.pinned, conv.folder),
            "system": conv.system_prompt,
            "settings": conv.settings,
            "files": [(f.name, f.text, f.shortened) for f in store.chat_files(conv.id)],
            "messages": sorted((path(r[0]), r[2], r[4]) for r in rows),
            "shown": [m.content for m in store.messages(conv.id)],
        }
    return {"chats": chats, "presets": [(p.name, p.system_prompt) for p in store.presets()]}


def filled(store) -> None:
    trip = store.create("Trip", system_prompt="You plan trips.", settings={"temperature": 0.3})
    q = store.add_message(trip.id, "user", "Three days in Kyoto?")
    a1 = store.add_message(trip.id, "assistant", "Day 1: temples.", {"finish_reason": "stop", "ttft_s": 0.1})
    store.add_message(trip.id, "assistant", "Day 1: markets.", after=q.id)  # a regenerated reply
    store.add_message(trip.id, "user", "Three days in Osaka?", after=None)  # an edited first message
    store.show(trip.id, a1.id)
    pdf = pdf_bytes(["Kyoto has 1,600 temples."])
    store.attach_file(trip.id, "guide.pdf", content_hash(pdf), pdf, extract_text("guide.pdf", pdf))
    long = b"abcdefghij" * 20
    store.attach_file(trip.id, "notes.txt", content_hash(long), long, long.decode(), keep_chars=12)
    code = store.create("Code")
    store.add_message(code.id, "user", "Write FizzBuzz.")
    store.add_message(code.id, "assistant", "```python\nprint(1)\n```")
    store.place(trip.id, pinned=True)
    store.place(code.id, folder="Work")
    store.save_preset("Pirate", "Talk like a pirate.")


def test_export_all_wipe_and_import_brings_back_everything(store, other, tmp_path):
    filled(store)
    before = everything(store)
    archive = store.export_all()
    store.close()
    (tmp_path / "a.db").unlink()  # wiped
    report = other.import_archive(read_archive(archive))
    assert (report.chats_added, report.messages_added, report.presets_added) == (2, 6, 1)
    after = everything(other)
    assert after["chats"] == before["chats"]
    assert after["presets"] == before["presets"]  # the defaults were there already; Pirate was added


def test_a_second_import_adds_nothing_and_a_newer_archive_only_what_is_new(store, other):
    filled(store)
    other.import_archive(read_archive(store.export_all()))
    again = other.import_archive(read_archive(store.export_all()))
    assert (again.chats_added, again.chats_merged, again.chats_unchanged, again.messages_added) == (0, 0, 2, 0)
    trip = next(c for c in store.list() if c.title == "Trip")
    store.add_message(trip.id, "user", "And a fourth day?")  # the chat went on where the archive came from
    merged = other.import_archive(read_archive(store.export_all()))
    assert (merged.chats_merged, merged.messages_added) == (1, 1)
    assert "new messages in 1 chat already here" in str(merged)
    assert everything(other)["chats"]["Trip"]["messages"] == everything(store)["chats"]["Trip"]["messages"]


def open_webui_export() -> list[dict]:
    """Open WebUI's export (Settings → Chats → Export chats): its chats table, each with the chat's JSON, whose
    history keeps every message by id with its parentId, and currentId the branch shown."""
    messages = {
        "u1": {"id": "u1", "parentId": None, "childrenIds": ["a1", "a2"], "role": "user", "content": "Hi there",
               "timestamp": 1_717_000_000, "models": ["llama3"]},
        "a1": {"id": "a1", "parentId": "u1", "childrenIds": [], "role": "assistant", "content": "Hello!",
               "timestamp": 1_717_000_005, "model": "llama3"},
        "a2": {"id": "a2", "parentId": "u1", "childrenIds": ["u2"], "role": "assistant",
               "content": "Hi! How can I help?", "timestamp": 1_717_000_010, "model": "llama3"},
        "u2": {"id": "u2", "parentId": "a2", "childrenIds": ["a3"], "role": "user", "content": "Tell me a joke.",
               "timestamp": 1_717_000_020},
        "a3": {"id": "a3", "parentId": "u2", "childrenIds": [], "role": "assistant", "content": "Why did the ...",
               "timestamp": 1_717_000_025, "model": "llama3"},
    }  # fmt: skip
    chat = {
        "id": "",
        "title": "Greeting",
        "models": ["llama3"],
        "history": {"messages": messages, "currentId": "a3"},
        "messages": [messages[k] for k in ("u1", "a2", "u2", "a3")],
        "timestamp": 1_717_000_000_000,
    }
    return [
        {"id": "6f1c-greeting", "user_id": "u-1", "title": "Greeting", "chat": chat, "created_at": 1_717_000_000,
         "updated_at": 1_717_000_030, "share_id": None, "archived": False, "pinned": False, "meta": {},
         "folder_id": None},
        {"id": "9a2b-plain", "user_id": "u-1", "title": "No history", "chat": {"title": "No history", "messages": [
            {"id": "x1", "role": "user", "content": "One"}, {"id": "x2", "role": "assistant", "content": "Two"}]},
         "created_at": 1_717_100_000, "updated_at": 1_717_100_000},
    ]  # fmt: skip


def test_an_open_webui_export_comes_in_with_its_branches(store):
    report = store.import_archive(read_archive(json.dumps(open_webui_export())))
    assert (report.source, report.chats_added, report.messages_added) == ("Open WebUI", 2, 7)
    chats = everything(store)["chats"]
    assert chats["Greeting"]["shown"] == ["Hi there", "Hi! How can I help?", "Tell me a joke.", "Why did the ..."]
    assert (("Hi there", "Hello!"), "assistant", "{}") in chats["Greeting"]["messages"]  # the other reply, kept
    assert chats["No history"]["shown"] == ["One", "Two"]
    greeting = next(c for c in store.list() if c.title == "Greeting")
    assert greeting.created == 1_717_000_000
    again = store.import_archive(read_archive(json.dumps(open_webui_export())))
    assert (again.chats_added, again.messages_added) == (0, 0)


def chatgpt_export() -> list[dict]:
    """ChatGPT's conversations.json (Settings → Data controls → Export): a mapping of nodes with parent and
    children, the root's message null, a hidden system message, a tool call, and a regenerated reply."""

    def node(nid, parent, children, role=None, parts=None, t=None, **extra):
        message = None
        if role is not None:
            message = {
                "id": nid, "author": {"role": role, "name": None, "metadata": {}}, "create_time": t,
                "content": {"content_type": extra.pop("content_type", "text"), "parts": parts},
                "status": "finished_successfully", "metadata": extra.pop("metadata", {}), "recipient": "all",
            }  # fmt: skip
        return {"id": nid, "message": message, "parent": parent, "children": children}

    mapping = {
        "root": node("root", None, ["sys"]),
        "sys": node("sys", "root", ["q"], "system", [""], None,
                    metadata={"is_visually_hidden_from_conversation": True}),
        "q": node("q", "sys", ["tool", "r2"], "user", ["What is 2+2?"], 1_700_000_000.5),
        "tool": node("tool", "q", ["r1"], "tool", None, 1_700_000_001.0, content_type="code"),
        "r1": node("r1", "tool", [], "assistant", ["Four."], 1_700_000_002.0),
        "r2": node("r2", "q", [], "assistant", ["It is 4."], 1_700_000_003.0),
    }  # fmt: skip
    return [
        {"title": "Sums", "create_time": 1_700_000_000.1, "update_time": 1_700_000_010.2, "mapping": mapping,
         "moderation_results": [], "current_node": "r1", "plugin_ids": None, "conversation_id": "c0ffee-1",
         "id": "c0ffee-1", "default_model_slug": "gpt-4o", "is_archived": False}
    ]  # fmt: skip


def test_a_chatgpt_export_comes_in_with_its_regenerated_replies(store):
    report = store.import_archive(read_archive(json.dumps(chatgpt_export())))
    assert (report.source, report.chats_added, report.messages_added) == ("ChatGPT", 1, 3)
    chat = everything(store)["chats"]["Sums"]
    assert chat["shown"] == ["What is 2+2?", "Four."]  # the current node, its tool call left out
    assert sorted(p for p, _, _ in chat["messages"]) == [
        ("What is 2+2?",),
        ("What is 2+2?", "Four."),
        ("What is 2+2?", "It is 4."),
    ]
    assert store.import_archive(read_archive(json.dumps(chatgpt_export()))).messages_added == 0


@pytest.mark.parametrize(
    "text, says",
    [
        ("not json at all", "This is not JSON"),
        (json.dumps({"hello": "world"}), "none of the kinds Pagoda imports"),
        (json.dumps([1, 2, 3]), "none of the kinds Pagoda imports"),
        (json.dumps({"format": "pagoda.archive", "version": 99, "chats": []}), "written by a newer Pagoda"),
        (json.dumps({"format": "pagoda.archive", "version": 1, "chats": [{"uid": "x", "messages": [
            {"uid": "m2", "parent": "m1", "role": "user", "content": "orphan"}]}]}), "its parent must come before it"),
        (json.dumps({"format": "pagoda.archive", "version": 1, "files": [{"sha256": "00", "data": "aGk="}]}),
         "damaged: its bytes do not match its sha256"),
        (json.dumps({"format": "pagoda.archive", "version": 1, "chats": [{"uid": "x", "messages": None}]}),
         "a field in it does not"),
        (json.dumps([{"id": "c", "chat": {"messages": None}}]), "a field in it does not"),
        (json.dumps([{"mapping": {"n": {"message": {"author": "user", "content": {"content_type": "text"}}}}}]),
         "a field in it does not"),
        (json.dumps({"format": "pagoda.archive", "version": 1, "files": [{"sha256": "00", "data": 5}]}),
         "a field in it does not|not base64"),
    ],
)  # fmt: skip
def test_a_file_of_the_wrong_kind_says_why_and_nothing_changes(store, text, says):
    filled(store)
    before = everything(store)
    with pytest.raises(ValueError, match=says):
        store.import_archive(read_archive(text))
    assert everything(store) == before


def test_a_chat_exported_alone_is_imported_as_a_new_chat_each_time(store):
    filled(store)
    code = next(c for c in store.list() if c.title == "Code")
    text = store.export_json(code.id)
    for _ in range(2):
        store.import_archive(read_archive(text))
    assert [c.title for c in store.list()].count("Code") == 3


def test_an_archived_chat_without_a_leaf_shows_its_newest_message(store):
    archive = {"format": "pagoda.archive", "version": 1, "chats": [{"uid": "x", "title": "No leaf", "messages": [
        {"uid": "a", "parent": None, "role": "user", "content": "first"},
        {"uid": "b", "parent": "a", "role": "assistant", "content": "second"}]}]}  # fmt: skip
    store.import_archive(read_archive(json.dumps(archive)))
    assert everything(store)["chats"]["No leaf"]["shown"] == ["first", "second"]
