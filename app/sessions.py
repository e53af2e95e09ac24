"""What the page keeps between events: each browser session's state, and the replies streaming across sessions.

Gradio runs events on worker threads, and PagodaUI.on_unload aborts replies from a timer thread, so
both registries change their state only under a lock. A Session handed out by `Sessions.get` is a copy.
"""

import dataclasses
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from app.chat import ReplyTask

NOT_SENT = (None, None, None)


@dataclass
class PendingFile:
    """A file too big for its chat's context, read but not attached until the user chooses (keep its start, or
    leave it out)."""

    conversation_id: int
    name: str
    data: bytes
    text: str
    tokens: int
    room: int  # the tokens the chat has room for


@dataclass
class Session:
    """One browser page: what it shows and which replies it started."""

    chats: set[int] = field(default_factory=set)  # chats whose replies this page started
    viewing: int | None = None  # the chat the page shows (None: none opened, as for API clients)
    kv_tab_open: bool = False  # whether the page shows the KV cache tab
    panels_sent: tuple = NOT_SENT  # (KV HTML, header, chat titles) the page last got from the timer
    title_sent: tuple[int, str] | None = None  # (chat, title) the page's Title field last got
    asked_for: int | None = None  # the chat the user asked for last (New chat, or a pick in the list)
    # The chat whose title the user typed in the Title field, when it is `asked_for`: what they type is theirs
    # until Rename, and neither that chat's opening nor the title its first message gives may replace it
    title_typed_for: int | None = None
    # The chat whose title the page put in the Title field itself, at New chat's click (in the browser, before the
    # server answers): its opening sends none, which could only land over what the user began to type since
    title_preset: int | None = None
    # The page's Rename clicks the server has carried out. The page numbers each click as it sends it, and an Export
    # waits for the Renames clicked before it: the two requests may reach the server in either order.
    renames_done: int = 0
    editing: tuple[int, int] | None = None  # (chat, message) whose ✎ edit the page is doing: sent, it branches
    pending_file: PendingFile | None = None  # a file too big, waiting for the user's choice


class Sessions:
    """Every open page's Session, by Gradio's session hash."""

    def __init__(self):
        self._lock = threading.Lock()
        self._edited = threading.Condition(self._lock)
        self._sessions: dict[str, Session] = {}

    @contextmanager
    def edit(self, session_hash: str) -> Iterator[Session]:
        """The session to change (created on first use), held under the lock until the block ends.

        Keep the block short: every page's events wait on it."""
        with self._lock:
            yield self._sessions.setdefault(session_hash, Session())
            self._edited.notify_all()

    def wait_until(self, session_hash: str, ready: Callable[[Session], bool], timeout: float) -> bool:
        """Wait until an edit makes `ready(session)` true (a page not seen yet counts as a new Session); False
        if `timeout` seconds pass first."""
        with self._lock:
            return self._edited.wait_for(lambda: ready(self._sessions.get(session_hash) or Session()), timeout)

    def get(self, session_hash: str) -> Session | None:
        """A copy of the session as it is now; None for a page that has not opened (or has ended)."""
        with self._lock:
            session = self._sessions.get(session_hash)
            return None if session is None else dataclasses.replace(session, chats=set(session.chats))

    def end(self, session_hash: str) -> Session | None:
        """Forget the session and hand it over: nothing changes it after this."""
        with self._lock:
            return self._sessions.pop(session_hash, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)


class Replies:
    """The replies streaming now, shared by every page: conversation id -> its ReplyTask, and the label the
    KV cache tab shows for each engine request."""

    def __init__(self):
        self._lock = threading.Lock()
        self._tasks: dict[int, ReplyTask] = {}
        self._labels: dict[str, str] = {}  # engine request id -> "#<id> <title>"

    def get(self, conversation_id: int) -> ReplyTask | None:
        with self._lock:
            return self._tasks.get(conversation_id)

    def start(self, conversation_id: int, task: ReplyTask, label: str) -> None:
        with self._lock:
            self._tasks[conversation_id] = task
            self._labels[task.stream.request_id] = label

    def finish(self, conversation_id: int, task: ReplyTask) -> None:
        """Forget a reply that ended. A newer reply of the same chat (started once this one was done,
        while a page still drew this one's end) stays."""
        with self._lock:
            if self._tasks.get(conversation_id) is task:
                del self._tasks[conversation_id]
            self._labels.pop(task.stream.request_id, None)

    def running(self) -> list[ReplyTask]:
        with self._lock:
            return [task for task in self._tasks.values() if not task.done.is_set()]

    def labels(self) -> dict[str, str]:
        """A copy: the KV panel renders from it while replies start and end."""
        with self._lock:
            return dict(self._labels)
