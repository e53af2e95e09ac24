"""One chat turn: the stored conversation goes to the backend, the reply streams back into the store.

The embedded engine gets token ids (through the model's chat template, here); a remote server gets
the messages and applies its own template. Both answer with the same kind of increments."""
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from engine import SamplingParams

DEFAULT_SETTINGS = {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                    "max_tokens": 512, "seed": None}
SAVE_EVERY_S = 0.5  # how often a streaming reply is written to the store


class ContextOverflow(Exception):
    """The conversation plus the reply would not fit the model's context."""

    def __init__(self, needed: int, limit: int):
        self.needed, self.limit = needed, limit
        super().__init__(f"This chat needs {needed:,} tokens (history plus room for the reply) but the model's context "
                         f"holds {limit:,}. Drop the oldest messages, lower the reply length, or start a new chat.")


def sampling_params(settings: dict) -> SamplingParams:
    s = {**DEFAULT_SETTINGS, **(settings or {})}
    seed = s["seed"]
    return SamplingParams(temperature=float(s["temperature"]), top_p=float(s["top_p"]), top_k=int(s["top_k"]),
                          min_p=float(s["min_p"]), repetition_penalty=float(s["repetition_penalty"]),
                          max_tokens=int(s["max_tokens"]), seed=None if seed in (None, "", -1) else int(seed))


def prompt_ids(tokenizer, system_prompt: str, messages: list[dict]) -> list[int]:
    """Token ids of the chat, through the model's own chat template.

    A system prompt that is byte-identical across chats gives identical leading ids: that is
    what lets chats share its KV blocks."""
    system_prompt = system_prompt or ""
    chat = ([{"role": "system", "content": system_prompt}] if system_prompt.strip() else []) + messages
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def check_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    # The reply needs at least one token of room; ask for a little more so answers aren't cut at once.
    needed = num_prompt_tokens + min(max_tokens, 64)
    if needed > max_model_len:
        raise ContextOverflow(needed, max_model_len)


def start_reply(host, system_prompt: str, messages: list[dict], settings: dict):
    """Start the assistant's reply on the host's backend: (stream, prompt tokens, 0 when only the server knows).

    Raises ContextOverflow (local: checked up front) or app.remote.RemoteError (the server refused;
    `context_overflow` says whether the chat was too long for it) before anything streams."""
    remote, engine = host.remote, host.engine
    if remote is not None:
        chat = ([{"role": "system", "content": system_prompt}] if (system_prompt or "").strip() else []) + messages
        return remote.submit(chat, {**DEFAULT_SETTINGS, **settings}), 0
    if engine is None:
        raise RuntimeError("No model is loaded.")
    ids = prompt_ids(engine.engine.tokenizer, system_prompt, messages)
    params = sampling_params(settings)
    check_fits(len(ids), params.max_tokens, engine.engine.max_model_len)
    return engine.submit(ids, params), len(ids)


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

    def meta(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "text" and (k != "error" or v)}

    def summary(self) -> str:
        return summary(self.meta())


def summary(meta: dict) -> str:
    """The line under a reply: first-token time, speed, and what the prefix cache served."""
    if meta and meta.get("error"):
        return f"stopped: {meta['error']}"
    if not meta or meta.get("ttft_s") is None:
        return ""
    rate = f" · {meta['tokens_per_s']:.1f} tok/s" if meta.get("tokens_per_s") else ""
    stopped = " · stopped" if meta.get("finish_reason") == "abort" else ""
    cache = (f" · {meta.get('cached_tokens', 0)}/{meta['prompt_tokens']} prompt tokens from the prefix cache"
             if meta.get("prompt_tokens") else "")  # a remote server that sends no usage leaves it unknown
    return f"first token {meta['ttft_s'] * 1000:.0f} ms{rate} · {meta.get('output_tokens', 0)} tokens{cache}{stopped}"


def stream_reply(stream, store, message_id: int, num_prompt_tokens: int) -> Iterator[Turn]:
    """Consume one request's stream into message `message_id`, yielding the turn after every increment.

    The store gets the text at least every SAVE_EVERY_S and at the end. If the consumer stops
    early, the request is aborted and what exists is kept. `stream` is the engine's RequestStream
    or a remote ChatStream (whose last increment carries the server's token counts as `usage`)."""
    turn = Turn(prompt_tokens=num_prompt_tokens)
    start = last_save = time.perf_counter()
    first = None
    try:
        for out in stream:
            now = time.perf_counter()
            if first is None and out.new_token_ids:
                first = now
                turn.ttft_s = now - start
            turn.text += out.new_text
            turn.output_tokens += len(out.new_token_ids)
            turn.cached_tokens = out.num_cached_tokens or turn.cached_tokens
            usage = getattr(out, "usage", None)  # a remote server's own counts, in its last increment
            if usage:
                turn.prompt_tokens = usage.get("prompt_tokens", turn.prompt_tokens)
                turn.output_tokens = usage.get("completion_tokens", turn.output_tokens)
            if turn.output_tokens > 1 and now > first:
                turn.tokens_per_s = (turn.output_tokens - 1) / (now - first)
            if out.finished:
                turn.finished, turn.finish_reason = True, out.finish_reason
            if turn.finished or now - last_save >= SAVE_EVERY_S:
                store.update_message(message_id, turn.text, turn.meta())
                last_save = now
            yield turn
    finally:
        if not turn.finished:
            stream.cancel()
            turn.finished, turn.finish_reason = True, "abort"
            store.update_message(message_id, turn.text, turn.meta())


class ReplyTask:
    """A reply streaming into the store on its own thread.

    It outlives the page event that started it, so switching to another chat lets it finish in
    the background; `cancel()` (Stop, or the browser going away) aborts it in the engine."""

    def __init__(self, stream, store, message_id: int, num_prompt_tokens: int):
        self.stream = stream
        self.turn = Turn(prompt_tokens=num_prompt_tokens)
        self.done = threading.Event()
        self.last_followed = time.time()  # when a page last showed this reply (see PagodaUI.on_unload)
        self._thread = threading.Thread(target=self._run, args=(store, message_id, num_prompt_tokens),
                                        name=f"reply-{message_id}", daemon=True)
        self._thread.start()

    def _run(self, store, message_id: int, num_prompt_tokens: int) -> None:
        try:
            for turn in stream_reply(self.stream, store, message_id, num_prompt_tokens):
                self.turn = turn
        except Exception as e:  # the chat was deleted while it answered, or a remote server failed mid-reply
            self.stream.cancel()
            self.turn.error = str(e)
            try:  # keep the reason with the reply (the chat may be gone: then there is nothing to keep)
                store.update_message(message_id, self.turn.text, self.turn.meta())
            except Exception:
                pass
        finally:
            self.turn.finished = True
            self.done.set()

    def cancel(self) -> None:
        self.stream.cancel()
