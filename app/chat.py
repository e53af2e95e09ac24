"""One chat turn: the reply streams from the backend into the store, measured as it comes.

Both backends (app/backend.py) answer with the same ReplyDelta increments, so nothing here asks
which one serves."""

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from app.backend import ReplyStream
from app.markdown_text import close_open_fence, dollar_math, inert

SAVE_EVERY_S = 0.5  # how often a streaming reply is written to the store


@dataclass
class Turn:
    """The reply so far and its measurements, as a chat renders them."""

    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    tokens_per_s: float | None = None
    error: str | None = None  # why the reply ended early, when it failed (a remote server gone, say)
    # A thinking model's reasoning, kept apart from the answer (and never sent back to the model)
    reasoning: str = ""
    reasoning_tokens: int = 0
    thought_s: float | None = None  # how long it reasoned, once the answer began (or the reply ended)
    model: str = ""  # the model that wrote it: stored with it, so an old chat still says which
    max_tokens: int | None = None  # the chat's "Max reply tokens" for it: a reply cut there says so
    tool_calls: list | None = None  # the tools it called, with how each went (app/tool_rounds.py)
    speculation: tuple | None = None  # speculative decoding: (steps that checked drafts, drafted, accepted)

    @property
    def thinking(self) -> bool:
        """Still reasoning: reasoning came, and neither the answer nor the end has yet."""
        return bool(self.reasoning) and self.thought_s is None

    def meta(self) -> dict:
        # Kept only when there is something to say
        keep = {
            "error",
            "reasoning",
            "reasoning_tokens",
            "thought_s",
            "model",
            "max_tokens",
            "tool_calls",
            "speculation",
        }
        return {k: v for k, v in self.__dict__.items() if k != "text" and (k not in keep or v)}

    def summary(self) -> str:
        return summary(self.meta())


def summary(meta: dict) -> str:
    """The line under a reply: the model that wrote it, first-token time, speed, what the prefix cache served,
    and why it ended when it did not finish by itself."""
    line = _measures(meta)
    model = meta.get("model") if meta else None
    return f"{model} · {line}" if model and line else line


def _measures(meta: dict) -> str:
    if meta and meta.get("error"):
        return f"stopped: {meta['error']}"
    if not meta or meta.get("ttft_s") is None:  # no token yet
        return "stopped before its first token" if meta and meta.get("finish_reason") == "abort" else ""
    rate = f" · {meta['tokens_per_s']:.1f} tok/s" if meta.get("tokens_per_s") else ""
    reasoning = f" ({meta['reasoning_tokens']:,} reasoning)" if meta.get("reasoning_tokens") else ""
    stopped = " · stopped" if meta.get("finish_reason") == "abort" else ""
    if meta.get("finish_reason") == "length":  # the reply limit, or else the model's context, ended it
        limit = meta.get("max_tokens")
        stopped = (
            f" · cut at Max reply tokens ({limit:,})"
            if limit and meta.get("output_tokens", 0) >= limit
            else " · cut: the context is full"
        )
    prompt = meta.get("prompt_tokens")
    spec = ""
    if meta.get("speculation"):  # tokens a checking step gave (its accepted drafts and one more), and the share kept
        steps, drafted, accepted = meta["speculation"]
        spec = (
            f" · spec {(accepted + steps) / steps:.1f} tok/step, {accepted / drafted:.0%} accepted" if drafted else ""
        )
    cache = (
        f" · {meta.get('cached_tokens', 0):,}/{count(prompt, 'prompt token')} from the prefix cache" if prompt else ""
    )  # a remote server that sends no usage leaves it unknown
    return (
        f"first token {meta['ttft_s'] * 1000:.0f} ms{rate} · {count(meta.get('output_tokens', 0), 'token')}"
        f"{reasoning}{spec}{cache}{stopped}"
    )


def count(n: int, thing: str) -> str:
    """How many of a thing, as people write it: "1 token", "6,150 tokens"."""
    return f"{n:,} {thing}{'' if n == 1 else 's'}"


def preview(text: str, length: int = 60) -> str:
    """The start of a text, on one line: a new chat's title, or the message an edit changes."""
    words = " ".join(text.split())
    return words[:length] + ("…" if len(words) > length else "")


def with_stats_line(text: str, stats: str) -> str:
    """A reply with its stats line under it. A reply stopped inside a code block gets the block closed first:
    otherwise the line rendered as code, inside the block."""
    if not stats:
        return text
    return f"{close_open_fence(text)}\n\n<sub>{stats}</sub>"


def as_shown(text: str, stats: str) -> str:
    """A message as the chat view shows it: its inline `$…$` math marked for the chatbot's LaTeX (it showed raw),
    and its stats line under it. The page acts on "#pagoda-" links (‹ ›, ✎ edit, remove): a message's own text, a
    reply or an imported one, may not carry one, so its are made inert."""
    return with_stats_line(dollar_math(inert(text)), stats)


def stream_reply(
    stream: ReplyStream,
    store,
    message_id: int,
    num_prompt_tokens: int,
    interrupted: Callable[[], bool] = lambda: False,
    model: str = "",
    max_tokens: int | None = None,
) -> Iterator[Turn]:
    """Consume one reply's stream into message `message_id`, yielding the turn after every increment.

    The store gets the text at least every SAVE_EVERY_S and at the end. If the consumer stops
    early, the request is aborted and what exists is kept. A remote server's last increment
    carries its own token counts, which replace the estimates. Once `interrupted()` (Pagoda is shutting
    down), the reply is stored as unfinished, never with the "abort" its cancelled stream ends with: the
    process may end between two saves, and its chat must then read "interrupted", not "stopped".
    `model` and `max_tokens` are kept with the reply for its stats line."""
    turn = Turn(prompt_tokens=num_prompt_tokens, model=model, max_tokens=max_tokens)
    start = last_save = time.perf_counter()
    first = None

    def save() -> None:
        meta = turn.meta()
        if interrupted():
            meta.update(finished=False, finish_reason=None)
        store.update_message(message_id, turn.text, meta)

    try:
        for delta in stream:
            now = time.perf_counter()
            if first is None and delta.num_tokens:
                first = now
                turn.ttft_s = now - start
            turn.text += delta.text
            turn.output_tokens += delta.num_tokens
            if delta.reasoning:
                turn.reasoning += delta.reasoning
                turn.reasoning_tokens += delta.num_tokens if not delta.text else 0
            if turn.reasoning and turn.thought_s is None and (delta.text or delta.finished):
                turn.thought_s = now - (first or now)
            turn.cached_tokens = delta.cached_tokens or turn.cached_tokens
            turn.speculation = delta.speculation or turn.speculation
            turn.prompt_tokens = delta.prompt_tokens or turn.prompt_tokens
            turn.output_tokens = delta.completion_tokens or turn.output_tokens
            if turn.output_tokens > 1 and now > first:
                turn.tokens_per_s = (turn.output_tokens - 1) / (now - first)
            if delta.finished:
                turn.finished, turn.finish_reason = True, delta.finish_reason
            if turn.finished or now - last_save >= SAVE_EVERY_S:
                save()
                last_save = now
            yield turn
    finally:
        if not turn.finished:
            stream.cancel()
            turn.finished, turn.finish_reason = True, "abort"
            save()


class ReplyTask:
    """A reply streaming into the store on its own thread.

    It outlives the page event that started it, so switching to another chat lets it finish in
    the background; `cancel()` (Stop, or the browser going away) aborts it in the engine."""

    def __init__(
        self,
        stream: ReplyStream,
        store,
        message_id: int,
        num_prompt_tokens: int,
        model: str = "",
        max_tokens: int | None = None,
        rounds=None,
    ):
        self.stream = stream
        self.message_id = message_id  # the message it writes now (a chat with tools: one per round)
        self.turn = Turn(prompt_tokens=num_prompt_tokens, model=model, max_tokens=max_tokens)
        # A chat with tools: what runs between the reply's rounds (app/tool_rounds.py's ToolRounds)
        self.rounds = rounds
        self.calling = False  # between two rounds: its tool calls wait for the user, or run
        self.version = 0  # goes up as it moves to another message or its calls change: pages redraw then
        self.done = threading.Event()
        self.last_followed = time.time()  # when a page last showed this reply (see PagodaUI.on_unload)
        # Stop, Edit or Regenerate took it back: what its chat shows next comes from them, so pages stop drawing
        # it (its last frame landed after an edit's and put the deleted rows back on screen)
        self.withdrawn = False
        self.interrupted = False  # Pagoda is shutting down under it (see interrupt)
        self._model, self._max_tokens = model, max_tokens
        self._thread = threading.Thread(target=self._run, args=(store,), name=f"reply-{message_id}", daemon=True)
        self._thread.start()

    def _run(self, store) -> None:
        try:
            while True:
                for turn in stream_reply(
                    self.stream,
                    store,
                    self.message_id,
                    self.turn.prompt_tokens,
                    lambda: self.interrupted,
                    self._model,
                    self._max_tokens,
                ):
                    self.turn = turn
                ended_by_itself = self.turn.finish_reason == "stop" and not self.interrupted
                if self.rounds is None or not ended_by_itself or not self.rounds.next_round(self):
                    break
        except Exception as e:  # the chat was deleted while it answered, or a remote server failed mid-reply
            self.stream.cancel()
            self.turn.error = str(e)
            try:  # keep the reason with the reply (the chat may be gone: then there is nothing to keep)
                store.update_message(self.message_id, self.turn.text, self.turn.meta())
            except Exception:
                pass
        finally:
            self.calling = False
            self.turn.finished = True
            self.done.set()

    def begin_round(self, stream: ReplyStream, message_id: int, num_prompt_tokens: int) -> None:
        """Its next round (after its tool calls) streams from `stream` into message `message_id`."""
        self.stream, self.message_id = stream, message_id
        self.turn = Turn(prompt_tokens=num_prompt_tokens, model=self._model, max_tokens=self._max_tokens)
        self.version += 1

    def cancel(self) -> None:
        """Stop: the reply ends where it is, and a tool call waiting for the user or running ends as stopped."""
        if self.rounds is not None:
            self.rounds.cancel()
        self.stream.cancel()

    def interrupt(self) -> None:
        """Pagoda is shutting down: the reply ends where it is and is kept as unfinished, so that its chat says
        "interrupted" (Pagoda stopped under it), not "stopped" as the Stop button leaves a reply."""
        self.interrupted = True
        self.cancel()
