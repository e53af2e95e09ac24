"""In a real browser, as test_browser.py (whose app process, browser and helpers these share): what a new user
reported in issue 28, item 5."""
import pytest

from tests.app import test_browser
from tests.app.test_browser import start_new_chat, wait_for_js, wait_idle

# test_browser's fixtures: its app process and browser, a tab on the app, the app's log after a failed test
session, open_page, app_log_on_failure = test_browser.session, test_browser.open_page, test_browser.app_log_on_failure

pytestmark = pytest.mark.timeout(900)

LAST_BOT = "[...document.querySelectorAll('#chatbot [data-testid=\"bot\"]')].pop()"


def test_stop_inside_a_code_block_puts_the_stats_line_under_the_block(session, open_page):
    """The stats line (first token … · stopped) showed as code, inside the block the reply had open."""
    _, client, _ = session
    page = open_page()
    start_new_chat(page, "Write a long Python program with many functions, in one code block.")
    wait_for_js(page, f"() => {{ const code = {LAST_BOT}.querySelector('pre'); "
                      "return code && code.innerText.trim().split('\\n').length >= 2; }", timeout=120000)
    page.keyboard.press("Escape")  # Stop while the block is still open
    wait_for_js(page, f"() => {LAST_BOT}.innerText.includes('stopped')", timeout=30000)
    wait_idle(client)
    conversation = [c for c in client.predict(api_name="/conversations") if c["title"].startswith("Write a long")][0]
    reply = client.predict(conversation["id"], api_name="/messages")[-1]["content"]
    fences = [line for line in reply.split("\n") if line.lstrip().startswith("```")]
    assert len(fences) % 2 == 1, reply  # it was stopped inside the block, as the user did
    stats = page.evaluate(f"() => {{ const sub = {LAST_BOT}.querySelector('sub'); "
                          "return sub && {text: sub.innerText, inCode: sub.closest('pre, code') !== null}; }")
    assert stats is not None, "no <sub> element under the reply: its stats line was shown as code"
    assert "stopped" in stats["text"] and not stats["inCode"]
    assert "stopped" not in page.locator("#chatbot [data-testid=\"bot\"] pre").last.inner_text()
    page.close()
