"""In a real browser (tests/app/browser_session.py): a chat's branches. Regenerate keeps the old replies behind
‹ 2/3 ›, ✎ edit on any message of the user's starts a new branch and the old one comes back, "new chat from here"
copies a chat down to a message into a new chat, and editing a message whose reply still streams stops it."""

import time

import pytest

from tests.app import browser_session
from tests.app.browser_session import shot, wait_for_js, wait_idle

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
