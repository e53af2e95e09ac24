"""In a real browser: Debian's Chromium driven by Playwright (no browser download).

Types a message, watches the reply stream in, starts a second chat on the same system prompt and
watches the KV-cache grid show their shared blocks. Screenshots go to test-artifacts/; with
PAGODA_UPDATE_DOCS=1 they also replace the README's pictures in docs/.
"""

import os
import re
import shutil
import time
from pathlib import Path

import pytest

from tests.app.app_process import AppProcess

# Starting the app and a browser on the bundled model takes minutes on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(900)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
if CHROMIUM is None or not shutil.which("chromium"):
    # CI installs Chromium and sets PAGODA_REQUIRE_BROWSER, so there a missing browser fails loudly.
    if os.environ.get("PAGODA_REQUIRE_BROWSER"):
        raise RuntimeError("PAGODA_REQUIRE_BROWSER is set but no chromium is installed (apt-get install chromium)")
    pytest.skip("needs Debian's chromium (apt-get install chromium)", allow_module_level=True)
if os.environ.get("PAGODA_REQUIRE_BROWSER"):
    from playwright import sync_api  # CI: a missing Playwright is an error, not a skip
else:
    sync_api = pytest.importorskip("playwright.sync_api")

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def session(bundled_model, tmp_path_factory):
    """The app process, a client for its API, and a browser."""
    app = AppProcess(bundled_model, tmp_path_factory.mktemp("browser_home"))
    client = app.start()
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield app, client, browser
        browser.close()
    app.kill()


@pytest.fixture
def open_page(session):
    """Opens a tab on the app. Tabs still open when the test ends, passed or failed, are closed,
    so that a failed test leaves no replies streaming into the next one."""
    app, _, browser = session
    opened = []

    def open_tab(host: str = "127.0.0.1"):
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        opened.append(page)
        page.goto(app.url.replace("127.0.0.1", host))
        page.locator("#context-meter").get_by_text("Context:").wait_for()  # the first chat is open
        return page

    yield open_tab
    for page in opened:
        if not page.is_closed():
            page.close()


@pytest.fixture(autouse=True)
def app_log_on_failure(session, request):
    """When a test fails, its log lines from the app follow the failure (the server's side of it)."""
    app = session[0]
    start = app.log.stat().st_size
    yield
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        with open(app.log, errors="replace") as log:
            log.seek(start)
            print("---- the app's log during this test ----\n" + log.read()[-6000:])


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name))
    if os.environ.get("PAGODA_UPDATE_DOCS"):
        (REPO / "docs").mkdir(exist_ok=True)
        shutil.copy(ARTIFACTS / name, REPO / "docs" / name)


def wait_for_js(page, expression: str, timeout: float) -> None:
    """page.wait_for_function, with a screenshot in test-artifacts/ when it times out."""
    try:
        page.wait_for_function(expression, timeout=timeout)
    except sync_api.TimeoutError:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "failure.png"), full_page=True)
        raise


def bot_text(page) -> str:
    bots = page.locator('#chatbot [data-testid="bot"]')
    return bots.last.inner_text() if bots.count() else ""


def send(page, text: str) -> None:
    """Type like a person (key by key), then Enter; the user's message must show at once."""
    box = page.locator("#message textarea")
    users = page.locator('#chatbot [data-testid="user"]').count()
    box.click()
    box.press_sequentially(text, delay=5)
    box.press("Enter")
    wait_for_js(
        page, f"() => document.querySelectorAll('#chatbot [data-testid=\"user\"]').length > {users}", timeout=20000
    )


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


def open_new_chat(page) -> None:
    """New chat, until the page shows it: the chat chosen in the list is an empty "New chat" (the empty one
    already there, or a new one), and the chat on screen is empty (an Enter before that sends into the chat open
    before)."""
    page.get_by_role("button", name="New chat").click()
    wait_for_js(
        page,
        "() => { const on = document.querySelector('#chat-list input:checked'); "
        "return on !== null && on.closest('label').innerText.trim() === 'New chat' && "
        "document.querySelectorAll('#chatbot [data-testid=\"user\"]').length === 0; }",
        timeout=20000,
    )


def start_new_chat(page, text: str) -> None:
    """New chat, then `text` sent, until the reply's first words show."""
    open_new_chat(page)
    send(page, text)
    wait_for_js(
        page,
        "() => { const bots = document.querySelectorAll('#chatbot [data-testid=\"bot\"]'); "
        "return bots.length > 0 && bots[bots.length - 1].innerText.trim().length > 0; }",
        timeout=60000,
    )


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
    page.get_by_text("Rename or delete").click()
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


def wait_idle(client, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while client.predict(api_name="/engine_stats")["num_running"] and time.time() < deadline:
        time.sleep(0.2)


def test_stop_marks_the_reply_stopped_in_a_chat_that_already_has_replies(session, open_page):
    """Stop ends the page's drawing of the stream: the last frame stayed on screen without its "stopped" line
    (a new chat's first reply was redrawn when its title came; a later reply never was)."""
    _, client, _ = session
    page = open_page()
    start_new_chat(page, "Name a fruit.")
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


PROGRESS = r"/Reading the prompt: ([\d,]+) \/ ([\d,]+) tokens/"


def test_a_long_paste_shows_how_much_is_read_and_the_meter_counts_the_reply(session, open_page):
    """A 4,400-token paste was seconds of an empty bubble, and the meter kept the count from before the message
    until the reply ended."""
    _, client, _ = session
    page = open_page()
    open_new_chat(page)
    meter = lambda: int(
        re.search(r"Context: ([\d,]+)", page.locator("#context-meter").inner_text())[1].replace(",", "")
    )
    before = meter()
    paste = "Summarize this. " + "The keeper climbed the stairs of the lighthouse every evening at dusk. " * 330
    page.locator("#message textarea").fill(paste)
    page.locator("#message textarea").press("Enter")
    # Partway through: tokens read so far, out of the whole prompt (chunks of 2,048 on a CPU).
    wait_for_js(
        page,
        "() => { const bots = document.querySelectorAll('#chatbot [data-testid=\"bot\"]'); "
        f"const m = bots.length && bots[bots.length - 1].innerText.match({PROGRESS}); "
        "return m && +m[1].replace(/,/g, '') > 0 && +m[1].replace(/,/g, '') < +m[2].replace(/,/g, ''); }",
        timeout=60000,
    )
    # The reply begins: the progress line gives way to its words, and the meter counts the prompt and the reply.
    wait_for_js(
        page,
        "() => { const bots = document.querySelectorAll('#chatbot [data-testid=\"bot\"]'); "
        "const t = bots[bots.length - 1].innerText; return t.trim() && !t.includes('Reading the'); }",
        timeout=60000,
    )
    wait_for_js(
        page,
        "() => +document.querySelector('#context-meter').innerText.match(/Context: ([\\d,]+)/)[1]"
        f".replace(/,/g, '') > {before + 4000}",
        timeout=20000,
    )
    first = meter()
    deadline = time.time() + 20
    while meter() == first and time.time() < deadline:
        time.sleep(0.2)
    assert meter() > first  # it moves while the reply streams
    assert client.predict(api_name="/engine_stats")["num_running"] == 1  # the reply still streams
    page.keyboard.press("Escape")
    wait_idle(client)
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


@pytest.fixture(scope="module")
def hub_app(bundled_model, tmp_path_factory):
    """An app whose downloads come from a local fake hub: a small repo, and a big one served slowly enough to
    cancel."""
    import json

    from tests.app.fake_hub import FakeHub
    from tests.app.hub_fixtures import CONFIG

    home = tmp_path_factory.mktemp("hub_app")
    weights = {"config.json": json.dumps(CONFIG).encode(), "tokenizer.json": b'{"model": {"type": "BPE"}}'}
    hub = FakeHub(chunk_size=32 * 1024, throttle=0.1)
    hub.add_repo("pagoda-test/small-chat", {**weights, "model.safetensors": os.urandom(64 * 1024)})
    hub.add_repo("pagoda-test/big-chat", {**weights, "model.safetensors": os.urandom(8 * 1024 * 1024)})
    hub.start()
    app = AppProcess(
        bundled_model,
        home,
        env={
            "HF_HUB_OFFLINE": "0",
            "HF_ENDPOINT": hub.url,
            "HF_HUB_CACHE": str(home / "hub"),
            "HF_HUB_DISABLE_XET": "1",
        },
    )
    client = app.start()
    yield app, home / "hub", client
    app.kill()
    hub.stop()


def test_models_tab_cancel_and_delete_are_buttons_on_each_row(session, hub_app):
    """Cancel and delete wanted a typed repo id; each download and each downloaded model now has its button."""
    app, cache, client = hub_app
    page = session[2].new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(app.url)
        page.locator("#context-meter").get_by_text("Context:").wait_for()
        page.get_by_role("tab", name="Models").click()

        def download(repo_id: str) -> None:
            field = page.locator("#model-choice input")
            field.fill(repo_id)
            field.press("Enter")
            page.get_by_role("button", name="Download", exact=True).click()

        download("pagoda-test/small-chat")
        small = page.locator(".model-row").filter(has_text="pagoda-test/small-chat")
        small.wait_for(timeout=60000)
        download("pagoda-test/big-chat")
        big = page.locator(".download-row").filter(has_text="pagoda-test/big-chat")
        big.get_by_role("button", name="Cancel").click(timeout=30000)
        wait_for_js(
            page,
            "() => [...document.querySelectorAll('.download-row')].some(r => "
            "r.innerText.includes('big-chat') && r.innerText.includes('cancelled'))",
            timeout=30000,
        )
        assert big.get_by_role("button", name="Cancel").count() == 0  # nothing left to cancel
        assert page.locator(".model-row").filter(has_text="pagoda-test/big-chat").count() == 0

        asked = []
        page.once("dialog", lambda d: (asked.append(d.message), d.dismiss()))
        small.get_by_role("button", name="Delete").click()
        time.sleep(2)  # a refused delete changes nothing, so there is nothing to wait for
        assert asked and "pagoda-test/small-chat" in asked[0]
        assert (cache / "models--pagoda-test--small-chat").exists() and small.count() == 1
        page.once("dialog", lambda d: d.accept())
        small.get_by_role("button", name="Delete").click()
        wait_for_js(
            page,
            "() => ![...document.querySelectorAll('.model-row')].some(r => r.innerText.includes('small-chat'))",
            timeout=20000,
        )
        assert not (cache / "models--pagoda-test--small-chat").exists()
        shot(page, "models-rows.png")

        # Scripts do the same by repo id.
        download("pagoda-test/big-chat")
        big.get_by_role("button", name="Cancel").wait_for(timeout=30000)
        assert client.predict("pagoda-test/big-chat", api_name="/cancel_download").startswith("Cancelling 1 ")
        wait_for_js(
            page,
            "() => ![...document.querySelectorAll('.download-row')].some(r => "
            "r.innerText.includes('big-chat') && r.innerText.includes('running'))",
            timeout=30000,
        )
        download("pagoda-test/small-chat")
        small.wait_for(timeout=60000)
        assert "Free disk" in client.predict("pagoda-test/small-chat", api_name="/delete_model")
        assert not (cache / "models--pagoda-test--small-chat").exists()
    finally:
        page.close()


def test_a_message_that_overflows_stays_in_the_box_and_drop_the_oldest_turn_answers_it(session, open_page):
    """The overflowing message was saved into the chat, Drop did not answer afterwards and the meter stayed past
    the limit; now the message waits in the box and Drop the oldest turn sends it."""
    _, client, _ = session
    page = open_page()
    open_new_chat(page)
    box = page.locator("#message textarea")
    first = "Remember this. " + "The keeper lit the lamp at dusk and watched the ships pass by. " * 300  # ~4,200
    box.fill(first)
    box.press("Enter")
    wait_for_js(
        page,
        "() => { const bots = document.querySelectorAll('#chatbot [data-testid=\"bot\"]'); "
        "const t = bots.length ? bots[bots.length - 1].innerText : ''; "
        "return t.trim() && !t.includes('Reading the'); }",
        timeout=120000,
    )
    page.keyboard.press("Escape")
    wait_idle(client)
    second = "Now this. " + "The storm came in from the west and the keeper climbed the stairs. " * 300  # ~4,200
    box.fill(second)
    box.press("Enter")
    wait_for_js(page, "() => document.body.innerText.includes('Drop the oldest messages')", timeout=30000)
    assert box.input_value() == second  # kept for Drop, or for an edit
    assert page.locator('#chatbot [data-testid="user"]').count() == 1  # not saved into the chat
    page.get_by_role("button", name="Drop the oldest turn").click()
    # The first turn goes and the second message is sent and answered.
    wait_for_js(
        page,
        "() => { const users = document.querySelectorAll('#chatbot [data-testid=\"user\"]'); "
        "const bots = document.querySelectorAll('#chatbot [data-testid=\"bot\"]'); "
        "return users.length === 1 && users[0].innerText.startsWith('Now this.') && bots.length === 1 "
        "&& bots[0].innerText.trim() && !bots[0].innerText.includes('Reading the'); }",
        timeout=120000,
    )
    assert box.input_value() == ""
    page.keyboard.press("Escape")
    wait_idle(client)
    used, limit = re.search(r"Context: ([\d,]+) / ([\d,]+)", page.locator("#context-meter").inner_text()).groups()
    assert int(used.replace(",", "")) <= int(limit.replace(",", ""))
    page.close()


def test_edit_last_message_while_the_reply_streams_stops_it_and_puts_the_message_back(session, open_page):
    """It deleted the rows under a streaming reply: the page kept showing the message and "No message with id"."""
    _, client, _ = session
    page = open_page()
    start_new_chat(page, "Write a very long story about a miller, with many chapters.")
    page.get_by_role("button", name="Edit last message").click()
    box = page.locator("#message textarea")
    wait_for_js(
        page, "() => document.querySelector('#message textarea').value.startsWith('Write a very long')", timeout=20000
    )
    wait_for_js(
        page,
        "() => document.querySelectorAll('#chatbot [data-testid=\"user\"]').length === 0 && "
        "document.querySelectorAll('#chatbot [data-testid=\"bot\"]').length === 0",
        timeout=20000,
    )
    wait_idle(client)
    time.sleep(1)  # a late frame of the stopped reply would land now
    assert page.locator('#chatbot [data-testid="bot"]').count() == 0
    assert "No message with id" not in page.locator("body").inner_text()
    assert box.input_value() == "Write a very long story about a miller, with many chapters."
    page.close()


def test_the_models_form_names_the_dtype_it_loads_and_says_when_a_path_does_not_exist(session, open_page):
    """The estimate said float32 while loads used bfloat16, the context started at 4,096 where the model serves
    8,192, the KV field showed 0, and a missing path said "press Download first"."""
    import torch

    from engine.loader import pick_dtype

    page = open_page()
    page.get_by_role("tab", name="Models").click()
    context = page.get_by_label("Context length (tokens)")
    context.wait_for()
    assert context.input_value() == "8192"  # the bundled model's own length, which fits here
    assert page.get_by_label("KV cache memory on a CPU, GiB").input_value() == "1"
    model = page.locator("#model-choice input")
    model.fill("SmolLM2 360M Instruct")
    page.get_by_role("option", name="SmolLM2 360M Instruct").first.click()
    quant = page.locator("#quantization input")
    quant.click()
    page.get_by_role("option", name="none", exact=True).click()
    expected = str(pick_dtype("auto", torch.device("cpu"), False)).removeprefix("torch.")
    wait_for_js(
        page,
        "() => document.querySelector('#fit-estimate').innerText.includes('"
        f"{expected}') && document.querySelector('#fit-estimate').innerText.includes('360M')",
        timeout=20000,
    )
    model.fill("/no/such/model/folder")
    model.press("Enter")
    page.get_by_role("button", name="Load", exact=True).click()
    wait_for_js(
        page, "() => document.body.innerText.includes('There is no model folder or .gguf file at')", timeout=20000
    )
    assert "press Download first" not in page.locator("body").inner_text()
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
