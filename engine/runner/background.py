"""Background work that stops while the engine has requests: the CPU decode compile (compiled_decode.py).

A compiling thread beside the engine's steps holds the GIL for up to Python's switch interval (5 ms) each time the
engine's thread wants it back, and a step's Python between its kernels wants it back hundreds of times: on two
cores, with the compile at nice 19, a Llama-8B file's first prefill of 100 tokens took 6.6-8 s where it takes
about 3 s alone. A lower priority cannot fix a lock. So the compiling thread stops at its next Python call
whenever the engine has requests, and goes on when it has none (`EngineActivity.set_busy`).

It never stops holding what the engine's thread may need: inside an import (the module's import lock), inside
logging (a handler's lock) or inside a tracing window (runner/tracing.py's MODULE_CALLS, which eager steps wait
for). There it runs on to the next call outside them.

Watching every call costs the compile time: the bundled model's decode steps, from inductor's warm cache, compiled in
22 s of idle engine instead of 14.6 s (2 cores). The steps run eagerly until then, as they did beside the compile.
"""

import logging
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from engine.runner.tracing import MODULE_CALLS

log = logging.getLogger("engine")

# Code in these files may hold a lock the engine's thread takes too. importlib's own frames hold a module's import
# lock before (and after) the module's code runs: stopped in one, the compile held torch's lock while the engine's
# thread, importing llguidance.torch for a chat's first constrained reply, waited on it for ever.
_LOCKING_FILES = (logging.__file__, threading.__file__, "<frozen importlib._bootstrap>")


class BackgroundCancelled(Exception):
    """Raised in a background thread's work when its engine has closed (`EngineActivity.cancel`)."""


class EngineActivity:
    """Whether the engine has requests, for the background threads that wait on it (`run_when_idle`)."""

    def __init__(self) -> None:
        self._idle = threading.Event()
        self._idle.set()
        self.busy = False  # read on every Python call of a waiting thread: a plain attribute is the cheapest read
        self.pauses = 0  # times a background thread stopped for the engine (what tests watch)
        self.cancelled = False

    def set_busy(self, busy: bool) -> None:
        self.busy = busy
        if busy:
            self._idle.clear()
        else:
            self._idle.set()

    def cancel(self) -> None:
        """The engine is closing: the background work raises BackgroundCancelled at its next Python call outside
        what it must finish (an import, a lock), rather than finish for nothing. A compile that ran on after its
        engine closed held the whole model meanwhile, and kept some of it after: unloading and loading a model
        again grew the process by 150 MiB a time."""
        self.cancelled = True
        self.busy = True  # so that the watcher looks at its next call
        self._idle.set()  # and wakes if it waits

    @contextmanager
    def engine_waiting(self) -> Iterator[None]:
        """The engine's thread waits for the background work (e.g. an offline batch for its compiled steps):
        let it run meanwhile, whatever requests are queued."""
        busy = self.busy
        self.set_busy(False)
        try:
            yield
        finally:
            self.set_busy(busy)

    def run_when_idle(self, work: Callable[[], object]) -> object | None:
        """`work()` in this thread, stopping at Python calls while the engine is busy; None if it closed meanwhile."""

        base = sys._getframe()  # what called this holds nothing the engine needs (a thread's own frames below)

        def on_call(frame: FrameType, event: str, arg: object) -> None:
            if self.busy and event == "call":
                self._stop_unless_holding(frame, base)
            return None  # no line events: only calls are watched

        previous = sys.gettrace()
        sys.settrace(on_call)
        try:
            return work()
        except Exception:  # BackgroundCancelled, or what a compiler wrapped it in
            if self.cancelled:
                return None
            raise
        finally:
            sys.settrace(previous)

    def _stop_unless_holding(self, frame: FrameType, base: FrameType) -> None:
        if MODULE_CALLS.tracing_here():
            return
        caller: FrameType | None = frame
        while caller is not None and caller is not base:
            if caller.f_code.co_name == "<module>" or caller.f_code.co_filename in _LOCKING_FILES:
                return
            caller = caller.f_back
        if not self.cancelled:
            self.pauses += 1
            self._idle.wait()
        if self.cancelled:
            raise BackgroundCancelled("the engine closed")
