"""In a real browser (tests/app/browser_session.py): tools from MCP servers in a chat. The Tools panel lists the
servers of mcp.json (the tests' own, tests/app/mcp_test_server.py, over stdio); a chat has none on until the user
ticks them; the bundled model, held to the call's schema, calls the tool, and the call waits for Allow once (then
its result shows and the model answers) or Deny. A server that crashes mid-call, a tool that runs past its time limit
and Stop during a call each end the call with the chat saying so."""

import json
import re
import sys
from pathlib import Path

import pytest

from tests.app import browser_session
from tests.app.app_process import AppProcess
from tests.app.browser_session import open_new_chat, send, shot, started_with_a_browser, wait_for_js
from tests.processes import wait_until

open_page, app_log_on_failure = browser_session.open_page, browser_session.app_log_on_failure
SERVER = str(Path(__file__).with_name("mcp_test_server.py"))
BOTS = '#chatbot [data-testid="bot"]'

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def session(bundled_model, tmp_path_factory):
    """The app process with an mcp.json of two servers (one program; "slow" lets a call run for minutes), a client
    for its API, and a browser."""
    home = tmp_path_factory.mktemp("tools_home")
    (home / "files").mkdir()
    (home / "files" / "notes.txt").write_text("The lighthouse keeper is called Ada.")
    run = {"command": sys.executable, "args": [SERVER, str(home / "files")]}
    servers = {"test": {**run, "timeout": 3}, "slow": {**run, "timeout": 300}}
    (home / "mcp.json").write_text(json.dumps({"mcpServers": servers}))
    yield from started_with_a_browser(AppProcess(bundled_model, home))


def open_chat_with(page, client, tool: str) -> None:
    """A new chat whose one tool is `tool` ("server › name"), called before each answer."""
    open_new_chat(page)
    panel = page.locator("#tools-panel")
    if not page.locator("#chat-tools").is_visible():
        panel.get_by_text("Tools (MCP servers)").click()
    page.locator("#chat-tools").get_by_text("test › add").wait_for(timeout=60000)  # the servers have started
    # a new chat has no tools on (its values come as it opens)
    wait_for_js(page, "() => document.querySelectorAll('#chat-tools input:checked').length === 0", 20000)
    key = tool.replace(" › ", "/")

    def saved() -> bool:  # with the chat just made, the newest
        newest = max(client.predict(api_name="/conversations"), key=lambda c: c["id"])["settings"]
        return newest.get("tools") == [key] and newest.get("tool_choice") == "first"

    # The chat's values can land just after the wait above and untick a box ticked that instant (a user sees it
    # unticked and ticks it again): tick it until the chat keeps it, as a user would.
    box = page.locator("#chat-tools label", has_text=re.compile(f"^\\s*{re.escape(tool)}\\s*$")).locator("input")
    for _ in range(3):
        if not box.is_checked():
            page.locator("#chat-tools").get_by_text(tool, exact=True).click()
        page.locator("#tool-choice").get_by_text("Before each answer").click()
        if wait_until(saved, 10):
            return
    raise AssertionError("the chat's tools were not kept")


def answer_call(page, answer: str) -> None:
    page.locator(BOTS).last.get_by_text(answer, exact=True).click(timeout=120000)


def wait_title(page, text: str, timeout: float = 120000) -> None:
    page.locator("#chatbot").get_by_text(text).first.wait_for(timeout=timeout)


def wait_answer(page) -> None:
    """The reply after the call has ended: its line of stats shows."""
    wait_for_js(
        page,
        f"() => {{ const b = [...document.querySelectorAll('{BOTS}')].at(-1); "
        "return b && /first token|stopped/.test(b.querySelector('sub')?.innerText || ''); }",
        timeout=120000,
    )


def test_a_call_runs_once_allowed_and_the_model_answers_with_its_result(open_page, session):
    page = open_page()
    open_chat_with(page, session[1], "test › add")
    send(page, "What is 21 plus 21?")
    page.locator(BOTS).last.get_by_text("wants to run with").wait_for(timeout=120000)
    shot(page, "tool-call-asks.png")
    answer_call(page, "Allow once")
    wait_title(page, "test › add · done")
    wait_answer(page)
    assert "Allow once" not in page.locator("#chatbot").inner_text()
    shot(page, "tool-call-done.png")


def test_always_lets_the_tools_next_calls_in_the_chat_run_without_asking(open_page, session):
    page = open_page()
    open_chat_with(page, session[1], "test › add")
    send(page, "What is 3 plus 4?")
    answer_call(page, "Always for this tool")
    wait_title(page, "test › add · done")
    wait_answer(page)
    page.locator("#tools-panel").get_by_text("Run without asking").wait_for(timeout=20000)
    assert "test › add" in page.locator("#tools-panel").inner_text()
    send(page, "What is 5 plus 6?")
    wait_for_js(
        page, "() => document.querySelector('#chatbot').innerText.split('test › add · done').length === 3", 120000
    )
    assert "Allow once" not in page.locator("#chatbot").inner_text()


def test_deny_runs_nothing_and_the_model_answers(open_page, session):
    page = open_page()
    open_chat_with(page, session[1], "test › add")
    send(page, "What is 2 plus 2?")
    answer_call(page, "Deny")
    wait_title(page, "test › add · denied")
    wait_answer(page)


@pytest.mark.parametrize(
    "tool, why",
    [("test › crash", "starts again at the next call"), ("test › wait_for_ever", "did not finish within 3 s")],
    ids=["a server that crashes mid-call", "a tool past its time limit"],
)
def test_a_call_that_fails_says_why_and_the_model_answers(open_page, session, tool, why):
    page = open_page()
    open_chat_with(page, session[1], tool)
    send(page, "Go.")
    answer_call(page, "Allow once")
    wait_title(page, f"{tool} · failed")
    page.locator("#chatbot").get_by_text(f"{tool} · failed").first.click()  # the block opens
    page.locator("#chatbot").get_by_text(why, exact=False).wait_for(timeout=20000)
    wait_answer(page)


def test_stop_during_a_call_ends_it(open_page, session):
    page = open_page()
    open_chat_with(page, session[1], "slow › wait_for_ever")
    send(page, "Wait.")
    answer_call(page, "Allow once")
    wait_title(page, "slow › wait_for_ever · running")
    page.locator("#stop-btn").click()
    wait_title(page, "slow › wait_for_ever · stopped", timeout=30000)
