"""Tracing a compiled decode step (engine/runner/compiled_decode.py) beside eager steps in other threads.

`tracing_decode_step` tells whether this thread traces; `MODULE_CALLS` keeps torch.fx's process-wide patches
away from the eager calls of other threads.

The layers take other branches inside such a trace: no host reads, no attribute writes, opaque ops
for what inductor cannot lower. torch.compiler.is_compiling() cannot tell them: it is one flag for the
whole process, so while the background thread traced, the engine's own eager steps in another
thread saw it too and took the trace's branches (a prefill through the decode-only attention).
"""

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_state = threading.local()


@torch.compiler.assume_constant_result
def tracing_decode_step() -> bool:
    """True in the thread that traces a decode step, while it does; the trace records it as a constant."""
    return getattr(_state, "tracing", False)


@contextmanager
def decode_step_trace() -> Iterator[None]:
    _state.tracing = True
    try:
        yield
    finally:
        _state.tracing = False


class ModuleCallGuard:
    """Eager model calls (any number at once) against torch.fx's windows of tracing (one at a time).

    While torch.fx traces it replaces `nn.Module.__call__` for the whole process, not for its thread: a model
    called eagerly in another thread meanwhile goes through the tracer, which raised "module is not installed
    as a submodule" in the engine's own step and killed it. Inductor's code generation opens such windows (one of
    1.6 ms in a cold compile of the bundled model's decode steps, which took 124 s), so the compiling thread
    waits, at each window, for the steps in flight to end, and steps wait for the window to close, rather than
    the steps waiting out the whole compile."""

    def __init__(self):
        self._changed = threading.Condition()
        self._callers: dict[int, int] = {}  # thread id -> nesting depth, of the eager calls in flight
        self._tracer: int | None = None  # the thread whose window is open
        self._tracer_depth = 0
        self.held_back = 0  # eager calls waiting for a window to close (what tests watch)

    @contextmanager
    def eager_call(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._changed:
            if self._tracer not in (None, me):
                self.held_back += 1
                self._changed.wait_for(lambda: self._tracer in (None, me))
                self.held_back -= 1
            self._callers[me] = self._callers.get(me, 0) + 1
        try:
            yield
        finally:
            with self._changed:
                self._callers[me] -= 1
                if not self._callers[me]:
                    del self._callers[me]
                self._changed.notify_all()

    def tracing_here(self) -> bool:
        """Whether this thread has a window open."""
        return self._tracer == threading.get_ident()

    @contextmanager
    def tracing_window(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._changed:  # a thread inside its own eager call may still trace: only the others count
            self._changed.wait_for(lambda: self._tracer in (None, me) and all(t == me for t in self._callers))
            self._tracer = me
            self._tracer_depth += 1
        try:
            yield
        finally:
            with self._changed:
                self._tracer_depth -= 1
                if not self._tracer_depth:
                    self._tracer = None
                self._changed.notify_all()


MODULE_CALLS = ModuleCallGuard()  # one for the process, as fx's patch is


def _calls_modules_as_they_are(tracer) -> bool:
    """make_fx's tracer (AOT autograd's, inductor's passes') runs each module it meets as it is and hands back
    attributes as they are, so an eager call that lands in its patch runs as usual; fx's symbolic tracer looks
    each module up in its own root, and raised for the engine's. Guarding make_fx's windows too held a step back
    for 15.6 s once in a cold compile on a loaded machine: the whole decode step is traced in one of them."""
    try:
        from torch.fx.experimental.proxy_tensor import PythonKeyTracer
    except ImportError:
        return False
    kind = type(tracer)
    return kind.call_module is PythonKeyTracer.call_module and kind.getattr is PythonKeyTracer.getattr


@contextmanager
def fx_windows_guarded() -> Iterator[None]:
    """While open (in the thread that compiles), each trace by a torch.fx tracer that could trip over a module
    called eagerly from another thread is a `MODULE_CALLS.tracing_window()`."""
    from torch.fx import Tracer

    original = Tracer.trace

    def trace(self, *args, **kwargs):
        if _calls_modules_as_they_are(self):
            return original(self, *args, **kwargs)
        with MODULE_CALLS.tracing_window():
            return original(self, *args, **kwargs)

    Tracer.trace = trace
    try:
        yield
    finally:
        Tracer.trace = original
