"""Whether this thread is tracing a compiled decode step (engine/compiled_decode.py).

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
