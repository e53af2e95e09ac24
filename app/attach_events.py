"""A chat's files, as the page's events: attach (read, stored once per content), the list under the chat with each
file's size in tokens, taking one off, and the choice a file too big for the context gets before anything is sent.

AttachEvents is a base of PagodaUI (app/ui.py), like ReplyEvents: it works on the store, the model host and the
sessions PagodaUI holds. The files' text goes into the prompt right after the system prompt (app/documents.py).
"""

from pathlib import Path

import gradio as gr

from app.backend import reply_room
from app.chat import count
from app.chat_settings import ChatSettings
from app.markdown_text import markdown_escaped
from app.model_host import ModelHost
from app.page import user_error
from app.sessions import PendingFile, Sessions
from app.store import ConversationStore
from app.store_records import NotFound
from entrypoints.documents import (
    DEFAULT_MAX_FILE_MB,
    DocumentError,
    content_hash,
    document_block,
    extract_text,
    with_documents,
)

QUESTION_ROOM = 256  # tokens a file's cut leaves, beyond the reply's room, for the question about it


class AttachEvents:
    """The page's file events, a base of PagodaUI."""

    store: ConversationStore
    host: ModelHost
    sessions: Sessions
    max_file_mb: float = DEFAULT_MAX_FILE_MB

    def prompt_system(self, conversation_id: int, system_prompt: str) -> str:
        """The chat's system prompt with its files' text after it: what the model reads first."""
        files = self.store.chat_files(conversation_id)
        return with_documents(system_prompt, [(f.name, f.text) for f in files])

    def attach_files(self, conversation_id, paths: list | None, request: gr.Request = None):
        """Files picked or dropped: each is read and attached, except one too big for the context, which waits for
        the user's choice (keep_start or discard_pending). Returns the file list, the meter, the choice's row and
        its text."""
        if conversation_id is None:
            raise user_error("Open a chat to attach files to it.")
        conversation_id = int(conversation_id)
        problems, pending = [], None
        for path in paths or []:
            path = Path(getattr(path, "name", path))
            name = path.name
            try:
                size = path.stat().st_size
                if size > self.max_file_mb * 1024 * 1024:
                    raise DocumentError(
                        f"{name} is {megabytes(size)}; files up to {self.max_file_mb:g} MB are taken "
                        "(--max-file-mb sets it)."
                    )
                data = path.read_bytes()
                text = extract_text(name, data)
            except (DocumentError, OSError) as e:
                problems.append(str(e))
                continue
            room = self.document_room(conversation_id)
            tokens = self.document_tokens(name, text)
            if room is not None and tokens is not None and tokens > room:
                if pending is not None:  # one choice at a time
                    problems.append(f"{name} is too big for the context too: attach it again after choosing.")
                    continue
                pending = PendingFile(conversation_id, name, data, text, tokens, room)
                continue
            self.store.attach_file(conversation_id, name, content_hash(data), data, text)
        if request is not None:
            with self.sessions.edit(request.session_hash) as session:
                session.pending_file = pending
        if problems:
            gr.Warning(" ".join(problems))
        return (self.files_view(conversation_id), self.context_meter(conversation_id), *self._choice(pending))

    def _choice(self, pending) -> tuple:
        if pending is None:
            return gr.update(visible=False), gr.update()
        if pending.room <= 0:
            note = (
                f"**{pending.name}** is {count(pending.tokens, 'token')}, and this chat has no room left for it: take "
                "other files off, or attach it in a new chat."
            )
        else:
            note = (
                f"**{pending.name}** is {count(pending.tokens, 'token')}: more than the model's context has room for "
                f"here ({pending.room:,} tokens, with the chat's other files, its reply and a question). Nothing is "
                "attached yet: keep only its start, or leave it out."
            )
        return gr.update(visible=True), note

    def keep_start(self, conversation_id, request: gr.Request = None):
        """The choice for a file too big: attach its first tokens, as many as the chat has room for."""
        pending = self._take_pending(request)
        if pending is None or conversation_id is None or pending.conversation_id != int(conversation_id):
            return self.files_view(conversation_id), gr.update(), gr.update(visible=False)
        if pending.room <= 0:
            raise user_error(f"There is no room for {pending.name} in this chat: take other files off first.")
        if self.host.backend is None:
            raise user_error(f"Load a model first: it counts how much of {pending.name} fits.")
        keep = self.chars_within(pending.name, pending.text, pending.room)
        self.store.attach_file(
            pending.conversation_id, pending.name, content_hash(pending.data), pending.data, pending.text, keep
        )
        return self.files_view(conversation_id), self.context_meter(conversation_id), gr.update(visible=False)

    def discard_pending(self, request: gr.Request = None):
        """The other choice: the file is left out."""
        self._take_pending(request)
        return gr.update(visible=False)

    def _take_pending(self, request):
        if request is None:
            return None
        with self.sessions.edit(request.session_hash) as session:
            pending, session.pending_file = session.pending_file, None
        return pending

    def detach(self, conversation_id: int, sha256: str) -> None:
        try:
            self.store.detach_file(conversation_id, sha256)
        except NotFound:
            raise user_error("That file is not attached any more.") from None

    def files_view(self, conversation_id) -> str:
        """The chat's files, above the message box: name, size in tokens (characters while no local model counts
        them), whether only its start is kept, and a link that takes it off."""
        if conversation_id is None:
            return ""
        files = self.store.chat_files(int(conversation_id))
        chips = []
        for f in files:
            tokens = self.document_tokens(f.name, f.text)
            size = count(tokens, "token") if tokens is not None else count(len(f.text), "character")
            cut = " (its start only)" if f.shortened else ""
            chips.append(f"**{markdown_escaped(f.name)}** · {size}{cut} · [remove](#pagoda-detach-{f.sha256})")
        return "  \n".join(chips)

    def document_tokens(self, name: str, text: str) -> int | None:
        """The tokens a document takes in the prompt, as the loaded model counts them (None: none counts)."""
        backend = self.host.backend
        if backend is None:
            return None
        return backend.prompt_tokens([{"role": "system", "content": document_block(name, text)}], ChatSettings())

    def document_room(self, conversation_id: int) -> int | None:
        """The tokens a new document may take in this chat: the context, less the system prompt and files it has,
        the reply's room and a question's. None when no local model knows the context."""
        backend = self.host.backend
        limit = getattr(backend, "max_model_len", None)
        if backend is None or not limit:
            return None
        conv = self.store.get(conversation_id)
        system = self.prompt_system(conversation_id, conv.system_prompt)
        settings = ChatSettings.from_dict(conv.settings)
        used = backend.prompt_tokens([{"role": "system", "content": system}], settings) if system else 0
        if used is None:
            return None
        return limit - used - reply_room(settings.max_tokens) - QUESTION_ROOM

    def chars_within(self, name: str, text: str, tokens: int) -> int:
        """The most characters of `text` whose document block takes at most `tokens` tokens (a binary search)."""
        low, high = 0, len(text)
        while low < high:
            mid = (low + high + 1) // 2
            if self.document_tokens(name, text[:mid]) <= tokens:
                low = mid
            else:
                high = mid - 1
        return max(low, 1)


def megabytes(size: int) -> str:
    return f"{size / 2**20:.1f} MB" if size >= 2**20 // 10 else f"{size / 1024:.0f} kB"
