"""The browser tests' shared part (test_browser*.py): Debian's Chromium driven by Playwright (no browser download),
an app process on the bundled model with a browser for each test module, and the page helpers they use.

A test module binds the fixtures (`session`, `open_page` and the autouse `app_log_on_failure`) to names of its own,
so each module has its own app and browser. Importing this module skips the test module when Chromium or
Playwright is missing, except where CI sets PAGODA_REQUIRE_BROWSER. Screenshots go to test-artifacts/; with
PAGODA_UPDATE_DOCS=1 they also replace the README's pictures in docs/.
"""

import os
import shutil
import time
from pathlib import Path

import pytest

from tests.app.app_process import AppProcess

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


def started_with_a_browser(app: AppProcess):
    """Start `app`, and yield it with a client for its API and a browser; both end after."""
    client = app.start()
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield app, client, browser
        browser.close()
    app.kill()


@pytest.fixture(scope="module")
def session(bundled_model, tmp_path_factory):
    """The app process, a client for its API, and a browser."""
    yield from started_with_a_browser(AppProcess(bundled_model, tmp_path_factory.mktemp("browser_home")))


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


def wait_idle(client, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while client.predict(api_name="/engine_stats")["num_running"] and time.time() < deadline:
        time.sleep(0.2)
