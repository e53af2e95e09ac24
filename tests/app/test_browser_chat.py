"""In a real browser (tests/app/browser_session.py, whose app process, browser and helpers these share): what a new
user reported in issue 28, item 5."""

import json
import re
import uuid
from pathlib import Path

import httpx
import pytest

from app.store import ConversationStore
from tests.app import browser_session
from tests.app.browser_session import send, start_new_chat, sync_api, wait_for_js, wait_idle

# browser_session's fixtures: an app process and a browser, a tab on the app, the app's log after a failed test
session, open_page, app_log_on_failure = (
    browser_session.session,
    browser_session.open_page,
    browser_session.app_log_on_failure,
)

pytestmark = pytest.mark.timeout(900)

LAST_BOT = "[...document.querySelectorAll('#chatbot [data-testid=\"bot\"]')].pop()"


def test_stop_inside_a_code_block_puts_the_stats_line_under_the_block(session, open_page):
    """The stats line (first token … · stopped) showed as code, inside the block the reply had open."""
    _, client, _ = session
    page = open_page()
    start_new_chat(page, "Write a long Python program with many functions, in one code block.")
    wait_for_js(
        page,
        f"() => {{ const code = {LAST_BOT}.querySelector('pre'); "
        "return code && code.innerText.trim().split('\\n').length >= 2; }",
        timeout=120000,
    )
    page.keyboard.press("Escape")  # Stop while the block is still open
    wait_for_js(page, f"() => {LAST_BOT}.innerText.includes('stopped')", timeout=30000)
    wait_idle(client)
    conversation = [c for c in client.predict(api_name="/conversations") if c["title"].startswith("Write a long")][0]
    reply = client.predict(conversation["id"], api_name="/messages")[-1]["content"]
    fences = [line for line in reply.split("\n") if line.lstrip().startswith("```")]
    assert len(fences) % 2 == 1, reply  # it was stopped inside the block, as the user did
    stats = page.evaluate(
        f"() => {{ const sub = {LAST_BOT}.querySelector('sub'); "
        "return sub && {text: sub.innerText, inCode: sub.closest('pre, code') !== null}; }"
    )
    assert stats is not None, "no <sub> element under the reply: its stats line was shown as code"
    assert "stopped" in stats["text"] and not stats["inCode"]
    assert "stopped" not in page.locator('#chatbot [data-testid="bot"] pre').last.inner_text()
    page.close()


def export(page, button: str) -> tuple[str, str]:
    """Click an Export button once: the name and the text of the file the browser downloads."""
    with page.expect_download(timeout=20000) as download:
        page.get_by_role("button", name=button).click()
    return download.value.suggested_filename, Path(download.value.path()).read_text(encoding="utf-8")


def rename(page, title: str) -> None:
    """Rename the open chat (the Rename or delete panel is open)."""
    page.get_by_label("Title", exact=True).fill(title)
    page.get_by_role("button", name="Rename", exact=True).click()


def test_export_right_after_a_switch_or_a_rename_is_the_chat_on_screen_with_its_title(session, open_page):
    """The files were made as a chat opened: an Export just after a switch gave the chat before, and one after a
    rename the old title."""
    app, client, _ = session
    titles = [f"Alpha {uuid.uuid4().hex[:6]}", f"Beta {uuid.uuid4().hex[:6]}"]
    for title in titles:
        chat = client.predict("", "", api_name="/new_chat")["value"]
        page = open_page()  # on the newest chat, open once the meter shows
        page.get_by_text("Rename, pin, folder or delete").click()
        rename(page, title)  # and at once:
        name, text = export(page, "Export JSON")
        with ConversationStore(app.home / "pagoda.db") as store:  # if not: did the Rename store the title typed?
            stored = store.get(chat).title
        assert (json.loads(text)["title"], name, stored) == (title, f"{title}.json", title)
    # Back to the first chat, and Export in the same instant (the chat is still opening)
    with page.expect_download(timeout=20000) as download:
        page.evaluate(
            "(title) => { const find = (css, fits) => [...document.querySelectorAll(css)].find(fits); "
            "find('#chat-list label', l => l.innerText.includes(title)).click(); "
            "find('button', b => b.innerText === 'Export Markdown').click(); }",
            titles[0],
        )
    name, text = download.value.suggested_filename, Path(download.value.path()).read_text(encoding="utf-8")
    assert name == f"{titles[0]}.md" and text.startswith(f"# {titles[0]}\n")
    name, text = export(page, "Export JSON")
    assert json.loads(text)["title"] == titles[0]
    sync_api.expect(page.get_by_label("Title", exact=True)).to_have_value(titles[0])  # it is on screen
    renamed = titles[0] + " renamed"
    rename(page, renamed)
    name, text = export(page, "Export Markdown")
    assert name == f"{renamed}.md" and text.startswith(f"# {renamed}\n")


def meter_count(page) -> int:
    return int(re.search(r"Context: ([\d,]+)", page.locator("#context-meter").inner_text())[1].replace(",", ""))


def test_a_system_prompt_typed_then_left_before_sending_is_kept_and_the_meter_counts_it(session, open_page):
    """It was saved only with the next message: a switch to another chat lost it, and the meter ignored it."""
    app, client, _ = session
    other = client.predict("", "", api_name="/new_chat")["value"]
    with ConversationStore(app.home / "pagoda.db") as store:  # no longer empty and untitled: New chat makes another
        store.rename(other, f"Other {uuid.uuid4().hex[:6]}")
    chat = client.predict("", "", api_name="/new_chat")["value"]
    page = open_page()  # on `chat`, the newest
    page.get_by_text("System prompt and sampling").click()
    box = page.locator("#system-prompt textarea")
    before = meter_count(page)
    prompt = "You are a patient tutor who explains every step of a calculation in plain words."
    box.click()
    box.press_sequentially(prompt, delay=5)
    counts_it = (
        "() => +document.querySelector('#context-meter').innerText.match(/Context: ([\\d,]+)/)[1]"
        f".replace(/,/g, '') > {before + 10}"
    )
    wait_for_js(page, counts_it, timeout=20000)  # counted as it is typed
    page.locator(f'#chat-list input[value="{other}"]').click()  # at once, before sending anything
    sync_api.expect(box).to_have_value("")
    assert meter_count(page) == before  # the other chat's meter: its prompt is empty too
    page.locator(f'#chat-list input[value="{chat}"]').click()
    sync_api.expect(box).to_have_value(prompt)
    wait_for_js(page, counts_it, timeout=20000)
    assert [c["system_prompt"] for c in client.predict(api_name="/conversations") if c["id"] == chat] == [prompt]


def test_the_browser_keeps_no_prompts_and_the_footer_has_no_runs_page(session, open_page):
    """Gradio's run history kept every prompt (deleted chats' too) in the browser's local storage and showed them
    under internal event names on a "Runs" page in the footer."""
    app, client, _ = session
    page = open_page()
    prompt = f"Tell me about the lighthouse number {uuid.uuid4().hex[:8]}."
    start_new_chat(page, prompt)
    page.keyboard.press("Escape")
    wait_for_js(page, f"() => {LAST_BOT}.innerText.includes('stopped')", timeout=30000)
    wait_idle(client)
    page.reload()  # and whatever a page keeps for the next visit
    page.locator("#context-meter").get_by_text("Context:").wait_for()
    stored = page.evaluate("() => JSON.stringify([{...localStorage}, {...sessionStorage}])")
    assert prompt.split()[-1] not in stored
    footer = page.locator("footer")
    assert "Use via API" in footer.inner_text()  # the footer is there, with the scripting API's page
    assert footer.get_by_text("Runs").count() == 0
    assert httpx.get(app.url + "gradio_api/runs", timeout=30).status_code == 404


def test_the_title_field_reads_the_title_the_first_message_gives(session, open_page):
    """The chat list took the new title, while the Title field under Rename or delete kept "New chat"."""
    _, client, _ = session
    page = open_page()
    page.get_by_text("Rename, pin, folder or delete").click()
    # A long reply (a short one ended before the check, on CI): the title must come while it streams
    start_new_chat(page, "Write a long story about a lighthouse.")
    title = page.get_by_label("Title", exact=True)
    sync_api.expect(title).to_have_value("Write a long story about a lighthouse.", timeout=10000)
    assert client.predict(api_name="/engine_stats")["num_running"] == 1  # while the reply still streams
    page.keyboard.press("Escape")
    wait_idle(client)


def test_inline_math_renders_and_prices_stay_text(session, open_page):
    """`$…$` math showed raw; with $ a delimiter, "$5 and $10" would have turned into math."""
    app, _, _ = session
    with ConversationStore(app.home / "pagoda.db") as store:  # the app's own database, as another process
        chat = store.create(title=f"Math {uuid.uuid4().hex[:6]}").id
        store.add_message(chat, "user", "Area of a circle?")
        store.add_message(
            chat,
            "assistant",
            "It is $\\pi r^2$, or \\(2\\pi r\\) around it. A compass costs $5 and a book $10.",
            {"finish_reason": "stop", "ttft_s": 0.1, "output_tokens": 9},
        )
    page = open_page()  # on the newest chat: this one
    wait_for_js(page, f"() => {LAST_BOT}.querySelectorAll('.katex').length >= 2", timeout=20000)
    maths = page.evaluate(f"() => [...{LAST_BOT}.querySelectorAll('.katex annotation')].map(a => a.textContent)")
    assert maths == ["\\pi r^2", "2\\pi r"]
    assert "costs $5 and a book $10." in page.evaluate(f"() => {LAST_BOT}.innerText")
    page.close()


def test_a_title_typed_right_after_new_chat_stays_in_the_field(session, open_page):
    """Typed while the new chat opened, the title was replaced by "New chat"; typed before the first reply, by the
    title the first message gave."""
    page = open_page()
    page.get_by_text("Rename, pin, folder or delete").click()
    title = page.get_by_label("Title", exact=True)
    page.get_by_role("button", name="New chat").click()
    # New chat has answered (the list shows the new chat chosen): type at once, while the chat opens. (Typing
    # before the server has even had the click is not covered: a person is not that fast.)
    wait_for_js(
        page,
        "() => document.querySelector('#chat-list input:checked')?.closest('label').innerText.trim() === 'New chat'",
        timeout=20000,
    )
    title.select_text()  # what the field holds now, replaced by what is typed
    title.press_sequentially("Lighthouses", delay=5)
    page.wait_for_timeout(1500)  # the opening, and a few timer ticks
    send(page, "How far can a lighthouse beam reach?")
    page.wait_for_timeout(1500)  # the first message titles the chat; the timer sends titles
    sync_api.expect(title).to_have_value("Lighthouses")
    page.get_by_role("button", name="Rename", exact=True).click()
    wait_for_js(page, "() => document.querySelector('#chat-list').innerText.includes('Lighthouses')", timeout=20000)
    page.keyboard.press("Escape")
