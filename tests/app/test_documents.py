"""Files attached to a chat: their text read from each kind, damaged and unknown files refused with what to do, kept
once per content, exported and imported with the chat, and carried right after the system prompt."""

import base64
import json
from types import SimpleNamespace

import gradio as gr
import pytest

from app.attach_events import QUESTION_ROOM
from app.backend import reply_room
from app.chat_settings import ChatSettings
from app.model_host import ModelHost
from app.store import ConversationStore
from app.ui import PagodaUI
from entrypoints.documents import DocumentError, content_hash, extract_text, with_documents
from tests.app.document_files import docx_bytes, pdf_bytes, protected_pdf_bytes
from tests.app.test_ui_sessions import EndlessBackend

PAGE = SimpleNamespace(session_hash="page")


def docx_with_broken_xml() -> bytes:
    """A Word document whose main part is not well-formed XML (lxml raised XMLSyntaxError, a traceback)."""
    import io
    import zipfile

    source, out = zipfile.ZipFile(io.BytesIO(docx_bytes(["text"]))), io.BytesIO()
    with zipfile.ZipFile(out, "w") as target:
        for item in source.infolist():
            data = source.read(item)
            target.writestr(item, b"<w:document><unclosed>" if item.filename == "word/document.xml" else data)
    return out.getvalue()


# ---- reading ------------------------------------------------------------------------------------


def test_text_markdown_code_csv_and_json_are_read_as_utf8():
    for name in ("notes.txt", "README.md", "main.py", "table.csv", "data.json", "Makefile"):
        assert extract_text(name, "héllo, wörld\r\nline two\n".encode()) == "héllo, wörld\nline two"
    assert extract_text("bom.txt", b"\xef\xbb\xbfwith a BOM") == "with a BOM"


def test_a_pdf_is_read_page_by_page():
    data = pdf_bytes(["The keeper is Ada.\nShe feeds the cat at noon.", "The ship is the Ortolan."])
    text = extract_text("Report.PDF", data)
    assert text.index("The keeper is Ada.") < text.index("She feeds the cat") < text.index("The ship is the Ortolan")


def test_a_word_document_is_read_with_its_tables():
    data = docx_bytes(["Minutes of the meeting.", "Budget approved."], table=[["Item", "Cost"], ["Lamp", "12"]])
    assert extract_text("minutes.docx", data) == "Minutes of the meeting.\nBudget approved.\nItem | Cost\nLamp | 12"


@pytest.mark.parametrize(
    "name, data, says",
    [
        ("broken.pdf", b"%PDF-1.4\nthis is not a PDF at all", "could not be read as a PDF"),
        ("locked.pdf", protected_pdf_bytes("secret text"), "protected by a password"),
        ("blank.pdf", pdf_bytes([""]), "has no text in it (a scan?"),
        ("broken.docx", b"PK\x03\x04 not a zip", "could not be read as a Word document"),
        ("bad-xml.docx", docx_with_broken_xml(), "could not be read as a Word document"),
        ("photo.png", b"\x89PNG\r\n", "cannot read .png files"),
        ("program", b"\x7fELF", "cannot read files without a suffix"),
        ("latin1.txt", "café".encode("latin-1"), "is not UTF-8 text"),
        ("empty.md", b"  \n", "has no text in it"),
    ],
)
def test_files_that_cannot_be_read_say_why(name, data, says):
    with pytest.raises(DocumentError, match=says.replace("(", r"\(").replace("?", r"\?")):
        extract_text(name, data)


def test_documents_go_right_after_the_system_prompt_in_the_order_attached():
    assert with_documents("Be brief.", [("a.txt", "A"), ("b.txt", "B")]) == (
        'Be brief.\n\n<document name="a.txt">\nA\n</document>\n\n<document name="b.txt">\nB\n</document>'
    )
    assert with_documents("", []) == "" and with_documents("Be brief.", []) == "Be brief."


# ---- the store ----------------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path):
    s = ConversationStore(tmp_path / "pagoda.db")
    yield s
    s.close()


def attach(store, cid, name: str, data: bytes, keep: int | None = None):
    return store.attach_file(cid, name, content_hash(data), data, extract_text(name, data), keep)


def stored_files(store) -> int:
    return store._conn.execute("SELECT count(*) FROM files").fetchone()[0]


def test_a_file_is_kept_once_however_many_chats_attach_it_and_goes_with_the_last(store):
    a, b = store.create("a").id, store.create("b").id
    data = b"The same notes."
    attach(store, a, "notes.txt", data)
    attach(store, b, "copy of notes.txt", data)
    assert stored_files(store) == 1
    assert [f.name for f in store.chat_files(b)] == ["copy of notes.txt"]
    store.detach_file(a, content_hash(data))
    assert store.chat_files(a) == [] and stored_files(store) == 1
    store.delete(b)
    assert stored_files(store) == 0


def test_a_shortened_file_carries_its_start_and_knows_it(store):
    cid = store.create().id
    f = attach(store, cid, "long.txt", b"0123456789" * 10, keep=25)
    assert f.text == "0123456789012345678901234" and f.total_chars == 100 and f.shortened
    assert not attach(store, cid, "long.txt", b"0123456789" * 10).shortened  # attached again, whole


def test_new_chat_from_here_takes_the_files_along(store):
    cid = store.create().id
    attach(store, cid, "notes.txt", b"notes")
    question = store.add_message(cid, "user", "What do the notes say?")
    branch = store.branch(cid, question.id)
    assert [f.name for f in store.chat_files(branch.id)] == ["notes.txt"]
    store.delete(cid)
    assert store.file_data(content_hash(b"notes")) == b"notes"  # the branch still has it


def test_export_and_import_carry_the_files_and_their_cut(store):
    cid = store.create("Docs").id
    pdf = pdf_bytes(["Ada keeps the light."])
    attach(store, cid, "keeper.pdf", pdf)
    attach(store, cid, "long.txt", b"abcdefghij" * 5, keep=7)
    store.add_message(cid, "user", "Who keeps the light?")
    exported = store.export_json(cid)
    copy = store.import_json(exported)
    got = store.chat_files(copy.id)
    assert [(f.name, f.text, f.shortened) for f in got] == [
        ("keeper.pdf", "Ada keeps the light.", False),
        ("long.txt", "abcdefg", True),
    ]
    assert stored_files(store) == 2  # the same files: no second copy
    assert "Attached: keeper.pdf, long.txt (its start only)" in store.export_markdown(cid)


def test_an_export_whose_file_was_changed_is_refused_and_nothing_is_stored(store):
    cid = store.create("Docs").id
    attach(store, cid, "notes.txt", b"the notes")
    data = json.loads(store.export_json(cid))
    data["files"][0]["data"] = base64.b64encode(b"other notes").decode()
    chats = len(store.list())
    with pytest.raises(ValueError, match="damaged: its bytes do not match its sha256"):
        store.import_json(json.dumps(data))
    data["files"][0]["data"] = "not base64!"
    with pytest.raises(ValueError, match="not base64"):
        store.import_json(json.dumps(data))
    assert len(store.list()) == chats


# ---- the page -----------------------------------------------------------------------------------


class WordCounting(EndlessBackend):
    """Counts a word as a token, and keeps what each reply was asked."""

    max_model_len = 400

    def __init__(self):
        super().__init__()
        self.asked: list[list[dict]] = []

    def prompt_tokens(self, messages, settings) -> int:
        return sum(len(m["content"].split()) for m in messages)

    def submit(self, messages, settings):
        self.asked.append(messages)
        return super().submit(messages, settings)


@pytest.fixture
def ui(tmp_path):
    host = ModelHost()
    host.backend = WordCounting()
    ui = PagodaUI(ConversationStore(tmp_path / "chats.db"), host, max_file_mb=0.05)
    yield ui
    for task in ui.replies.running():
        task.cancel()


def write(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def test_attached_files_show_with_their_tokens_and_go_after_the_system_prompt(ui, tmp_path):
    cid = ui.store.create(system_prompt="Answer from the files.").id
    pdf = write(tmp_path, "keeper.pdf", pdf_bytes(["Ada keeps the light."]))
    doc = write(tmp_path, "ship.docx", docx_bytes(["The ship is the Ortolan."]))
    files, _meter, choice, _note = ui.attach_files(cid, [pdf, doc], PAGE)
    assert choice == gr.update(visible=False)
    assert "**keeper.pdf** · 7 tokens" in files and "**ship.docx** · 8 tokens" in files  # a word a token
    frames = ui.respond(cid, "Who keeps the light?", "Answer from the files.", 0.0, 1.0, -1, 0.0, 1.0, 16, PAGE)
    next(frames)
    frames.close()
    system = ui.host.backend.asked[-1][0]
    assert system["role"] == "system" and system["content"].startswith("Answer from the files.\n\n<document")
    assert "Ada keeps the light." in system["content"] and "The ship is the Ortolan." in system["content"]
    assert ui.host.backend.asked[-1][1:] == [{"role": "user", "content": "Who keeps the light?"}]


def test_unreadable_or_too_large_files_are_refused_and_the_others_attached(ui, tmp_path, monkeypatch):
    warned = []
    monkeypatch.setattr(gr, "Warning", warned.append)
    cid = ui.store.create().id
    good = write(tmp_path, "good.txt", b"fine words")
    bad = write(tmp_path, "broken.pdf", b"%PDF-1.4 nonsense")
    unknown = write(tmp_path, "song.mp3", b"ID3")
    huge = write(tmp_path, "huge.txt", b"word " * 13000)  # 63 kB, over the 0.05 MB limit
    files, *_ = ui.attach_files(cid, [good, bad, unknown, huge], PAGE)
    assert [f.name for f in ui.store.chat_files(cid)] == ["good.txt"]
    assert "could not be read as a PDF" in warned[0] and "cannot read .mp3 files" in warned[0]
    assert "huge.txt is 63 kB; files up to 0.05 MB are taken" in warned[0]


def test_a_file_too_big_for_the_context_waits_for_the_choice_and_is_never_cut_silently(ui, tmp_path):
    cid = ui.store.create().id
    big = write(tmp_path, "book.txt", " ".join(f"w{i}" for i in range(1500)).encode())
    files, _meter, choice, note = ui.attach_files(cid, [big], PAGE)
    assert choice == gr.update(visible=True) and "book.txt" in note and "Nothing is attached yet" in note
    assert ui.store.chat_files(cid) == [] and files == ""
    assert ui.discard_pending(PAGE) == gr.update(visible=False)
    assert ui.keep_start(cid, PAGE)[0] == ""  # nothing is waiting any more: nothing attached
    ui.attach_files(cid, [big], PAGE)
    files, _meter, choice = ui.keep_start(cid, PAGE)
    (kept,) = ui.store.chat_files(cid)
    room = 400 - reply_room(ChatSettings().max_tokens) - QUESTION_ROOM  # less the reply's room and a question's
    assert kept.shortened and ui.document_tokens(kept.name, kept.text) <= room
    assert ui.document_tokens(kept.name, kept.text + " w") > room - 2  # as much as fits, not much less
    assert "(its start only)" in files and choice == gr.update(visible=False)


def test_two_files_too_big_at_once_ask_about_one_and_say_so_of_the_other(ui, tmp_path, monkeypatch):
    warned = []
    monkeypatch.setattr(gr, "Warning", warned.append)
    cid = ui.store.create().id
    words = " ".join(f"w{i}" for i in range(1500)).encode()
    books = [write(tmp_path, "one.txt", words), write(tmp_path, "two.txt", words + b" more")]
    _files, _meter, choice, note = ui.attach_files(cid, books, PAGE)
    assert "one.txt" in note and "two.txt is too big for the context too" in warned[0]


def test_a_file_name_is_shown_as_text_not_markup(ui, tmp_path):
    cid = ui.store.create().id
    files, *_ = ui.attach_files(cid, [write(tmp_path, "[x](#pagoda-detach-0)*.txt", b"words")], PAGE)
    assert "**\\[x\\]\\(\\#pagoda-detach-0\\)\\*.txt**" in files and files.count("](#pagoda-detach-") == 1


def test_remove_takes_a_file_off_through_its_link(ui, tmp_path):
    cid = ui.store.create().id
    files, *_ = ui.attach_files(cid, [write(tmp_path, "a.txt", b"alpha")], PAGE)
    action = files.split("(#pagoda-")[1].split(")")[0]
    *_, files_after = ui.message_action(cid, action, PAGE)
    assert files_after == "" and ui.store.chat_files(cid) == []
    with pytest.raises(gr.Error, match="not attached any more"):
        ui.message_action(cid, action, PAGE)
