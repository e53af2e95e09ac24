"""The Pagoda page: conversations on the left, the chat in the middle, the KV cache and models in tabs.

Everything a chat shows lives in the store; the page only renders it. Replies stream from the
one engine thread that all chats share, or from a remote OpenAI-compatible server (app/remote.py).
PagodaUI answers the page's events: a chat's replies in app/reply_events.py (ReplyEvents, its base), the chats
and the live panels here. app/page/layout.py's `build` lays the page out from its parts in app/page/.
"""

import shutil
import tempfile
import time
import weakref
from pathlib import Path

import gradio as gr

from app.archive import read_archive
from app.attach_events import AttachEvents
from app.chat import as_shown, preview, summary
from app.chat_settings import ChatSettings
from app.model_host import ModelHost
from app.page import user_error
from app.page.chat_tab import SLIDERS
from app.reply_events import ReplyEvents, thought_row
from app.sessions import Replies, Session, Sessions
from app.store import ConversationStore
from app.store_records import Message, NotFound
from app.tool_events import ToolEvents, call_rows, open_mcp
from entrypoints.documents import DEFAULT_MAX_FILE_MB


class PagodaUI(ReplyEvents, AttachEvents, ToolEvents):
    """Owns the store, the model host, each browser session's state and the replies streaming now."""

    def __init__(
        self,
        store: ConversationStore,
        host: ModelHost,
        max_concurrent_chats: int = 16,
        max_file_mb: float = DEFAULT_MAX_FILE_MB,
        mcp_config: Path | None = None,
        mcp_commands_allowed: bool = True,
    ):
        """`mcp_config`: the mcp.json whose servers give the chats' tools (each started on first use);
        `mcp_commands_allowed`: False when pages from other computers can reach this one (no stdio servers)."""
        self.store, self.host = store, host
        self.max_concurrent_chats = max_concurrent_chats
        self.max_file_mb = max_file_mb
        self.sessions = Sessions()
        self.replies = Replies()
        self.export_dir = Path(tempfile.mkdtemp(prefix="pagoda-export-"))  # each chat's files, rewritten in place
        # Exported chats are private: gone when the app is (at exit too), not left in the system's temp folder
        weakref.finalize(self, shutil.rmtree, self.export_dir, ignore_errors=True)
        self.mcp_config, self.mcp_commands_allowed = mcp_config, mcp_commands_allowed
        if mcp_config is not None:
            self.mcp, self.mcp_problem = open_mcp(mcp_config, mcp_config.parent / "logs", mcp_commands_allowed)

    # ---- conversations --------------------------------------------------------------------------
    def conversation_choices(self, query: str = "") -> list[tuple[str, int]]:
        """The chat list's (label, id) pairs: pinned chats first and marked, a chat in a folder named after it."""
        return [
            (("📌 " if c.pinned else "") + (f"{c.folder} › " if c.folder else "") + c.title, c.id)
            for c in self.store.list(query)
        ]

    def chat_place(self, conversation_id):
        """The open chat's Pin button (its label says what it does) and folder, for the sidebar."""
        try:
            conv = self.store.get(int(conversation_id)) if conversation_id is not None else None
        except NotFound:  # deleted meanwhile
            conv = None
        if conv is None:
            return gr.update(), gr.update()
        return gr.update(value="Unpin" if conv.pinned else "Pin to top"), conv.folder

    def toggle_pin(self, conversation_id):
        """Pin the open chat to the top of the list, or unpin it."""
        if conversation_id is None:
            raise user_error("Open a chat to pin it.")
        conv = self.store.get(int(conversation_id))
        self.store.place(conv.id, pinned=not conv.pinned)
        return gr.update(choices=self.conversation_choices(), value=conv.id), *self.chat_place(conv.id)[:1]

    def move_to_folder(self, conversation_id, folder: str):
        """Put the open chat in a folder (its name shows before the title; search finds it); "" takes it out."""
        if conversation_id is None:
            raise user_error("Open a chat to put it in a folder.")
        self.store.place(int(conversation_id), folder=folder or "")
        return gr.update(choices=self.conversation_choices(), value=int(conversation_id))

    def history(self, conversation_id: int | None, without_last: bool = False) -> list[dict]:
        """The chat's shown path as the chatbot's rows: each message with its line of links (‹ › to its other
        branches, ✎ edit, new chat from here; message_action follows them), for a reply its stats, and the tools it
        called. `without_last`: all but the last message (the reply that streams, drawn as it comes)."""
        if conversation_id is None:
            return []
        rows = []
        msgs = self.store.messages(conversation_id)
        running = self.replies.get(int(conversation_id))
        for i, m in enumerate(msgs[:-1] if without_last else msgs):
            stats = summary(m.meta) if m.role == "assistant" else ""
            # Saved mid-stream and never finished, and not the reply streaming now: Pagoda stopped under it
            # (a crash, a kill). It looked finished.
            live = running is not None and not running.done.is_set() and i == len(msgs) - 1
            if m.role == "assistant" and m.meta.get("finished") is False and not live:
                stats = "interrupted: Pagoda stopped before this reply finished" + (f" · {stats}" if stats else "")
            nav, actions = ("", "") if live else message_links(m, self.store.siblings(m.conversation_id, m.id))
            content = as_shown(m.content, " · ".join(part for part in (nav, stats, actions) if part))
            if m.role == "assistant" and m.meta.get("reasoning"):
                rows.append(thought_row(m.meta["reasoning"], m.meta.get("thought_s"), thinking=live and not m.content))
            calls = call_rows(m, live)
            if m.content or not calls or nav:  # a round that only called tools shows its calls (and ‹ › if any)
                rows.append({"role": m.role, "content": content})
            rows += calls
        return rows

    def context_meter(self, conversation_id: int | None) -> str:
        backend = self.host.backend
        if conversation_id is None or backend is None:
            return ""
        conv = self.store.get(conversation_id)
        system = self.prompt_system(conversation_id, conv.system_prompt)
        return backend.context_meter(system, self.store.messages(conversation_id))

    def shows(self, request: gr.Request | None, conversation_id: int) -> bool:
        """Whether this session's page still shows the chat, so a stream may draw into its chatbot.

        A stream that outlives a switch to another chat (its cancel arrives late) must not paint its
        chat over the one now open. API clients open no chat, so they see every stream they start."""
        session = self.sessions.get(request.session_hash) if request is not None else None
        shown = session.viewing if session is not None else None
        return shown is None or shown == int(conversation_id)

    def open(self, conversation_id: int | None, request: gr.Request = None):
        if conversation_id is None:
            return [], "", None, *slider_values(ChatSettings()), "", "", *self.chat_options(None)
        conv = self.store.get(conversation_id)
        typed = False
        if request is not None:
            with self.sessions.edit(request.session_hash) as session:
                # The page has this chat's title already: it opened it a moment ago (a page's first opening can come
                # twice), or New chat's click put it there. Sent again, it could land over what is typed meanwhile.
                shown = session.viewing == conv.id and session.title_sent == (conv.id, conv.title)
                typed = session.title_typed_for == conv.id or session.title_preset == conv.id or shown
                session.viewing, session.title_sent = conv.id, (conv.id, conv.title)
                session.title_preset = None
        think, json_output, json_schema = self.chat_options(conversation_id)
        # A title typed while the chat opened (right after New chat) stays: it was overwritten with "New chat"
        title = gr.update() if typed else conv.title
        return (
            self.history(conversation_id),
            conv.system_prompt,
            conv.id,
            *slider_values(ChatSettings.from_dict(conv.settings)),
            self.context_meter(conversation_id),
            title,
            gr.update(value=think, **self.think_switch()),
            json_output,
            json_schema,
        )

    def asked_for_chat(self, conversation_id, request: gr.Request = None) -> None:
        """New chat pressed, a chat picked in the list, or a Rename (None): the Title field follows the chat
        until the user types in it again (see `title_typed`)."""
        if request is not None:
            with self.sessions.edit(request.session_hash) as session:
                session.asked_for = None if conversation_id is None else int(conversation_id)
                session.title_typed_for = session.title_preset = None

    def title_typed(self, request: gr.Request = None) -> None:
        """The user typed in the Title field: neither the opening of the chat they asked for nor the title its
        first message gives replaces what they type, until Rename or another chat."""
        if request is not None:
            with self.sessions.edit(request.session_hash) as session:
                session.title_typed_for = session.asked_for

    def think_switch(self) -> dict:
        """Whether the page offers Think: only while a model that reasons serves. Not while a model loads (it
        showed, ticked, for a model that does not reason); the header's change at the end of a load asks again."""
        backend = self.host.backend
        return {"visible": backend is not None and backend.thinks}

    def chat_options(self, conversation_id: int | None) -> tuple[bool, bool, str]:
        """The chat's switches: Think, JSON output, and its schema."""
        settings = ChatSettings.from_dict(self.store.get(conversation_id).settings if conversation_id else None)
        return settings.think, settings.json_output, settings.json_schema

    def set_chat_options(self, conversation_id: int | None, think: bool, json_output: bool, json_schema: str) -> None:
        """Keep the chat's switches with it (they apply from its next reply on)."""
        if conversation_id is None:
            return
        conv = self.store.get(conversation_id)
        settings = ChatSettings.from_dict(conv.settings).replace(
            think=think, json_output=json_output, json_schema=json_schema
        )
        self.store.update(conversation_id, settings={**conv.settings, **settings.to_dict()})

    def save_system_prompt(self, conversation_id: int | None, system_prompt: str, request: gr.Request = None):
        """Keep a chat's system prompt as it is typed: saved only with the next message, an edit was lost on
        switching to another chat first, and the meter did not count it. Returns the chat's meter."""
        if conversation_id is None:
            return gr.update()
        conversation_id, system_prompt = int(conversation_id), system_prompt or ""
        try:
            if self.store.get(conversation_id).system_prompt != system_prompt:  # a mere focus and blur moves nothing
                self.store.update(conversation_id, system_prompt=system_prompt)
        except NotFound:  # deleted while it was typed
            return gr.update()
        # A save that lands once the page has opened another chat must not put this chat's count under that one
        return self.context_meter(conversation_id) if self.shows(request, conversation_id) else gr.update()

    def new_chat(self, system_prompt: str, query: str, request: gr.Request = None):
        """Open an empty chat with `system_prompt`: the empty one already in the list, if any (each press added
        another empty "New chat")."""
        conv = self.store.empty_chat(system_prompt or "")
        self.asked_for_chat(conv.id, request)
        if request is not None:  # the page showed its title at the click (wire_sidebar)
            with self.sessions.edit(request.session_hash) as session:
                session.title_preset = conv.id
        return gr.update(choices=self.conversation_choices(query), value=conv.id)

    def delete_chat(self, conversation_id):
        """Delete the chat (None: the browser's confirmation said no) and open the first one left."""
        if conversation_id is None:
            return gr.update()
        self.stop(conversation_id)
        try:
            self.store.delete(int(conversation_id))
        except NotFound:  # another tab deleted it first
            pass
        choices = self.conversation_choices()
        return gr.update(choices=choices, value=choices[0][1] if choices else None)

    def rename(self, conversation_id, title: str, number: int = 0, request: gr.Request = None):
        """Rename the chat; `number` counts the page's Rename clicks, this one included (see `export`)."""
        try:
            if conversation_id is None:
                raise user_error("Open a chat to rename it.")
            try:
                self.store.rename(int(conversation_id), title)
            except ValueError as e:  # an empty title
                raise user_error(str(e)) from None
            self.asked_for_chat(conversation_id, request)  # the field holds the chat's title again: it follows the chat
        finally:  # done, or refused: an Export that waits on it goes on
            if request is not None:
                with self.sessions.edit(request.session_hash) as session:
                    session.renames_done = max(session.renames_done, int(number or 0))
        return gr.update(choices=self.conversation_choices(), value=int(conversation_id))

    def export(self, conversation_id, kind: str, renames_before: int = 0, request: gr.Request = None) -> str:
        """The chat as it is stored now, as a Markdown ("md") or JSON file named after its title.

        `renames_before`: the page's Rename clicks before this Export. Their requests may reach the server after
        this one, and the file must have the title the user just gave, so it waits for them (a while at most)."""
        if conversation_id is None:
            raise user_error("Open a chat to export it.")
        if request is not None and renames_before:
            self.sessions.wait_until(
                request.session_hash, lambda session: session.renames_done >= int(renames_before), timeout=10.0
            )
        conversation_id = int(conversation_id)
        title = self.store.get(conversation_id).title
        safe = "".join(ch if ch.isalnum() or ch in "-_ " else "_" for ch in title).strip() or "chat"
        text = self.store.export_markdown(conversation_id) if kind == "md" else self.store.export_json(conversation_id)
        folder = self.export_dir / str(conversation_id)
        folder.mkdir(exist_ok=True)
        for old in folder.glob(f"*.{kind}"):  # a renamed chat's file under its old title
            old.unlink()
        path = folder / f"{safe}.{kind}"
        path.write_text(text, encoding="utf-8")
        return str(path)

    def message_action(self, conversation_id, action: str, request: gr.Request = None) -> tuple:
        """A link under a message, clicked: "show-<id>" (‹ ›: that branch), "edit-<id>" (✎: the message into the box,
        sent as a new branch) or "branch-<id>" (new chat from here: a copy of the chat down to it, opened); under
        the files, "detach-<sha256>" (remove); under a tool call, "allow-", "always-" or "deny-<the call's token>".
        Returns the chat, the box, the edit note's row and text, the meter, the chat list and the files."""
        keep = gr.update()
        kind, _, number = (action or "").partition("-")
        if conversation_id is not None and kind == "detach":
            self.detach(int(conversation_id), number)
            conversation_id = int(conversation_id)
            return keep, keep, keep, keep, self.context_meter(conversation_id), keep, self.files_view(conversation_id)
        if conversation_id is not None and kind in ("allow", "always", "deny"):  # a tool call's answer
            self.decide_call(int(conversation_id), number, kind)
            return (keep,) * 7  # the reply's page, following it, draws what the call does next
        if conversation_id is None or not number.isdigit() or kind not in ("show", "edit", "branch"):
            return (keep,) * 7
        conversation_id, message_id = int(conversation_id), int(number)
        try:
            if kind == "edit":
                text = self.edit_message(conversation_id, message_id, request)
                note = (
                    f"**Editing** “{preview(text)}”. Send starts a new branch from it; the old one stays, and ‹ › "
                    "under the message switches between them."
                )
                return self.history(conversation_id), text, gr.update(visible=True), note, keep, keep, keep
            if kind == "show":
                running = self.replies.get(conversation_id)
                if running is not None and not running.done.is_set():
                    raise user_error("This chat is still answering: press Stop first, then switch branches.")
                self.store.show(conversation_id, message_id)
                return self.history(conversation_id), keep, keep, keep, self.context_meter(conversation_id), keep, keep
            branch = self.store.branch(conversation_id, message_id)
        except NotFound:  # the page showed a message since dropped, or a chat since deleted
            raise user_error("That message is gone: the chat changed since the page drew it.") from None
        self.asked_for_chat(branch.id, request)
        return keep, keep, keep, keep, keep, gr.update(choices=self.conversation_choices(), value=branch.id), keep

    def export_all(self) -> str:
        """Every chat, its branches and files, and the presets, as one archive file (app/archive.py) to download."""
        path = self.export_dir / f"pagoda-chats-{time.strftime('%Y-%m-%d')}.json"
        path.write_text(self.store.export_all(), encoding="utf-8")
        return str(path)

    def import_chats(self, file) -> dict:
        """Import a file of chats (Pagoda's archive or chat export, Open WebUI's, ChatGPT's), merged with what is
        here; what it added is said in a toast, and the chat list shows it. A file of another kind changes nothing."""
        if file is None:
            return gr.update()
        path = Path(getattr(file, "name", file))
        try:
            report = self.store.import_archive(read_archive(path.read_text(encoding="utf-8")))
        except (ValueError, UnicodeDecodeError) as e:
            raise user_error(f"{path.name} was not imported: {e}") from None
        gr.Info(str(report))
        return gr.update(choices=self.conversation_choices())

    # ---- live panels ----------------------------------------------------------------------------
    def header(self) -> str:
        backend = self.host.backend
        if backend is None:
            return f"**Pagoda** · {self.host.status_message()}"
        parts = [backend.label, backend.quantization, backend.device_label()]
        return "**Pagoda** · " + " · ".join(p for p in parts if p)

    def panels(self, query: str, request: gr.Request, conversation_id: int | None = None) -> tuple:
        """The timer's refresh of the KV grid, the header, the chat titles and the open chat's Title field
        (`conversation_id`'s), for one page.

        The grid is thousands of elements: it is rendered only while the page shows its tab. None of
        the four is re-sent when unchanged since this page last got it (so a title being typed in the Title
        field stays). Titles refresh here so that a new chat takes its title from the first message while
        its reply still streams, in the list and in the Title field alike."""
        session_hash = request.session_hash if request is not None else ""
        page = self.sessions.get(session_hash) or Session()
        sent_html, sent_header, sent_titles = page.panels_sent
        html = self.kv_panel() if page.kv_tab_open else sent_html  # rendered outside the lock: it takes a while
        header, titles = self.header(), self.conversation_choices(query or "")
        open_title = self.title_of(conversation_id)
        with self.sessions.edit(session_hash) as session:
            session.panels_sent = (html, header, titles)
            # Only for the chat the page shows now: a tick that read the chat open before a switch would put that
            # chat's title in the field (and a Rename then gave it to this chat)
            new_title = (
                open_title is not None
                and open_title[0] == session.viewing
                and open_title != session.title_sent
                and session.title_typed_for != session.viewing
            )
            if new_title:
                session.title_sent = open_title
        return (
            gr.update() if html == sent_html else html,
            gr.update() if header == sent_header else header,
            gr.update() if titles == sent_titles else gr.update(choices=titles),
            open_title[1] if new_title else gr.update(),
        )

    def title_of(self, conversation_id: int | None) -> tuple[int, str] | None:
        """(The chat, its title) as stored now; None for no chat, or one deleted."""
        if conversation_id is None:
            return None
        try:
            return int(conversation_id), self.store.get(int(conversation_id)).title
        except NotFound:
            return None

    def show_kv_tab(self, shown: bool, request: gr.Request) -> None:
        with self.sessions.edit(request.session_hash if request is not None else "") as session:
            session.kv_tab_open = shown

    def kv_panel(self) -> str:
        backend = self.host.backend
        return backend.kv_panel(self.replies.labels()) if backend is not None else "<p>No model loaded.</p>"


def message_links(message: Message, siblings: list[int]) -> tuple[str, str]:
    """The links under a message: "‹ 2/3 ›" to the other branches at it, and its actions, ✎ edit (for the user's
    own) and "new chat from here". Each is a "#pagoda-<action>" link that the page's script makes a message_action."""
    nav = ""
    if len(siblings) > 1:
        i = siblings.index(message.id)
        before = f"[‹](#pagoda-show-{siblings[i - 1]})" if i > 0 else "‹"
        after = f"[›](#pagoda-show-{siblings[i + 1]})" if i + 1 < len(siblings) else "›"
        nav = f"{before} {i + 1}/{len(siblings)} {after}"
    edit = f"[✎ edit](#pagoda-edit-{message.id}) · " if message.role == "user" else ""
    return nav, f"{edit}[new chat from here](#pagoda-branch-{message.id})"


def slider_values(settings: ChatSettings) -> list:
    """The chat's settings in the order of the Chat tab's sliders (SLIDERS)."""
    return [getattr(settings, k) for k, *_ in SLIDERS]
