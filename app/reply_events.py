"""A chat's replies, as the page's events: one started and followed as it streams, stopped, answered again in a
new branch (Regenerate, an edited message) or after Drop the oldest turn, and ended when no page watches it any
more or Pagoda shuts down.

ReplyEvents is the replies' half of PagodaUI (app/ui.py, which has the chats and the live panels): it works on the
store, the model host, the sessions and the replies PagodaUI holds, and draws with PagodaUI's views of a chat
(history, shows, context_meter).
"""

import logging
import threading
import time

import gradio as gr

from app.backend import (
    BadSettings,
    ContextOverflow,
    ReplyStream,
    chat_messages,
    meter_text,
    reply_room,
)
from app.chat import ReplyTask, Turn, as_shown, preview
from app.chat_settings import ChatSettings
from app.chat_tools import chat_turns
from app.markdown_text import inert
from app.model_host import ModelHost
from app.page import user_error
from app.page.chat_tab import SLIDERS
from app.remote import RemoteError
from app.sessions import Replies, Sessions
from app.store import ConversationStore
from app.store_records import NEW_CHAT_TITLE, NotFound
from engine import EngineFailed

log = logging.getLogger("pagoda")
UNLOAD_GRACE_S = 5.0  # after a session ends, how long before its unwatched replies are aborted
UNWATCHED_S = 2.0  # a reply whose page has not polled it for this long is not being watched
STOP_WAIT_S = 10.0  # how long editing or regenerating waits for the chat's running reply to stop
SHUTDOWN_WAIT_S = 2.0  # how long shutting down waits for the replies streaming to store their last words
UNCHANGED = tuple(gr.update() for _ in range(6))  # a reply stream's outputs, left as they are
# A prompt shorter than this is read in well under a second: no progress line flickers before its reply.
PREFILL_PROGRESS_MIN_TOKENS = 256


class ReplyEvents:
    """The page's reply events, a base of PagodaUI: PagodaUI sets what is declared here and defines history(),
    shows() and context_meter(), and AttachEvents prompt_system()."""

    store: ConversationStore
    host: ModelHost
    sessions: Sessions
    replies: Replies

    def respond(
        self,
        conversation_id,
        user_text: str,
        system_prompt: str,
        temperature: float,
        top_p: float,
        top_k: int,
        min_p: float,
        repetition_penalty: float,
        max_tokens: int,
        request: gr.Request,
    ):
        """Add the user's message (when given), start the assistant's reply and follow it. A message the page is
        editing (edit_message) is replaced by this one in a new branch; the old branch stays."""
        sliders = (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens)
        if conversation_id is None:
            conversation_id = self.store.create(system_prompt=system_prompt or "").id
        after = self._edit_point(int(conversation_id), user_text, request)
        yield from self._answer(int(conversation_id), user_text, after, system_prompt, sliders, request)

    def _answer(self, conversation_id: int, user_text: str, after, system_prompt: str, sliders: tuple, request):
        """respond's work: the message (if any) and the reply go after message `after` ("end": the chat's last)."""
        system_prompt = system_prompt or ""
        backend = self.host.backend
        if backend is None:
            raise user_error(
                self.host.state.message if self.host.state.status != "idle" else "Load a model in the Models tab first."
            )
        running = self.replies.get(conversation_id)
        if running is not None and not running.done.is_set():
            raise user_error("This chat is still answering: press Stop first, or open another chat.")
        stored = self.store.get(conversation_id).settings  # the chat's switches (set_chat_options)
        settings = ChatSettings.from_dict(stored).replace(**dict(zip([k for k, *_ in SLIDERS], sliders, strict=True)))
        self.store.update(conversation_id, system_prompt=system_prompt, settings={**stored, **settings.to_dict()})
        pending = user_text if user_text and user_text.strip() else ""
        before = self.store.messages(conversation_id) if after == "end" else self._path_to(conversation_id, after)
        messages = chat_turns(before)
        if pending:
            messages.append({"role": "user", "content": pending})
        system = self.prompt_system(conversation_id, system_prompt)  # with the chat's files after it
        tools = self.tool_rounds(conversation_id, system, settings, backend)  # None: the chat has none on
        try:
            offered = {"tools": tools[0]} if tools else {}  # a chat without tools asks as it always has
            stream, num_prompt_tokens = backend.submit(chat_messages(system, messages), settings, **offered)
        except (ContextOverflow, RemoteError, EngineFailed, BadSettings) as e:  # too long a chat, the server
            # refused, the engine crashed on an earlier step, or the chat's JSON schema is broken: say so in the chat
            overflow = isinstance(e, ContextOverflow) or getattr(e, "context_overflow", False)
            alone = overflow and self.too_long_alone(backend, system, pending, settings)
            if alone:  # no dropping of turns or new chat can help: said at once, with nothing offered
                e, overflow = alone, False
            elif overflow and isinstance(e, RemoteError):
                e = f"{e} Drop the oldest messages, lower the reply length, or start a new chat."
            # The message is kept out of the chat until it can be answered: it stays in the box, for Drop the
            # oldest turn (which sends it) or an edit. Saved, it overflowed every later try too.
            yield (
                self.history(conversation_id),
                pending or gr.update(),
                gr.update(visible=True, value=f"**{e}**"),
                gr.update(visible=overflow),
                gr.update(),
                gr.update(),  # an edit in progress stays one
            )
            return
        if pending:
            after = self.store.add_message(conversation_id, "user", pending, after=after).id
            self._title_from_first_message(conversation_id, pending)
        reply = self.store.add_message(conversation_id, "assistant", "", after=after)
        if request is not None:
            with self.sessions.edit(request.session_hash) as session:
                session.editing = None
        rounds = tools[1] if tools else None
        task = ReplyTask(
            rounds.wrap(stream) if rounds else stream,
            self.store,
            reply.id,
            num_prompt_tokens,
            model=backend.model,
            max_tokens=settings.max_tokens,
            rounds=rounds,
        )
        self.replies.start(conversation_id, task, label=f"#{conversation_id} {self.store.get(conversation_id).title}")
        log.info(
            "chat %d: answering (%d prompt tokens, request %s)", conversation_id, num_prompt_tokens, stream.request_id
        )
        if request is not None:
            with self.sessions.edit(request.session_hash) as session:
                session.chats.add(conversation_id)
        if not self.shows(request, conversation_id):
            yield UNCHANGED
            return
        yield (
            self.history(conversation_id),
            "",  # clears the box
            gr.update(visible=False),
            gr.update(visible=False),
            self.live_meter(task.turn),
            gr.update(visible=False),  # the edit, if it was one, is done
        )
        yield from self.follow(conversation_id, request)

    def _path_to(self, conversation_id: int, message_id: int | None) -> list:
        return [] if message_id is None else self.store.path_to(conversation_id, message_id)

    def _edit_point(self, conversation_id: int, user_text: str, request) -> int | None | str:
        """Where a message sent now goes: after the chat's last ("end"), or, while the page edits one of the chat's
        messages, beside it (after its parent), so that the edit starts a new branch."""
        session = self.sessions.get(request.session_hash) if request is not None else None
        editing = session.editing if session is not None else None
        if editing is None or editing[0] != conversation_id:
            return "end"
        if not (user_text and user_text.strip()):
            raise user_error("Type the message's new text, or press Cancel edit to leave it as it is.")
        try:
            return self.store.path_to(conversation_id, editing[1])[-1].parent_id
        except NotFound:  # the message went (its turn was dropped): the text is sent as a new message
            return "end"

    @staticmethod
    def too_long_alone(backend, system_prompt: str, message: str, settings: ChatSettings) -> str | None:
        """Why `message`, which overflowed the context, cannot be sent in this chat or any other: alone, with the
        system prompt and room for the reply, it is longer than the context. None when dropping earlier turns
        could make room, when there is no new message (an answer to the chat's last one), or when only a server
        can count (its refusal may be about the reply length asked for)."""
        if not message:
            return None
        tokens = backend.prompt_tokens(chat_messages(system_prompt, [{"role": "user", "content": message}]), settings)
        limit = backend.max_model_len
        if tokens is None or limit is None:
            return None
        room = reply_room(settings.max_tokens)
        if tokens + room <= limit:
            return None
        return (
            f"This message alone is too long: with the system prompt it is {tokens:,} tokens, and the model's "
            f"context holds {limit:,}, of which {room} are kept for the reply. Shorten the message (or the system "
            "prompt, or take the chat's files off)."
        )

    def follow(self, conversation_id, request: gr.Request = None):
        """Show the chat's reply as it streams (the reply itself runs on, whatever this page does)."""
        hidden = gr.update(visible=False)
        task = self.replies.get(int(conversation_id)) if conversation_id is not None else None
        try:
            history = self.history(conversation_id)
        except NotFound:  # deleted as it answered: the page has opened another chat
            yield UNCHANGED
            return
        if task is None:
            shown = conversation_id is None or self.shows(request, conversation_id)
            yield (history, gr.update(), hidden, hidden, gr.update(), gr.update()) if shown else UNCHANGED
            return
        seen = None  # the version of the reply drawn: a new round, or a change in its calls, redraws the chat
        while True:
            task.last_followed = time.time()
            finished = task.done.wait(0.1)
            # The page opened another chat, or Stop/Edit/Regenerate took the reply back: stop drawing
            if task.withdrawn or not self.shows(request, conversation_id):
                yield UNCHANGED
                return
            if finished:  # as the chat shows it from now on: with its stats and links, from the store
                self.replies.finish(int(conversation_id), task)
                try:
                    final = self.history(conversation_id)
                except NotFound:  # deleted as it ended
                    yield UNCHANGED
                    return
                yield final, gr.update(), hidden, hidden, self.live_meter(task.turn), gr.update()
                return
            calling = task.calling
            if seen != (task.version, calling):
                seen = (task.version, calling)
                try:  # between rounds, the calls as stored; while a round streams, the rows before it
                    history = self.history(conversation_id, without_last=not calling)
                except NotFound:
                    yield UNCHANGED
                    return
                if calling:
                    yield history, gr.update(), hidden, hidden, gr.update(), gr.update()
            if calling:
                continue
            turn = task.turn
            content = as_shown(turn.text, "")
            if not (content or turn.reasoning):
                content = prefill_line(task.stream)
            thought = [thought_row(turn.reasoning, turn.thought_s, turn.thinking)] if turn.reasoning else []
            yield (
                history + [*thought, {"role": "assistant", "content": content}],
                gr.update(),
                hidden,
                hidden,
                self.live_meter(turn),
                gr.update(),
            )

    def after_reply(self, conversation_id):
        """Once a reply has ended: its chat's meter, and the chat list (a new chat took its title from its first
        message). A chat deleted as its reply ended leaves the meter to the chat the page opened instead."""
        try:
            meter = self.context_meter(conversation_id)
        except NotFound:
            return gr.update(), gr.update(choices=self.conversation_choices())
        return meter, gr.update(choices=self.conversation_choices(), value=conversation_id)

    def live_meter(self, turn: Turn):
        """The context meter while a reply streams: its prompt and the tokens written so far. A server's
        counts come only with its last increment: until then the meter stays as it was."""
        backend = self.host.backend
        if backend is None or not turn.prompt_tokens:
            return gr.update()
        return meter_text(turn.prompt_tokens + turn.output_tokens, backend.max_model_len)

    def stop(self, conversation_id) -> None:
        task = self.replies.get(int(conversation_id)) if conversation_id is not None else None
        if task is not None:
            task.cancel()

    def stop_and_show(self, conversation_id):
        """The Stop button: the reply ends where it is, and the chat shows it with its "stopped" line and the
        meter. Stop also ends the page's drawing of the stream, so without this the last frame stayed, unmarked."""
        self._stop_reply(conversation_id)
        if conversation_id is None:
            return gr.update(), gr.update()
        return self.history(conversation_id), self.context_meter(conversation_id)

    def on_unload(self, request: gr.Request) -> None:
        """A browser session ended: abort the replies it started that no page is showing any more.

        Gradio also reports a session as ended when its heartbeat connection merely hiccups, so a
        reply still followed by a live page after a grace period is left alone."""
        ended = self.sessions.end(request.session_hash)
        chats = ended.chats if ended is not None else set()

        def abort_unwatched() -> None:
            for conversation_id in chats:
                task = self.replies.get(conversation_id)
                if task is not None and time.time() - task.last_followed > UNWATCHED_S:
                    log.info("browser gone: stopping the reply in chat %s", conversation_id)
                    task.cancel()

        timer = threading.Timer(UNLOAD_GRACE_S, abort_unwatched)
        timer.daemon = True  # Pagoda exits without waiting for it: its replies end as interrupted anyway
        timer.start()

    def interrupt_replies(self, timeout: float = SHUTDOWN_WAIT_S) -> None:
        """Pagoda is shutting down: every reply still streaming ends where it is, stored as interrupted."""
        tasks = self.replies.running()
        for task in tasks:
            task.interrupt()
        deadline = time.monotonic() + timeout
        for task in tasks:
            task.done.wait(max(0.0, deadline - time.monotonic()))

    def _title_from_first_message(self, conversation_id: int, text: str) -> None:
        conv = self.store.get(conversation_id)
        if conv.title == NEW_CHAT_TITLE:
            self.store.rename(conversation_id, preview(text, 40))

    def regenerate(
        self,
        conversation_id,
        system_prompt: str,
        temperature: float,
        top_p: float,
        top_k: int,
        min_p: float,
        repetition_penalty: float,
        max_tokens: int,
        request: gr.Request,
    ):
        """A new reply to the last message, beside the last reply (which stays: ‹ › under it switches back), or the
        reply to the last message, when it never came."""
        self._stop_reply(conversation_id)
        msgs = self.store.messages(conversation_id) if conversation_id is not None else []
        if not msgs:
            raise user_error("There is no reply to regenerate yet.")
        # The reply is every message after the user's last (a reply that called tools is one a round): all of it is
        # written anew, beside its first round, so its rounds limit and "Before each answer" start afresh too
        last_user = next((i for i in range(len(msgs) - 1, -1, -1) if msgs[i].role == "user"), None)
        if last_user is None:  # an imported chat can start with a reply
            raise user_error("This reply starts the chat: there is no message to answer again.")
        after = "end" if last_user == len(msgs) - 1 else msgs[last_user].id
        sliders = (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens)
        yield from self._answer(int(conversation_id), "", after, system_prompt, sliders, request)

    def _stop_reply(self, conversation_id) -> None:
        """Stop the chat's running reply, if any, and wait until it has stored its last words. Editing and
        regenerating delete messages: a reply still streaming into a deleted one left the page showing it
        with an internal error ("No message with id ...")."""
        task = self.replies.get(int(conversation_id)) if conversation_id is not None else None
        if task is None:
            return
        task.withdrawn = True  # before it ends: no page draws its last frame over what comes next
        task.cancel()
        if not task.done.wait(STOP_WAIT_S):
            raise user_error("The reply is still stopping; try again in a moment.")
        self.replies.finish(int(conversation_id), task)

    def edit_message(self, conversation_id: int, message_id: int, request: gr.Request = None) -> str:
        """Start editing one of the chat's messages: its reply, if it is still being written, stops, and the next
        message sent goes beside it (respond). Returns its text, for the box."""
        self._stop_reply(conversation_id)
        message = self.store.path_to(conversation_id, message_id)[-1]
        if message.role != "user":
            raise user_error("Only your own messages can be edited: Regenerate writes a reply anew.")
        if request is not None:
            with self.sessions.edit(request.session_hash) as session:
                session.editing = (conversation_id, message_id)
        return message.content

    def cancel_edit(self, request: gr.Request = None):
        """Cancel edit: the next message sent goes at the end of the chat again. Hides the edit note."""
        if request is not None:
            with self.sessions.edit(request.session_hash) as session:
                session.editing = None
        return gr.update(visible=False)

    def drop_oldest_and_answer(
        self,
        conversation_id,
        user_text: str,
        system_prompt: str,
        temperature: float,
        top_p: float,
        top_k: int,
        min_p: float,
        repetition_penalty: float,
        max_tokens: int,
        request: gr.Request,
    ):
        """The overflow's offer, carried out: delete the oldest user message and its replies (the user's
        explicit choice), then send the message that did not fit (or answer the chat's last one)."""
        msgs = self.store.messages(conversation_id) if conversation_id is not None else []
        if not msgs:
            message = (
                "**This message alone is longer than the model's context holds, with room for the reply: "
                "shorten it, or lower the reply length.**"
            )
            yield (
                self.history(conversation_id),
                gr.update(),
                gr.update(visible=True, value=message),
                gr.update(visible=False),
                gr.update(),
                gr.update(),
            )
            return
        next_user = next((m for m in msgs[1:] if m.role == "user"), None)  # None: one turn, and it all goes
        self.store.drop_turns_before(conversation_id, next_user.id if next_user is not None else None)
        yield from self.respond(
            conversation_id,
            user_text,
            system_prompt,
            temperature,
            top_p,
            top_k,
            min_p,
            repetition_penalty,
            max_tokens,
            request,
        )


def prefill_line(stream: ReplyStream) -> str:
    """What an empty reply bubble says while the model reads a long prompt: tokens read out of the total."""
    progress = stream.prefill_progress()
    if progress is None or progress[1] < PREFILL_PROGRESS_MIN_TOKENS:
        return ""
    done, total = progress
    return f"*Reading the prompt: {done:,} / {total:,} tokens…*"


def thought_row(reasoning: str, seconds: float | None, thinking: bool) -> dict:
    """A reply's reasoning as Gradio's collapsible thought message, above the answer."""
    if thinking:
        title = "Thinking…"
    else:
        title = f"Thought for {seconds:.1f} s" if seconds is not None else "Thought (stopped)"
    metadata = {"title": title, "status": "pending" if thinking else "done"}
    return {"role": "assistant", "content": inert(reasoning), "metadata": metadata}
