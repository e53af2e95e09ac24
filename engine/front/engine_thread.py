"""A thread-safe front for online use: one background thread owns the engine and steps it.

Callers on any thread `submit()` a request and iterate its stream of increments (or `async for`
it on an event loop, which then never blocks on the engine). Abandoning the iteration (closing
the generator, a dropped browser connection) aborts the request in the engine, which frees its
KV blocks. All requests share one step loop, so concurrent callers are batched together.

On a CPU, build the engine with `EngineThread.load` (or in another thread that then ends), not
in a thread that lives on beside the engine's, such as a server's main thread. OpenMP (GNU
libgomp, which PyTorch ships) keeps a pool of workers for every thread that has run parallel work;
once the pools hold more threads than there are cores, the workers sleep between parallel regions
instead of spinning, and each of a decode step's hundreds of small ones waits for them to wake.
Measured on 2 cores, bundled SmolLM2: 29 tok/s with the engine built in the main thread, 57 with
it built in a thread that ended (bench/RESULTS.md).
"""

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from itertools import count
from typing import TypeVar

from engine.front.llm_engine import LLMEngine, StepFailed
from engine.front.outputs import EngineStats, KVBlock, RequestOutput
from engine.front.sampling_params import SamplingParams

log = logging.getLogger("engine")
_DONE = object()
T = TypeVar("T")


class EngineFailed(RuntimeError):
    """The engine thread stopped on an error that leaves the device or the model in doubt (a CUDA error, say): the
    streams that were open ended with it, and the engine takes no more requests. Load the model again to go on.
    Any other error in a step fails only that step's requests (RequestFailed)."""


class RequestFailed(RuntimeError):
    """This request's step raised in the engine, which aborted the request and serves on: send it again."""


class ConstraintFailed(RequestFailed):
    """The request's structured-output constraint could not be followed mid-reply (llguidance's parser limits, or
    no way on): the request's own doing, so sending it again gives the same; change the constraint."""


def in_a_passing_thread(work: Callable[[], T], name: str = "pagoda-passing") -> T:
    """`work()` run in a thread that ends with it, its result or exception handed back: on a CPU, a thread that
    lives on after running parallel work keeps an OpenMP pool, which slows the engine thread's steps (the module's
    note). For loading a model, or for an embedding model's calls beside the chat engine."""
    done: dict = {}

    def run() -> None:
        try:
            done["value"] = work()
        except BaseException as e:  # handed to the caller's thread, raised there
            done["error"] = e

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if "error" in done:
        raise done["error"]
    return done["value"]


class EngineThread:
    """Everything a server or the app needs of a loaded model; callers never reach into `engine`
    (which tests and benchmarks may read), since only this thread may touch it between steps."""

    def __init__(self, engine: LLMEngine, name: str = "pagoda-engine"):
        self.engine = engine
        self._lock = FairLock()  # held while the engine changes: a step, an add, an abort
        self._wake = threading.Event()
        self._streams: dict[str, _Channel] = {}
        self._ids = count()
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @classmethod
    def load(cls, model: str, name: str = "pagoda-engine", **settings) -> "EngineThread":
        """`EngineThread(LLM(model, **settings))`, with the LLM built in a thread that ends once it is
        (see the module's note on OpenMP's pools). Load errors are raised here, as LLM raises them."""
        from engine.front.llm_engine import LLM

        return cls(in_a_passing_thread(lambda: LLM(model, **settings), f"{name}-load"), name)

    # ---- caller side ----------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        """The longest prompt plus reply a request may have."""
        return self.engine.max_model_len

    @property
    def device(self) -> str:
        """Where the model runs: "cpu", "cuda:0", ..."""
        return str(self.engine.device)

    def encode_chat(self, messages: list[dict], **template_kwargs) -> list[int]:
        """A conversation as prompt token ids, through the model's chat template (LLMEngine.encode_chat).
        Tokenizing needs no lock: it runs in the caller's thread while the engine steps."""
        return self.engine.encode_chat(messages, **template_kwargs)

    def tokenize(self, text: str) -> list[int]:
        """A plain prompt's token ids, as the engine would encode it (special tokens included)."""
        return self.engine.tokenizer.encode(text)

    @property
    def tokenizer(self):
        """The model's tokenizer, for decoding in the caller's thread (as `tokenize` encodes there)."""
        return self.engine.tokenizer

    def submit(
        self, prompt: str | list[int], params: SamplingParams | None = None, priority: int = 0
    ) -> "RequestStream":
        """Queue a request. Invalid input raises here, in the caller's thread. `priority`: lower is more
        urgent (LLMEngine.add_request)."""
        request_id = f"chat-{next(self._ids)}"
        stream = _Channel()
        # Compiled before the lock, which every stream's step waits on: a large schema takes seconds
        grammar = self.engine.compile_constraint(params) if params is not None else None
        with self._lock:  # checked under the lock: a request is either refused or seen by shutdown()
            if self.error is not None:
                raise EngineFailed(
                    f"the engine failed ({type(self.error).__name__}: {self.error}) and takes no "
                    "more requests; load the model again"
                )
            if self._stop:
                raise RuntimeError("the engine thread has stopped; load the model again")
            self.engine.add_request(prompt, params, request_id, priority, grammar)
            self._streams[request_id] = stream
        self._wake.set()
        return RequestStream(self, request_id, stream)

    def abort(self, request_id: str, error: RequestFailed | None = None) -> None:
        """Stop a request. Its stream ends with finish_reason "abort", or raises `error` to its reader (who
        then knows why, where an abort reads as a reply cut short on purpose)."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
            aborted = self.engine.abort_request(request_id)
        if stream is not None:
            if error is not None:
                stream.put(error)
            elif aborted:
                stream.put(RequestOutput(request_id, "", [], True, "abort"))
            stream.put(_DONE)

    def abort_all(self, error: RequestFailed | None = None) -> None:
        """Abort every request in flight (their streams end as `abort` says)."""
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self.abort(request_id, error)

    def prefill_progress(self, request_id: str) -> tuple[int, int] | None:
        """LLMEngine.prefill_progress, read without the lock: a page polls it several times a second, and
        the lock would make it wait out the very prefill step it reports on. It reads two counters the
        engine thread writes; a value one step old is all a progress line needs."""
        return self.engine.prefill_progress(request_id)

    def stats(self) -> EngineStats:
        with self._lock:
            return self.engine.stats()

    def kv_blocks(self) -> list[KVBlock]:
        with self._lock:
            return self.engine.kv_blocks()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the step loop, end the streams still open as aborted, and close the engine (its memory
        and worker processes go)."""
        with self._lock:
            self._stop = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the engine thread did not stop within %.0f s; its engine stays open", timeout)
        else:
            self.abort_all()
            self.engine.close()

    # ---- engine side ----------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop:
                with self._lock:
                    try:
                        outputs = self.engine.step() if self.engine.has_unfinished_requests() else None
                    except StepFailed as failure:  # its requests are aborted; the others go on
                        error = RequestFailed(
                            f"the engine failed this request ({failure}) and goes on serving the others; send it again"
                        )
                        for request_id in failure.request_ids:
                            if (stream := self._streams.pop(request_id, None)) is not None:
                                stream.put(error)
                                stream.put(_DONE)
                        outputs = []
                    streams = [(out, self._streams.get(out.request_id)) for out in outputs or []]
                    for out in outputs or []:
                        if out.finished:
                            self._streams.pop(out.request_id, None)
                for out, stream in streams:
                    if stream is not None:
                        # A reply that broke off (its constraint failed) ends as an error the caller sees
                        stream.put(out if out.finish_reason != "error" else ConstraintFailed(out.error or "it failed"))
                        if out.finished:
                            stream.put(_DONE)
                if outputs is None:
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as e:  # a crashed step must not leave callers waiting forever
            log.exception("engine thread stopped")
            self.error = e
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
            for stream in streams:
                stream.put(e)
                stream.put(_DONE)


class FairLock:
    """A lock granted in the order it was asked for.

    The step loop releases its lock and takes it again at once. With threading.Lock the thread
    that has just released it nearly always wins that race, so a caller's submit() or stats()
    waited for a lucky gap between steps: a quarter of a second on average and a second at worst
    with two chats streaming on 2 CPU cores, and once more than 20 s on a loaded CI machine. Here
    each acquire takes a ticket, and the lock passes to the oldest ticket."""

    def __init__(self):
        self._turns = threading.Condition(threading.Lock())  # its own lock is held for microseconds only
        self._next_ticket = 0
        self._serving = 0

    def __enter__(self) -> None:
        with self._turns:
            ticket = self._next_ticket
            self._next_ticket += 1
            while ticket != self._serving:
                self._turns.wait()

    def __exit__(self, *exc) -> None:
        with self._turns:
            self._serving += 1
            self._turns.notify_all()


class _Channel:
    """A queue the engine thread fills and one caller drains, from a thread or from an event loop."""

    def __init__(self):
        self._items: deque = deque()
        self._ready = threading.Condition()
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    def put(self, item) -> None:
        with self._ready:
            self._items.append(item)
            self._ready.notify()
            waiter = self._waiter
        if waiter is not None:
            loop, event = waiter
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the caller's event loop has closed: nobody is waiting any more
                pass

    def get(self):
        with self._ready:
            while not self._items:
                self._ready.wait()
            return self._items.popleft()

    async def get_async(self):
        while True:
            with self._ready:
                if self._items:
                    return self._items.popleft()
                event = asyncio.Event()
                self._waiter = (asyncio.get_running_loop(), event)
            await event.wait()


class RequestStream:
    """The increments of one request. Iterate it; stop early or call cancel() to abort."""

    def __init__(self, owner: EngineThread, request_id: str, stream: _Channel):
        self.owner, self.request_id, self._stream = owner, request_id, stream
        self.finished = False

    def _unwrap(self, item) -> RequestOutput | None:
        if item is _DONE:
            return None
        if isinstance(item, RequestFailed):
            self.finished = True
            raise item
        if isinstance(item, BaseException):
            raise EngineFailed(f"the engine failed ({type(item).__name__}: {item}); load the model again") from item
        self.finished = item.finished
        return item

    def __iter__(self) -> Iterator[RequestOutput]:
        try:
            while (output := self._unwrap(self._stream.get())) is not None:
                yield output
        finally:
            if not self.finished:  # the caller went away before the end
                self.cancel()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while (output := self._unwrap(await self._stream.get_async())) is not None:
                yield output
        finally:
            if not self.finished:  # e.g. an HTTP client disconnected mid-stream
                self.cancel()

    def prefill_progress(self) -> tuple[int, int] | None:
        """(prompt tokens read, prompt tokens) until the first token comes (EngineThread.prefill_progress)."""
        return None if self.finished else self.owner.prefill_progress(self.request_id)

    def cancel(self) -> None:
        self.owner.abort(self.request_id)
        self.finished = True
