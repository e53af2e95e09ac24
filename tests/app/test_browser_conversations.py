"""In a real browser (tests/app/browser_session.py): a chat's branches and files. Regenerate keeps the old replies
behind ‹ 2/3 ›, ✎ edit on any message of the user's starts a new branch and the old one comes back, "new chat from
here" copies a chat down to a message into a new chat, and editing a message whose reply still streams stops it.
Files attached (a PDF, a DOCX) are asked about, and their KV comes from the prefix cache the second time; one too
big for the context asks first, and one that cannot be read says why. Open WebUI's and ChatGPT's exports come in
with their branches, and every chat comes back from Export all after a wipe."""

import json
import time

import pytest

from tests.app import browser_session
from tests.app.browser_session import shot, wait_for_js, wait_idle
from tests.app.document_files import docx_bytes, pdf_bytes
from tests.app.test_archive import chatgpt_export, open_webui_export

session, open_page, app_log_on_failure = (
    browser_session.session,
    browser_session.open_page,
    browser_session.app_log_on_failure,
)

pytestmark = pytest.mark.timeout(900)

GREEDY = [0.0, 1.0, -1, 0.0, 1.0]  # temperature, top_p, top_k, min_p, repetition_penalty
USERS = '#chatbot [data-testid="user"]'
BOTS = '#chatbot [data-testid="bot"]'


def chat_with_turns(client, questions: list[str], max_tokens: int = 16) -> int:
    """A chat made through the page's API, answered greedily and briefly."""
    conv = client.predict("", "", api_name="/new_chat")["value"]
    for question in questions:
        list(client.submit(conv, question, "", *GREEDY, max_tokens, api_name="/respond"))
    return conv


def open_chat(page, conv: int, users: int) -> None:
    """Pick the chat in the list (once the list's refresh has it), until its `users` messages show."""
    page.locator(f'#chat-list input[value="{conv}"]').click(timeout=20000)
    wait_for_js(page, f"() => document.querySelectorAll('{USERS}').length === {users}", timeout=20000)


def words(page, selector: str, index: int) -> str:
    """A row's text without the line under it (stats and links)."""
    return page.evaluate(
        f"() => {{ const row = [...document.querySelectorAll('{selector}')].at({index}).cloneNode(true); "
        "row.querySelectorAll('sub').forEach((s) => s.remove()); return row.innerText.trim(); }"
    )


def footer(page, selector: str, index: int) -> str:
    return page.evaluate(
        f"() => [...document.querySelectorAll('{selector}')].at({index}).querySelector('sub')?.innerText || ''"
    )


def wait_footer(page, selector: str, index: int, text: str) -> None:
    wait_for_js(
        page,
        f"() => ([...document.querySelectorAll('{selector}')].at({index})?.querySelector('sub')?.innerText || '')"
        f".includes({text!r})",
        timeout=60000,
    )


def test_regenerate_twice_then_switch_between_the_three_replies(session, open_page):
    _, client, _ = session
    conv = chat_with_turns(client, ["Name a colour."])
    page = open_page()
    open_chat(page, conv, users=1)
    replies = [words(page, BOTS, -1)]
    for n in (2, 3):
        page.get_by_role("button", name="Regenerate").click()
        wait_footer(page, BOTS, -1, f"{n}/{n}")
        wait_idle(client)
        wait_footer(page, BOTS, -1, "first token")  # the reply has ended: its stats are in
        replies.append(words(page, BOTS, -1))
    for n in (2, 1):
        page.locator(BOTS).last.get_by_role("link", name="‹").click()
        wait_footer(page, BOTS, -1, f"{n}/3")
        assert words(page, BOTS, -1) == replies[n - 1]
    page.locator(BOTS).last.get_by_role("link", name="›").click()
    wait_footer(page, BOTS, -1, "2/3")
    assert words(page, BOTS, -1) == replies[1]
    assert page.locator(USERS).count() == 1 and page.locator(BOTS).count() == 1
    shot(page, "chat-branches.png")
    page.reload()  # the chat remembers the reply it shows
    page.locator("#context-meter").get_by_text("Context:").wait_for()
    open_chat(page, conv, users=1)
    wait_footer(page, BOTS, -1, "2/3")
    assert words(page, BOTS, -1) == replies[1]
    assert client.predict(conv, api_name="/messages")[-1]["content"] == replies[1]


def test_editing_the_first_message_of_three_turns_branches_and_the_old_branch_comes_back(session, open_page):
    _, client, _ = session
    questions = ["What is a cat?", "What is a dog?", "What is a cow?"]
    conv = chat_with_turns(client, questions)
    before = [(m["role"], m["content"]) for m in client.predict(conv, api_name="/messages")]
    page = open_page()
    open_chat(page, conv, users=3)
    page.locator(USERS).first.get_by_role("link", name="✎ edit").click()
    box = page.locator("#message textarea")
    wait_for_js(page, "() => document.querySelector('#message textarea').value === 'What is a cat?'", timeout=20000)
    page.locator("#edit-note").get_by_text("Editing").wait_for()
    shot(page, "chat-edit.png")
    box.fill("What is a horse?")
    box.press("Enter")
    wait_for_js(page, f"() => document.querySelectorAll('{USERS}').length === 1", timeout=30000)
    wait_idle(client)
    wait_footer(page, USERS, 0, "2/2")
    assert words(page, USERS, 0) == "What is a horse?"
    assert not page.locator("#edit-note").is_visible()
    page.locator(USERS).first.get_by_role("link", name="‹").click()  # back to the old branch, whole
    wait_for_js(page, f"() => document.querySelectorAll('{USERS}').length === 3", timeout=20000)
    wait_footer(page, USERS, 0, "1/2")
    assert [words(page, USERS, i) for i in range(3)] == questions
    assert [(m["role"], m["content"]) for m in client.predict(conv, api_name="/messages")] == before


def test_branch_into_a_new_chat_copies_the_chat_down_to_that_reply(session, open_page):
    _, client, _ = session
    conv = chat_with_turns(client, ["Name a fruit.", "Name a tree."])
    original = client.predict(conv, api_name="/messages")
    page = open_page()
    open_chat(page, conv, users=2)
    page.locator(BOTS).first.get_by_role("link", name="new chat from here").click()
    wait_for_js(
        page,
        "() => (document.querySelector('#chat-list input:checked')?.closest('label').innerText || '')"
        ".endsWith('(branch)')",
        timeout=20000,
    )
    wait_for_js(page, f"() => document.querySelectorAll('{USERS}').length === 1", timeout=20000)
    branch = int(page.evaluate("() => document.querySelector('#chat-list input:checked').value"))
    assert branch != conv
    copied = client.predict(branch, api_name="/messages")
    assert [(m["role"], m["content"]) for m in copied] == [(m["role"], m["content"]) for m in original[:2]]
    assert words(page, BOTS, -1) == original[1]["content"]
    assert client.predict(conv, api_name="/messages") == original  # the chat itself is as it was


def test_editing_a_message_whose_reply_streams_stops_it_and_keeps_it_in_the_old_branch(session, open_page):
    """Editing deleted the rows under a streaming reply: the page kept showing it and "No message with id"."""
    _, client, _ = session
    conv = chat_with_turns(client, [])
    page = open_page()
    open_chat(page, conv, users=0)
    box = page.locator("#message textarea")
    box.fill("Write a very long story about a miller, with many chapters.")
    box.press("Enter")
    wait_for_js(page, f"() => ([...document.querySelectorAll('{BOTS}')].pop()?.innerText || '').length > 20", 120000)
    page.locator(USERS).first.get_by_role("link", name="✎ edit").click()
    wait_for_js(
        page, "() => document.querySelector('#message textarea').value.startsWith('Write a very long')", timeout=20000
    )
    wait_idle(client)
    wait_footer(page, BOTS, -1, "stopped")  # it ended there, and says so
    time.sleep(1)  # a late frame of the stopped reply would land now
    assert "No message with id" not in page.locator("body").inner_text()
    box.fill("Write one line about a miller.")
    box.press("Enter")
    wait_footer(page, USERS, 0, "2/2")
    wait_idle(client)
    page.locator(USERS).first.get_by_role("link", name="‹").click()
    wait_footer(page, USERS, 0, "1/2")
    wait_footer(page, BOTS, -1, "stopped")  # the stopped story is still there, in its branch


# ---- files ----------------------------------------------------------------------------------------


def attach(page, paths: list) -> None:
    with page.expect_file_chooser() as chooser:
        page.locator("#attach").click()
    chooser.value.set_files([str(p) for p in paths])


def test_a_pdf_and_a_docx_attached_are_asked_about_and_their_tokens_come_from_the_cache(session, open_page, tmp_path):
    _, client, _ = session
    pdf, docx = tmp_path / "keeper.pdf", tmp_path / "ship.docx"
    pdf.write_bytes(pdf_bytes(["The lighthouse keeper is named Ada Lovelock."] * 3))
    docx.write_bytes(docx_bytes(["The supply ship is called the Ortolan."] * 3))
    conv = chat_with_turns(client, [])
    page = open_page()
    open_chat(page, conv, users=0)
    attach(page, [pdf, docx])
    page.locator("#chat-files").get_by_text("keeper.pdf").wait_for(timeout=20000)
    page.locator("#chat-files").get_by_text("ship.docx").wait_for(timeout=20000)
    assert " tokens" in page.locator("#chat-files").inner_text()
    box = page.locator("#message textarea")
    for n, question in enumerate(["Who is the lighthouse keeper?", "What is the ship called?"]):
        box.fill(question)
        box.press("Enter")
        wait_for_js(page, f"() => document.querySelectorAll('{USERS}').length === {n + 1}", timeout=20000)
        wait_idle(client)
        wait_footer(page, BOTS, -1, "from the prefix cache")
    first, second = (m["meta"] for m in client.predict(conv, api_name="/messages")[1::2])
    assert first["prompt_tokens"] > 60  # the files are in the prompt
    assert second["cached_tokens"] >= first["prompt_tokens"] - 32  # read once: the files came from the cache
    shot(page, "chat-files.png")
    page.locator("#chat-files").get_by_role("link", name="remove").first.click()
    wait_for_js(page, "() => !document.querySelector('#chat-files').innerText.includes('keeper.pdf')", timeout=20000)
    assert "ship.docx" in page.locator("#chat-files").inner_text()


def test_a_file_too_big_for_the_context_asks_first_and_an_unreadable_one_says_why(session, open_page, tmp_path):
    _, client, _ = session
    book = tmp_path / "book.txt"
    book.write_text(" ".join(f"line {i} of the very long book." for i in range(3000)))
    broken = tmp_path / "broken.pdf"
    broken.write_bytes(b"%PDF-1.4 this file was cut off")
    conv = chat_with_turns(client, [])
    page = open_page()
    open_chat(page, conv, users=0)
    attach(page, [book, broken])
    page.get_by_text("could not be read as a PDF").first.wait_for(timeout=20000)
    choice = page.locator("#file-choice")
    choice.get_by_text("Nothing is attached yet").wait_for(timeout=20000)
    assert page.locator("#chat-files").inner_text().strip() == ""
    choice.get_by_role("button", name="Keep its start").click()
    page.locator("#chat-files").get_by_text("(its start only)").wait_for(timeout=30000)
    assert not choice.is_visible()


# ---- every chat, out and in -------------------------------------------------------------------------------


def import_file(page, path) -> None:
    if not page.locator("#import-chats").is_visible():
        page.get_by_text("Import or export all").click()
    with page.expect_file_chooser() as chooser:
        page.locator("#import-chats").click()
    chooser.value.set_files(str(path))


def test_open_webui_and_chatgpt_exports_are_imported_with_their_branches(session, open_page, tmp_path):
    _, client, _ = session
    webui, chatgpt = tmp_path / "open-webui-chats.json", tmp_path / "conversations.json"
    webui.write_text(json.dumps(open_webui_export()))
    chatgpt.write_text(json.dumps(chatgpt_export()))
    page = open_page()
    import_file(page, webui)
    page.get_by_text("Imported from Open WebUI: 2 new chats").wait_for(timeout=20000)
    import_file(page, chatgpt)
    page.get_by_text("Imported from ChatGPT: 1 new chat").wait_for(timeout=20000)
    sums = next(c for c in client.predict(api_name="/conversations") if c["title"] == "Sums")
    open_chat(page, sums["id"], users=1)
    assert words(page, BOTS, -1) == "Four."
    wait_footer(page, BOTS, -1, "1/2")  # ChatGPT's regenerated reply is the other branch
    page.locator(BOTS).last.get_by_role("link", name="›").click()
    wait_footer(page, BOTS, -1, "2/2")
    assert words(page, BOTS, -1) == "It is 4."
    greeting = next(c for c in client.predict(api_name="/conversations") if c["title"] == "Greeting")
    shown = [m["content"] for m in client.predict(greeting["id"], api_name="/messages")]
    assert shown == ["Hi there", "Hi! How can I help?", "Tell me a joke.", "Why did the ..."]
    import_file(page, webui)  # again: nothing new
    page.get_by_text("Imported from Open WebUI: 0 new chats, 2 already here, unchanged").wait_for(timeout=20000)


def test_export_all_then_wipe_then_import_gives_back_every_chat(session, open_page, tmp_path):
    _, client, _ = session
    chat_with_turns(client, ["Name a river.", "Name a mountain."])

    def all_chats() -> list:
        """Each chat with messages: its title and the messages it shows (an empty one has nothing to lose, and
        the page makes one as it opens on no chat)."""
        chats = [
            (c["title"], [(m["role"], m["content"]) for m in client.predict(c["id"], api_name="/messages")])
            for c in client.predict(api_name="/conversations")
        ]
        return sorted((title, shown) for title, shown in chats if shown)

    before = all_chats()
    page = open_page()
    page.get_by_text("Import or export all").click()
    with page.expect_download(timeout=30000) as download:
        page.locator("#export-all").click()
    archive = tmp_path / download.value.suggested_filename
    download.value.save_as(archive)
    assert archive.name.startswith("pagoda-chats-") and json.loads(archive.read_text())["format"] == "pagoda.archive"
    for chat in client.predict(api_name="/conversations"):  # wiped
        client.predict(chat["id"], api_name="/delete")
    page.reload()
    page.locator("#context-meter").get_by_text("Context:").wait_for()
    import_file(page, archive)
    page.get_by_text("Imported from Pagoda").wait_for(timeout=30000)
    assert all_chats() == before and len(before) >= 2


def test_pin_a_chat_put_one_in_a_folder_and_find_one_by_a_word_of_a_reply(session, open_page):
    _, client, _ = session
    pinned = chat_with_turns(client, ["Name a planet."])
    filed = chat_with_turns(client, ["Name a moon of Jupiter."])
    reply = client.predict(filed, api_name="/messages")[-1]["content"]
    page = open_page()
    open_chat(page, pinned, users=1)
    page.get_by_text("Rename, pin, folder or delete").click()
    page.locator("#pin-chat").click()
    first = "() => document.querySelector('#chat-list label')?.innerText.trim()"
    wait_for_js(page, f"() => ({first})() === '📌 Name a planet.'", timeout=20000)
    assert page.locator("#pin-chat").inner_text() == "Unpin"
    open_chat(page, filed, users=1)
    wait_for_js(page, f"() => document.querySelector('{USERS}').innerText.includes('Jupiter')", timeout=20000)
    # The chat's opening also fills the Pin button and the Folder field (empty): typed before, it was overwritten
    wait_for_js(page, "() => document.querySelector('#pin-chat').innerText.trim() === 'Pin to top'", timeout=20000)
    folder = page.locator("#chat-folder textarea, #chat-folder input").first
    folder.fill("Astronomy")
    folder.press("Enter")
    page.locator("#chat-list").get_by_text("Astronomy › Name a moon of Jupiter.").wait_for(timeout=20000)
    word = max(reply.split(), key=len).strip(".,!?;:\"'()*")  # a word of the reply, not of the title
    page.get_by_placeholder("Search chats…").fill(word)
    wait_for_js(
        page,
        "() => [...document.querySelectorAll('#chat-list label')].some((l) => l.innerText.includes('Jupiter'))"
        " && ![...document.querySelectorAll('#chat-list label')].some((l) => l.innerText.includes('planet'))",
        timeout=20000,
    )
