"""Background work (the CPU decode compile) stops while the engine has requests, and never while holding what the
engine's thread may need (engine/runner/background.py)."""

import importlib
import importlib.abc
import importlib.util
import logging
import sys
import threading
import time

from engine.runner.background import EngineActivity
from engine.runner.tracing import MODULE_CALLS

DEADLINE_S = 60.0


def _wait_for(condition) -> None:
    end = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > end:
            raise AssertionError("the background thread never got there")
        time.sleep(0.001)


def _step() -> None:
    pass


def test_background_work_stops_while_the_engine_is_busy_and_goes_on_when_idle():
    activity = EngineActivity()
    calls, stop = [0], threading.Event()

    def work():
        while not stop.is_set():
            _step()
            calls[0] += 1
        return "done"

    results = []
    thread = threading.Thread(target=lambda: results.append(activity.run_when_idle(work)))
    thread.start()
    _wait_for(lambda: calls[0] > 0)
    activity.set_busy(True)
    _wait_for(lambda: activity.pauses == 1)
    stopped_at = calls[0]
    for _ in range(100_000):  # the engine's own Python runs while the background thread waits
        _step()
    assert calls[0] == stopped_at and thread.is_alive()
    activity.set_busy(False)
    _wait_for(lambda: calls[0] > stopped_at)
    stop.set()
    thread.join(DEADLINE_S)
    assert results == ["done"] and sys.gettrace() is None


def _run_in_thread(activity: EngineActivity, work) -> list:
    """What `work` returned, in a list, once it has; empty if it is stuck."""
    results = []
    thread = threading.Thread(target=lambda: results.append(activity.run_when_idle(work)), daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    return results


def test_it_runs_on_inside_a_tracing_window_or_a_logging_handler_which_the_engine_waits_on():
    activity = EngineActivity()

    def traced():
        with MODULE_CALLS.tracing_window():
            activity.set_busy(True)  # a request arrives while the window is open
            for _ in range(10):
                _step()
        return "traced"

    assert _run_in_thread(activity, traced) == ["traced"]
    activity.set_busy(False)

    class Handler(logging.Handler):
        def emit(self, record):
            activity.set_busy(True)
            _step()  # a handler's lock is held here, which the engine's own logging takes

    logger = logging.getLogger("pagoda-test-background")
    logger.addHandler(Handler())
    try:
        assert _run_in_thread(activity, lambda: logger.error("x") or "logged") == ["logged"]
    finally:
        logger.handlers.clear()
    assert activity.pauses == 0
    activity.set_busy(False)


def test_it_runs_on_inside_an_import_whose_lock_the_engine_may_wait_on():
    """importlib holds a module's lock in its own frames, before the module's code runs: a compile stopped there
    while the engine's thread imported the same module (llguidance.torch, at a chat's first tool call) hung both."""
    activity = EngineActivity()
    name = "pagoda_background_probe"

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            activity.set_busy(True)  # a request arrives while importlib holds the module's lock
            return importlib.util.spec_from_loader(fullname, self)

        def create_module(self, spec):
            return None

        def exec_module(self, module):
            _step()
            module.value = 42
            activity.set_busy(False)

    finder = Finder()
    sys.meta_path.insert(0, finder)
    try:
        assert _run_in_thread(activity, lambda: importlib.import_module(name).value) == [42]
    finally:
        sys.meta_path.remove(finder)
        sys.modules.pop(name, None)
    assert activity.pauses == 0


def test_the_engine_waiting_for_the_work_lets_it_run():
    activity = EngineActivity()
    activity.set_busy(True)
    with activity.engine_waiting():
        assert _run_in_thread(activity, lambda: _step() or "ran") == ["ran"]
    assert activity.busy
