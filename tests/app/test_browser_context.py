"""In a real browser (tests/app/browser_session.py): long prompts and a full context. A long paste shows how
much of it is read and the meter counts the reply; a message that overflows stays in the box, and Drop the oldest
turn answers it."""

import re
import time

import pytest

from tests.app import browser_session
from tests.app.browser_session import open_new_chat, wait_for_js, wait_idle

# browser_session's fixtures: an app process and a browser, a tab on the app, the app's log after a failed test
session, open_page, app_log_on_failure = (
    browser_session.session,
    browser_session.open_page,
    browser_session.app_log_on_failure,
)

# Starting the app and a browser on the bundled model takes minutes on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(900)


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
