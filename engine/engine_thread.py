"""A thread-safe front for online use: one background thread owns the engine and steps it.

Callers on any thread `submit()` a request and iterate its stream of increments. Abandoning the
iteration (closing the generator, a dropped browser connection) aborts the request in the
engine, which frees its KV blocks. All requests share one step loop, so concurrent callers are
batched together.
"""
import logging
import queue
import threading
from collections.abc import Iterator
from itertools import count

from engine.llm_engine import LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger("engine")
_DONE = object()


class EngineThread:
    def __init__(self, engine: LLMEngine, name: str = "pagoda-engine"):
        self.engine = engine
        self._lock = threading.Lock()  # held while the engine changes: a step, an add, an abort
        self._wake = threading.Event()
        self._streams: dict[str, queue.SimpleQueue] = {}
        self._ids = count()
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ---- caller side ----------------------------------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams | None = None) -> "RequestStream":
        """Queue a request. Invalid input raises here, in the caller's thread."""
        if self.error is not None or self._stop:
            raise RuntimeError(f"the engine thread has stopped ({self.error!r}); restart the model")
        request_id = f"chat-{next(self._ids)}"
        stream: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            self.engine.add_request(prompt, params, request_id)
            self._streams[request_id] = stream
        self._wake.set()
        return RequestStream(self, request_id, stream)

    def abort(self, request_id: str) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
            aborted = self.engine.abort_request(request_id)
        if stream is not None:
            if aborted:
                stream.put(RequestOutput(request_id, "", [], True, "abort"))
            stream.put(_DONE)

    def stats(self) -> dict:
        with self._lock:
            return self.engine.stats()

    def kv_blocks(self) -> list[dict]:
        with self._lock:
            return self.engine.kv_blocks()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    # ---- engine side ----------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop:
                with self._lock:
                    outputs = self.engine.step() if self.engine.has_unfinished_requests() else None
                    streams = [(out, self._streams.get(out.request_id)) for out in outputs or []]
                    for out in outputs or []:
                        if out.finished:
                            self._streams.pop(out.request_id, None)
                for out, stream in streams:
                    if stream is not None:
                        stream.put(out)
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


class RequestStream:
    """The increments of one request. Iterate it; stop early or call cancel() to abort."""

    def __init__(self, owner: EngineThread, request_id: str, stream: queue.SimpleQueue):
        self.owner, self.request_id, self._stream = owner, request_id, stream
        self.finished = False

    def __iter__(self) -> Iterator[RequestOutput]:
        try:
            while True:
                item = self._stream.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise RuntimeError(f"the engine failed: {item}") from item
                self.finished = item.finished
                yield item
        finally:
            if not self.finished:  # the caller went away before the end
                self.cancel()

    def cancel(self) -> None:
        self.owner.abort(self.request_id)
        self.finished = True
