"""What a chat shows under and around its replies: the stats line, the switches, the meter and the chat's title
(issue 28, item 5)."""

import threading
from types import SimpleNamespace

import gradio as gr
from markdown_it import MarkdownIt

from app.backend import ReplyDelta, meter_text
from app.chat import ReplyTask, stream_reply
from app.model_host import ModelHost
from app.reply_events import UNCHANGED
from app.store import ConversationStore
from app.ui import PagodaUI
from tests.app.chat_text import without_links
from tests.processes import wait_until

STOPPED_META = {
    "finish_reason": "abort",
    "ttft_s": 0.2,
    "tokens_per_s": 30.0,
    "output_tokens": 12,
    "prompt_tokens": 20,
    "cached_tokens": 0,
    "finished": True,
}


def make_ui(tmp_path) -> PagodaUI:
    return PagodaUI(ConversationStore(tmp_path / "chats.db"), ModelHost())


def code_and_text(markdown: str) -> tuple[str, str]:
    """What a Markdown renderer puts in code blocks, and what it puts anywhere else."""
    code, text = [], []
    for token in MarkdownIt("commonmark").parse(markdown):
        (code if token.type in ("fence", "code_block") else text).append(token.content)
    return "\n".join(code), "\n".join(text)


def test_a_reply_stopped_inside_a_code_block_has_its_stats_line_under_the_block(tmp_path):
    ui = make_ui(tmp_path)
    chat = ui.store.create().id
    ui.store.add_message(chat, "user", "Write a long Python program.")
    ui.store.add_message(chat, "assistant", "Here it is:\n\n```python\ndef main():\n    print(1)", STOPPED_META)
    shown = without_links(ui.history(chat)[-1]["content"])
    code, text = code_and_text(shown)
    assert "def main():\n    print(1)" in code  # the code stays a code block
    assert "<sub>" not in code and "stopped</sub>" in text  # and the stats line is not part of it
    # Cut by a crash instead: the "interrupted" line, likewise
    ui.store.add_message(chat, "assistant", "```\nx = 1", {**STOPPED_META, "finish_reason": None, "finished": False})
    code, text = code_and_text(without_links(ui.history(chat)[-1]["content"]))
    assert "<sub>" not in code and "interrupted: Pagoda stopped" in text


def test_the_stats_line_leaves_closed_blocks_tildes_and_inline_backticks_alone(tmp_path):
    ui = make_ui(tmp_path)
    chat = ui.store.create().id
    replies = [
        "```\nx = 1\n```\nDone.",
        "~~~~\ncode\n~~~\nstill code",
        "Use ``` to open a block: ```js``` and `x`.",
        "  ```sh\n  ls\n",
        "````\n```\ninner\n```\n",
    ]
    for reply in replies:
        ui.store.add_message(chat, "assistant", reply, STOPPED_META)
    shown = [without_links(row["content"]) for row in ui.history(chat)]
    for reply, content in zip(replies, shown, strict=True):
        assert content.startswith(reply)
        code, text = code_and_text(content)
        assert "<sub>" not in code and "stopped</sub>" in text, content
    assert [content.split("\n\n<sub>")[0] for content in shown[:3:2]] == replies[:3:2]  # nothing to close: as it was


class EndlessCode:
    """A reply that opens a code block and writes code until it is stopped."""

    request_id = "r"

    def __init__(self):
        self.cancelled = threading.Event()

    def __iter__(self):
        yield ReplyDelta("```python\n", 1)
        while not self.cancelled.wait(0.02):
            yield ReplyDelta("x = 1\n", 1)

    def cancel(self):
        self.cancelled.set()

    def prefill_progress(self):
        return None


def test_stop_inside_a_code_block_closes_the_block_before_the_stats_line(tmp_path):
    ui = make_ui(tmp_path)
    chat = ui.store.create().id
    reply = ui.store.add_message(chat, "assistant", "")
    task = ReplyTask(EndlessCode(), ui.store, reply.id, 12)
    ui.replies.start(chat, task, label="#1")
    frames = ui.follow(chat, None)
    next(frames)
    assert wait_until(lambda: task.turn.output_tokens >= 3, timeout=10)
    task.cancel()  # Stop, as the page's last frame sees it
    *_, (chatbot, *_rest) = frames
    for shown in map(without_links, (chatbot[-1]["content"], ui.stop_and_show(chat)[0][-1]["content"])):
        code, text = code_and_text(shown)
        assert "x = 1" in code and "<sub>" not in code and "· stopped</sub>" in text


def word_counting_backend() -> SimpleNamespace:
    """Stands in for a model: one token a word, the system prompt included."""

    def context_meter(system_prompt, stored):
        return meter_text(len(system_prompt.split()) + sum(len(m.content.split()) for m in stored), 8192)

    return SimpleNamespace(context_meter=context_meter, thinks=False, max_model_len=8192)


def test_a_system_prompt_typed_and_left_before_sending_is_kept_and_counted(tmp_path):
    """Saved only with the next message, an edited system prompt was lost on switching chats, and the meter
    did not count it until then."""
    ui = make_ui(tmp_path)
    ui.host.backend = word_counting_backend()
    first, other = ui.store.create().id, ui.store.create().id
    ui.store.add_message(first, "user", "Hello there")
    page = SimpleNamespace(session_hash="page-1")
    shown = ui.open(first, page)
    assert shown[1] == "" and shown[2] == first  # the box, and the chat it belongs to
    assert ui.save_system_prompt(first, "You are a pirate", page) == "Context: 6 / 8,192 tokens"  # as it is typed
    ui.open(other, page)  # switched away before sending
    assert ui.save_system_prompt(first, "You are a pirate", page) == gr.update()  # a late save: not this chat's meter
    box, owner, *_ = ui.open(first, page)[1:]
    assert (box, owner) == ("You are a pirate", first)
    assert ui.context_meter(first) == "Context: 6 / 8,192 tokens"
    ui.store.delete(other)
    assert ui.save_system_prompt(other, "typed into a chat deleted meanwhile", page) == gr.update()


class ShortReply:
    """A reply of a few words that ends by itself."""

    request_id = "r"

    def __iter__(self):
        for word in ("Hello ", "there."):
            yield ReplyDelta(word, 1)
        yield ReplyDelta("", 0, finished=True, finish_reason="stop")

    def cancel(self):
        pass

    def prefill_progress(self):
        return None


def test_deleting_a_chat_as_its_reply_ends_is_quiet(tmp_path):
    """The page's refresh after the reply read the deleted chat: "NotFound: No chat with id …" and a traceback."""
    ui = make_ui(tmp_path)
    ui.host.backend = word_counting_backend()
    kept, chat = ui.store.create().id, ui.store.create().id
    reply = ui.store.add_message(chat, "assistant", "")
    ui.replies.start(chat, ReplyTask(ShortReply(), ui.store, reply.id, 3), label="#2")
    *_, (chatbot, *_rest) = ui.follow(chat, None)  # the reply ends on screen
    assert chatbot[-1]["content"].startswith("Hello there.")
    listed = ui.delete_chat(chat)  # Delete, right then
    assert listed["value"] == kept and [cid for _, cid in listed["choices"]] == [kept]
    meter, chats = ui.after_reply(chat)  # the refresh that follows the reply, arriving after the delete
    assert meter == gr.update() and "value" not in chats and [cid for _, cid in chats["choices"]] == [kept]
    assert list(ui.follow(chat, None))[-1] == UNCHANGED  # a page still following it draws nothing
    assert ui.delete_chat(chat)["value"] == kept  # a second Delete (another tab's) changes nothing either


def test_the_title_field_takes_the_title_the_first_message_gives(tmp_path):
    """The list showed the new title, the Title field (under Rename or delete) still "New chat"."""
    ui = make_ui(tmp_path)
    chat = ui.store.create().id
    page = SimpleNamespace(session_hash="page-1")
    assert ui.open(chat, page)[-4] == "New chat"  # the Title field as the chat opens
    assert ui.panels("", page, chat)[3] == gr.update()  # the timer: nothing new
    ui._title_from_first_message(chat, "How far can a lighthouse beam be seen at sea?")
    assert ui.panels("", page, chat)[3] == "How far can a lighthouse beam be seen at…"
    assert ui.panels("", page, chat)[3] == gr.update()  # sent once: a title being typed there is left alone
    other = ui.store.create(title="Beta").id
    ui.open(other, page)
    ui.store.rename(chat, "Alpha")
    assert ui.panels("", page, chat)[3] == gr.update()  # a tick that read the chat open before the switch: nothing
    ui.store.delete(chat)
    assert ui.panels("", page, chat)[3] == gr.update()


def test_think_is_offered_only_once_a_model_that_reasons_serves(tmp_path):
    """During a load, Think showed (ticked) whatever the model being loaded."""
    ui = make_ui(tmp_path)
    chat = ui.store.create().id
    think = ui.open(chat)[-3]  # no model serves yet (the first one is loading)
    assert think["visible"] is False and think["value"] is True  # the chat's own setting, kept for when it shows
    assert ui.think_switch() == {"visible": False}
    ui.host.backend = word_counting_backend()  # a model that does not reason
    assert ui.open(chat)[-3]["visible"] is False
    ui.host.backend.thinks = True  # Qwen3, say: the header's change at the end of its load shows the switch
    assert ui.think_switch() == {"visible": True} and ui.open(chat)[-3]["visible"] is True


def test_the_stats_line_counts_in_words_people_write():
    """It read "1 tokens" and "0/6150 prompt tokens"."""
    from app.chat import summary

    meta = {"ttft_s": 0.25, "output_tokens": 1, "prompt_tokens": 6150, "cached_tokens": 0, "finish_reason": "stop"}
    assert summary(meta) == "first token 250 ms · 1 token · 0/6,150 prompt tokens from the prefix cache"
    meta.update(output_tokens=1200, reasoning_tokens=1100, cached_tokens=4096, tokens_per_s=31.24)
    assert summary(meta) == (
        "first token 250 ms · 31.2 tok/s · 1,200 tokens (1,100 reasoning) · 4,096/6,150 prompt "
        "tokens from the prefix cache"
    )


def test_the_stats_line_says_what_speculative_decoding_gave_the_reply(tmp_path):
    """Tokens a checking step gave (its accepted drafts and the one token every step gives) and the share of the
    drafts kept, from the engine's last increment to the stored reply's line."""
    from app.chat import summary

    class Speculated(CountedReply):
        def __iter__(self):
            yield ReplyDelta("word ", 1)
            yield ReplyDelta("word", 1, finished=True, finish_reason="stop", speculation=(10, 30, 16))

    store = ConversationStore(tmp_path / "chats.db")
    reply = store.add_message(store.create().id, "assistant", "")
    for _ in stream_reply(Speculated(2, "stop"), store, reply.id, 5):
        pass
    meta = store.messages(reply.conversation_id)[-1].meta
    assert meta["speculation"] == [10, 30, 16]
    assert " · spec 2.6 tok/step, 53% accepted · " in summary(meta)
    assert "spec" not in summary({**meta, "speculation": None})  # a reply that did not speculate says nothing


class CountedReply:
    """A reply of `n` one-token words that ends for `reason` ("length": the reply limit, or the context)."""

    request_id = "r"

    def __init__(self, n: int, reason: str):
        self.n, self.reason = n, reason

    def __iter__(self):
        for i in range(1, self.n + 1):
            last = i == self.n
            yield ReplyDelta("word ", 1, finished=last, finish_reason=self.reason if last else None)

    def cancel(self):
        pass

    def prefill_progress(self):
        return None


def test_a_reply_names_its_model_and_says_when_max_reply_tokens_cut_it(tmp_path):
    """Replies said neither which model wrote them nor that "Max reply tokens" had cut them; both are stored with
    the reply, so the chat says so still after another model loads."""
    ui = make_ui(tmp_path)
    backend = word_counting_backend()
    replies = [CountedReply(16, "length"), CountedReply(5, "length"), CountedReply(3, "stop")]
    backend.model = "Tiny Model 1B"
    backend.submit = lambda messages, settings: (replies.pop(0), 4)
    ui.host.backend = backend
    chat = ui.store.create().id
    sliders = (0.7, 0.9, -1, 0.0, 1.0, 16)  # Max reply tokens: 16
    for message in ("Tell me a long story.", "Again.", "Shorter."):
        list(ui.respond(chat, message, "", *sliders, None))  # follows the reply to its end
    ui.host.backend = None  # another model serves next, or none: the lines stay
    lines = [without_links(row["content"]).split("<sub>")[1] for row in ui.history(chat) if row["role"] == "assistant"]
    assert all(line.startswith("Tiny Model 1B · first token ") for line in lines)
    assert " · 16 tokens · " in lines[0]
    assert lines[0].endswith(" from the prefix cache · cut at Max reply tokens (16)</sub>")
    assert " · 5 tokens · " in lines[1] and lines[1].endswith(" · cut: the context is full</sub>")  # short of the limit
    assert " · 3 tokens · " in lines[2] and lines[2].endswith(" from the prefix cache</sub>")


def test_inline_dollar_math_is_marked_for_the_chatbot_and_prices_are_not(tmp_path):
    """`$x^2$` showed raw: the chatbot renders only its delimiters, and single $ cannot be one ("$5 and $10")."""
    from app.page.chat_tab import MATH_DELIMITERS

    ui = make_ui(tmp_path)
    chat = ui.store.create().id
    reply = (
        "The area is $\\pi r^2$ for $r = 2$. It costs $5 and $10, or $20,000.\n"
        "`$HOME` stays code, and so does\n```sh\necho $a$b$\n```"
    )
    ui.store.add_message(chat, "assistant", reply, STOPPED_META)
    shown = ui.history(chat)[-1]["content"]
    assert shown.startswith(
        "The area is \\(\\pi r^2\\) for \\(r = 2\\). It costs $5 and $10, or $20,000.\n"
        "`$HOME` stays code, and so does\n```sh\necho $a$b$\n```"
    )
    assert ui.store.messages(chat)[-1].content == reply  # stored as the model wrote it
    lefts = [d["left"] for d in MATH_DELIMITERS]
    assert "\\(" in lefts and "$" not in lefts


def test_a_title_typed_right_after_new_chat_is_not_overwritten(tmp_path):
    """Typed while the new chat opened, the title was replaced by "New chat" as it opened, and typed before the
    first message's reply, by the title that message gave."""
    ui = make_ui(tmp_path)
    page = SimpleNamespace(session_hash="page-1")
    other = ui.store.create(title="Other").id
    chat = ui.new_chat("", "", page)["value"]
    ui.title_typed(page)  # the user types in the Title field at once
    assert ui.open(chat, page)[-4] == gr.update()  # the chat opens: the field keeps what is typed
    ui._title_from_first_message(chat, "How far can a lighthouse beam be seen at sea?")
    assert ui.panels("", page, chat)[3] == gr.update()  # nor does the first message's title replace it
    ui.asked_for_chat(other, page)  # another chat picked in the list: the field follows the chats again
    assert ui.open(other, page)[-4] == "Other"
    ui.asked_for_chat(chat, page)
    assert ui.open(chat, page)[-4] == "How far can a lighthouse beam be seen at…"
    # New chat's click showed "New chat" in the field: its opening sends no title over what may be typed by then
    fresh = ui.new_chat("", "", page)["value"]
    assert ui.open(fresh, page)[-4] == gr.update()
    assert ui.open(fresh, page)[-4] == gr.update()  # opened twice (a page's first opening can be): the page has it
    ui.asked_for_chat(other, page)
    assert ui.open(other, page)[-4] == "Other"
    assert ui.open(fresh, page)[-4] == "New chat"  # back to it: the field follows the chat
