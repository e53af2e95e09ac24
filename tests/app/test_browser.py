"""In a real browser (tests/app/browser_session.py): chatting on the page.

Types a message, watches the reply stream in, starts a second chat on the same system prompt and watches the
KV-cache grid show their shared blocks; then the keyboard, the look, Stop, Edit, Export and Delete, a phone's
screen, and a reply cut by a crash. The Models tab is in test_browser_models.py, long prompts and a full context
in test_browser_context.py.
"""

import time
from pathlib import Path

import pytest

from tests.app import browser_session
from tests.app.app_process import AppProcess
from tests.app.browser_session import bot_text, send, shot, start_new_chat, wait_for_js, wait_idle

# browser_session's fixtures: an app process and a browser, a tab on the app, the app's log after a failed test
session, open_page, app_log_on_failure = (
    browser_session.session,
    browser_session.open_page,
    browser_session.app_log_on_failure,
)

# Starting the app and a browser on the bundled model takes minutes on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(900)


def test_chat_streams_and_the_grid_shows_two_chats_sharing_the_system_prompt(session, open_page):
    page = open_page()
    page.get_by_text("System prompt and sampling").click()
    system = (
        "You are Pagoda, a careful assistant that runs on the user's own computer. You answer in full "
        "sentences, you say so when you do not know, and you never make up facts about the user."
    )
    page.locator("#system-prompt textarea").fill(system)
    page.get_by_text("System prompt and sampling").click()  # fold it away again
    send(page, "Tell me a long story about a lighthouse keeper.")
    wait_for_js(page, "() => document.querySelectorAll('#chatbot [data-testid=\"bot\"]').length > 0", timeout=60000)
    # While it answers, the chat already carries its first words as its title in the sidebar.
    wait_for_js(
        page, "() => document.querySelector('#chat-list').innerText.includes('Tell me a long story')", timeout=10000
    )

    # A second chat with the same system prompt, started while the first one is still answering.
    page.get_by_role("button", name="New chat").click()
    wait_for_js(page, "() => document.querySelectorAll('#chatbot [data-testid=\"user\"]').length === 0", timeout=20000)
    send(page, "Tell me a long story about a lighthouse keeper's cat.")
    wait_for_js(page, "() => document.querySelectorAll('#chatbot [data-testid=\"bot\"]').length > 0", timeout=60000)
    first = bot_text(page)
    deadline = time.time() + 20
    while len(bot_text(page)) <= len(first) and time.time() < deadline:
        time.sleep(0.2)
    assert len(bot_text(page)) > len(first)  # still growing: it streams

    page.get_by_role("tab", name="KV cache").click()
    grid = page.locator("#kv-cache")
    # The system prompt's full blocks are shared (ref count 2) while both chats answer.
    wait_for_js(page, "() => document.querySelector('#kv-cache .grid i.shared') !== null", timeout=30000)
    assert grid.locator(".grid i.shared").first.inner_text() == "2"
    shot(page, "kv-cache-shared.png")
    page.get_by_role("tab", name="Chat").click()
    time.sleep(3)
    shot(page, "chat.png")
    page.close()


def test_closing_the_tab_aborts_its_replies(session, open_page):
    _, client, _ = session
    running = lambda: client.predict(api_name="/engine_stats")["num_running"]
    deadline = time.time() + 30
    while running() and time.time() < deadline:  # the previous test closed its tab: its replies stop
        time.sleep(0.2)
    assert running() == 0
    page = open_page()
    page.get_by_role("button", name="New chat").click()
    wait_for_js(page, "() => document.querySelectorAll('#chatbot [data-testid=\"user\"]').length === 0", timeout=20000)
    send(page, "Write a very long story about a dragon, with many chapters.")
    deadline = time.time() + 60
    while running() == 0 and time.time() < deadline:
        time.sleep(0.2)
    assert running() == 1
    page.close()  # the user closes the tab
    deadline = time.time() + 30
    while running() and time.time() < deadline:
        time.sleep(0.2)
    assert running() == 0


def test_keyboard_and_look_header_shift_enter_escape_and_dark_mode(session, open_page):
    _, client, _ = session
    running = lambda: client.predict(api_name="/engine_stats")["num_running"]
    deadline = time.time() + 30
    while running() and time.time() < deadline:
        time.sleep(0.2)
    page = open_page()
    dark = "() => document.body.classList.contains('dark')"
    was_dark = page.evaluate(dark)
    page.get_by_role("button", name="Light / dark").click()
    assert page.evaluate(dark) is not was_dark
    # The model and the device, always in view (a page shows "Loading <model>…" until its load event fills them in).
    wait_for_js(page, "() => document.querySelector('#header').innerText.includes('CPU')", timeout=20000)
    assert "SmolLM2-135M-Instruct" in page.locator("#header").inner_text()
    page.get_by_role("button", name="New chat").click()
    wait_for_js(page, "() => document.querySelectorAll('#chatbot [data-testid=\"user\"]').length === 0", timeout=20000)
    box = page.locator("#message textarea")
    box.click()
    box.press_sequentially("line one", delay=5)
    box.press("Shift+Enter")  # a new line, not a send
    box.press_sequentially("line two", delay=5)
    assert box.input_value() == "line one\nline two"
    assert page.locator('#chatbot [data-testid="user"]').count() == 0
    box.fill("")
    send(page, "Write a very long story about a knight, with many chapters.")
    # Stop once some of the reply shows (the reply's bubble appears empty, before its first token).
    wait_for_js(
        page,
        "() => { const bots = document.querySelectorAll('#chatbot [data-testid=\"bot\"]'); "
        "return bots.length > 0 && bots[bots.length - 1].innerText.trim().length > 0; }",
        timeout=60000,
    )
    assert running() == 1
    page.keyboard.press("Escape")  # the shortcut for Stop
    deadline = time.time() + 20
    while running() and time.time() < deadline:
        time.sleep(0.2)
    assert running() == 0
    assert bot_text(page)  # what was written so far stays
    page.get_by_role("button", name="Light / dark").click()
    assert page.evaluate(dark) is was_dark
    page.close()


def test_the_page_chats_on_localhost_too(session, open_page):
    """The Host and Origin checks let the app's own page through under either local name."""
    _, client, _ = session
    running = lambda: client.predict(api_name="/engine_stats")["num_running"]
    page = open_page("localhost")
    page.get_by_role("button", name="New chat").click()
    wait_for_js(page, "() => document.querySelectorAll('#chatbot [data-testid=\"user\"]').length === 0", timeout=20000)
    send(page, "Say hello.")
    wait_for_js(
        page,
        "() => { const bots = document.querySelectorAll('#chatbot [data-testid=\"bot\"]'); "
        "return bots.length > 0 && bots[bots.length - 1].innerText.trim().length > 0; }",
        timeout=60000,
    )
    page.keyboard.press("Escape")
    deadline = time.time() + 20
    while running() and time.time() < deadline:
        time.sleep(0.2)
    assert running() == 0
    page.close()


def exported_json(page) -> dict:
    """Click Export JSON once and read the file the browser downloads."""
    import json

    with page.expect_download(timeout=20000) as download:
        page.get_by_role("button", name="Export JSON").click()
    return json.loads(Path(download.value.path()).read_text(encoding="utf-8"))


def test_export_downloads_the_chat_on_screen_at_the_first_click(session, open_page):
    """Each Export click gives the open chat as it is: it once gave the previous click's file, which after
    a chat switch was the other chat."""
    _, client, _ = session
    running = lambda: client.predict(api_name="/engine_stats")["num_running"]
    page = open_page()
    texts = {}
    for name in ("Alpha", "Beta"):
        texts[name] = f"{name} question: name a colour."
        start_new_chat(page, texts[name])
        page.keyboard.press("Escape")  # stopped: the reply is final, so the files are made again
        deadline = time.time() + 20
        while running() and time.time() < deadline:
            time.sleep(0.2)
        # Made when the reply ended; a click now downloads the chat with its reply.
        deadline = time.time() + 10
        while time.time() < deadline:
            chat = exported_json(page)
            if [m["role"] for m in chat["messages"]] == ["user", "assistant"]:
                break
            time.sleep(0.5)
        assert chat["messages"][0]["content"] == texts[name]
    page.locator("#chat-list").get_by_text(texts["Alpha"][:12]).first.click()  # back to the first chat
    wait_for_js(page, "() => document.querySelector('#chatbot').innerText.includes('Alpha question')", timeout=20000)
    chat = exported_json(page)  # the first click after the switch
    assert [m["content"] for m in chat["messages"] if m["role"] == "user"] == [texts["Alpha"]]
    page.close()


def test_the_chatbots_own_clear_icon_is_not_offered(session, open_page):
    """Gradio's trash icon cleared only the view: the history was still sent and came back on reload."""
    page = open_page()
    start_new_chat(page, "Say hi.")
    page.keyboard.press("Escape")
    assert page.locator('#chatbot button[aria-label="Copy conversation"]').is_visible()  # its toolbar is there
    assert page.locator('#chatbot button[aria-label="Clear"]').count() >= 1  # Gradio still renders it...
    assert not page.locator('#chatbot button[aria-label="Clear"]').first.is_visible()  # ...but nobody sees it
    page.close()


def test_delete_asks_first_and_a_no_keeps_the_chat(session, open_page):
    page = open_page()
    page.get_by_role("button", name="New chat").click()
    wait_for_js(page, "() => document.querySelectorAll('#chatbot [data-testid=\"user\"]').length === 0", timeout=20000)
    send(page, "Delta question: name a tree.")
    wait_for_js(page, "() => document.querySelector('#chat-list').innerText.includes('Delta question')", timeout=20000)
    page.keyboard.press("Escape")
    page.get_by_text("Rename, pin, folder or delete").click()
    asked = []

    def answer(dialog, accept: bool) -> None:
        asked.append(dialog.message)
        dialog.accept() if accept else dialog.dismiss()

    page.once("dialog", lambda d: answer(d, False))
    page.get_by_role("button", name="Delete", exact=True).click()
    time.sleep(2)  # a refused delete changes nothing, so there is nothing to wait for
    assert asked and "cannot be undone" in asked[0]
    assert "Delta question" in page.locator("#chat-list").inner_text()
    page.once("dialog", lambda d: answer(d, True))
    page.get_by_role("button", name="Delete", exact=True).click()
    wait_for_js(page, "() => !document.querySelector('#chat-list').innerText.includes('Delta question')", timeout=20000)
    assert len(asked) == 2
    page.close()


def test_enter_while_the_chat_answers_says_why_and_keeps_the_message(session, open_page):
    _, client, _ = session
    running = lambda: client.predict(api_name="/engine_stats")["num_running"]
    page = open_page()
    start_new_chat(page, "Write a very long story about a sailor, with many chapters.")
    box = page.locator("#message textarea")
    box.click()
    box.press_sequentially("And then?", delay=5)
    box.press("Enter")  # while it still answers
    wait_for_js(page, "() => document.body.innerText.includes('still answering')", timeout=20000)
    assert box.input_value() == "And then?"  # nothing typed is lost
    assert page.locator('#chatbot [data-testid="user"]').count() == 1
    page.keyboard.press("Escape")
    deadline = time.time() + 20
    while running() and time.time() < deadline:
        time.sleep(0.2)
    page.close()


def test_stop_marks_the_reply_stopped_in_a_chat_that_already_has_replies(session, open_page):
    """Stop ends the page's drawing of the stream: the last frame stayed on screen without its "stopped" line
    (a new chat's first reply was redrawn when its title came; a later reply never was)."""
    _, client, _ = session
    page = open_page()
    # A reply long enough that Escape lands before its end ("Name a fruit." once ended first).
    start_new_chat(page, "Write a very long story about a fruit, with many chapters.")
    page.keyboard.press("Escape")
    wait_for_js(page, "() => document.querySelector('#chatbot').innerText.includes('stopped')", timeout=20000)
    wait_idle(client)
    send(page, "Now write a very long story about it, with many chapters.")
    wait_for_js(
        page,
        "() => { const bots = document.querySelectorAll('#chatbot [data-testid=\"bot\"]'); "
        "return bots.length > 1 && bots[bots.length - 1].innerText.trim().length > 0; }",
        timeout=60000,
    )
    page.keyboard.press("Escape")
    wait_for_js(
        page,
        "() => { const bots = document.querySelectorAll('#chatbot [data-testid=\"bot\"]'); "
        "return bots[bots.length - 1].innerText.includes('stopped'); }",
        timeout=20000,
    )
    assert bot_text(page).split("\n")[0]  # what was written so far stays above the line
    page.close()


def test_a_phone_screen_shows_the_chat_first_and_the_chat_list_in_a_drawer(session, open_page):
    """At 390 px the whole chat list came first and pushed the chat a screen down."""
    _, client, browser = session
    page = browser.new_page(viewport={"width": 390, "height": 844})
    try:
        page.goto(session[0].url)
        page.locator("#context-meter").get_by_text("Context:").wait_for()
        drawer_open = "() => document.querySelector('#sidebar').classList.contains('open')"
        wait_for_js(page, f"() => !({drawer_open})()", timeout=10000)  # closed as the page opens
        box = page.locator("#message textarea").bounding_box()
        assert box is not None and box["y"] + box["height"] <= 844  # the message box is on the first screen
        assert page.locator("#chatbot").bounding_box()["y"] < 400
        page.get_by_label("Toggle Sidebar").click()
        wait_for_js(page, drawer_open, timeout=10000)
        page.locator("#new-chat").click()  # a new chat: the drawer gives the screen back to it
        wait_for_js(page, f"() => !({drawer_open})()", timeout=10000)
        wait_for_js(
            page, "() => document.querySelectorAll('#chatbot [data-testid=\"user\"]').length === 0", timeout=20000
        )
        shot(page, "phone.png")
    finally:
        page.close()


def test_light_or_dark_is_remembered_across_reloads(session, open_page):
    page = open_page()
    dark = "() => document.body.classList.contains('dark')"
    was_dark = page.evaluate(dark)
    page.get_by_role("button", name="Light / dark").click()
    assert page.evaluate(dark) is not was_dark
    page.reload()
    page.locator("#context-meter").get_by_text("Context:").wait_for()
    wait_for_js(page, dark if not was_dark else f"() => !({dark})()", timeout=10000)
    time.sleep(1)
    assert page.evaluate(dark) is not was_dark  # and it stays so once the page has settled
    page.close()


def test_a_reply_cut_by_a_crash_reads_interrupted_after_the_restart(bundled_model, tmp_path, session):
    """kill -9 mid-reply: the reply stored so far came back looking finished."""
    from tests.processes import wait_until

    (tmp_path / "crash_home").mkdir()
    app = AppProcess(bundled_model, tmp_path / "crash_home")
    client = app.start()
    try:
        conv = client.predict("", "", api_name="/new_chat")["value"]
        client.submit(
            conv, "Write a very long poem about the sea.", "", 0.0, 1.0, -1, 0.0, 1.0, 2000, api_name="/respond"
        )
        saved = lambda: [m["content"] for m in client.predict(conv, api_name="/messages")][1:2] not in ([], [""])
        assert wait_until(saved, timeout=120)
        app.kill()  # kill -9 while the reply streams
        app.start()
        page = session[2].new_page(viewport={"width": 1280, "height": 900})
        try:
            page.goto(app.url)
            page.locator("#context-meter").get_by_text("Context:").wait_for()
            wait_for_js(
                page,
                "() => document.querySelector('#chatbot').innerText.includes("
                "'interrupted: Pagoda stopped before this reply finished')",
                timeout=30000,
            )
        finally:
            page.close()
    finally:
        app.kill()
