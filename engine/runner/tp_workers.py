"""Worker processes for tensor parallelism: ranks 1..N-1 of one engine.

Rank 0 is the engine's own process: it schedules, samples, and sends each step's inputs to every
worker over the worker's pipe. A worker runs the same forward pass on its shard of the weights
and KV cache, and meets rank 0 in the model's collectives (the all-reduces, the logits gather).

Lifecycle: `close()` (also run on garbage collection and at interpreter exit) tells the workers
to stop and reaps them. A worker also exits by itself when its pipe closes or its parent process
dies, so none outlives the engine. A worker that fails sends its traceback over the pipe, and
rank 0 raises it as one clear error instead of waiting in a collective.
"""

import multiprocessing as mp
import multiprocessing.util
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from multiprocessing.connection import wait
from pathlib import Path

import torch

from engine.runner.distributed import connect, new_store

_CLOSE = b"close"
_JOIN_SECONDS = 10.0
_SETTLE_SECONDS = 5.0  # after a failed collective: how long a dying worker gets to show it is dying
_START_HINT = (
    "Workers start with multiprocessing's spawn, which re-imports your main script: if the script "
    'creates the LLM at top level, put that code under `if __name__ == "__main__":`.'
)


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed or died; the message says which and how."""


class WorkerPool:
    """Rank 0's handle on the worker processes (ranks 1..N-1) of one tensor-parallel engine."""

    def __init__(self, config, hf_config, model_path: Path, device: torch.device, dtype: torch.dtype):
        size = config.tensor_parallel_size
        ctx = mp.get_context("spawn")  # fork would copy this process's threads and CUDA state
        self.store = new_store(size)  # on a free port the OS picks; the workers are told which
        self.processes: list = []
        self.conns: list = []
        self.error: str | None = None  # set once the group is unusable; every later step raises it
        watch_stop, self._watch_stop = ctx.Pipe(duplex=False)
        self._finalizer = multiprocessing.util.Finalize(
            self, _shutdown, args=(self.processes, self.conns, self._watch_stop, os.getpid()), exitpriority=10
        )
        try:
            for rank in range(1, size):
                ours, theirs = ctx.Pipe()
                process = ctx.Process(
                    target=worker_main,
                    name=f"pagoda-tp-rank{rank}",
                    daemon=True,
                    args=(
                        rank,
                        size,
                        self.store.port,
                        config,
                        hf_config,
                        str(model_path),
                        device.type,
                        dtype,
                        theirs,
                        torch.get_num_threads(),
                    ),
                )
                process.start()
                theirs.close()
                self.processes.append(process)
                self.conns.append(ours)
            for rank in range(1, size):
                self._receive(rank, starting=True)
            self.group = connect(0, size, self.store, device)
        except BaseException:
            self.close()
            raise
        if device.type == "cuda":
            threading.Thread(
                target=_abort_on_death,
                args=([p.sentinel for p in self.processes], watch_stop, self.group.backend),
                name="pagoda-tp-watch",
                daemon=True,
            ).start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def wait_ready(self) -> list[int]:
        """Each worker's parameter bytes, once it has built its shard of the model and KV cache."""
        with self.guard():
            return [self._receive(rank) for rank in range(1, len(self.processes) + 1)]

    def send_step(self, step) -> None:
        data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)  # once, not once per worker
        for conn in self.conns:
            conn.send_bytes(data)

    @contextmanager
    def guard(self):
        """Wraps rank 0's share of work the workers take part in. A worker's failure becomes one clear
        error; any failure closes the group, whose ranks can no longer agree on which step they are in."""
        if self.error is not None:
            raise RuntimeError(self.error)
        try:
            yield
        except BaseException as e:
            # A broken collective or pipe usually means a worker died: give it a moment to show that.
            settle = isinstance(e, (RuntimeError, OSError))
            reason = str(e) if isinstance(e, WorkerError) else self._failure(settle=settle)
            for process in self.processes:  # out of step with rank 0 now: they may wait in a collective forever
                process.kill()
            self.close()
            if reason is None:
                self.error = (
                    f"the tensor-parallel engine stopped after an error on rank 0 ({type(e).__name__}: {e}); "
                    "create a new LLM"
                )
                raise
            self.error = f"{reason}\nThe engine cannot continue; create a new LLM."
            raise WorkerError(self.error) from e

    def close(self) -> None:
        """Stop the workers and wait for them to exit. Safe to call more than once."""
        self.error = self.error or "the tensor-parallel workers were closed; create a new LLM"
        self._finalizer()

    # ---- internals ------------------------------------------------------------------------------
    def _receive(self, rank: int, starting: bool = False):
        """The next message from a worker; its error, or its death, raised as a WorkerError."""
        conn, process = self.conns[rank - 1], self.processes[rank - 1]
        wait([conn, process.sentinel])
        report = None
        try:
            if conn.poll():
                kind, payload = conn.recv()
                if kind != "error":
                    return payload
                report = payload
        except (EOFError, OSError):
            pass
        if report is not None:
            raise WorkerError(f"tensor-parallel worker rank {rank} failed:\n{report}")
        process.join(_SETTLE_SECONDS)
        hint = f" {_START_HINT}" if starting else ""
        raise WorkerError(
            f"tensor-parallel worker rank {rank} exited unexpectedly (exit code {process.exitcode}).{hint}"
        )

    def _failure(self, settle: bool) -> str | None:
        """What went wrong with a worker, if anything did: its own report, or how it ended."""
        if settle:
            wait([p.sentinel for p in self.processes] + self.conns, timeout=_SETTLE_SECONDS)
        for rank, (process, conn) in enumerate(zip(self.processes, self.conns), start=1):
            try:
                if conn.poll():
                    kind, payload = conn.recv()
                    if kind == "error":
                        return f"tensor-parallel worker rank {rank} failed:\n{payload}"
            except (EOFError, OSError):
                process.join(_SETTLE_SECONDS)  # its end of the pipe is closed: it is exiting
            if not process.is_alive():
                return f"tensor-parallel worker rank {rank} exited unexpectedly (exit code {process.exitcode})"
        return None


def _shutdown(processes: list, conns: list, watch_stop, owner_pid: int) -> None:
    """Ask every worker to stop; kill those that do not within a few seconds. Holds no reference to
    the pool, so it can run when the pool is garbage-collected, and at interpreter exit."""
    if os.getpid() != owner_pid:  # a forked copy of the engine's process does not own the workers
        return
    watch_stop.close()
    for conn in conns:
        try:
            conn.send_bytes(_CLOSE)
        except OSError:
            pass  # already gone
    deadline = time.monotonic() + _JOIN_SECONDS
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(5)
    for conn in conns:
        conn.close()


def _abort_on_death(sentinels: list, stop, backend) -> None:
    """NCCL waits forever on a dead peer: when a worker dies, abort the group so rank 0 errors out."""
    if stop not in wait(sentinels + [stop]) and hasattr(backend, "abort"):
        backend.abort()


# ---- the worker process ---------------------------------------------------------------------------
def worker_main(
    rank: int,
    size: int,
    port: int,
    config,
    hf_config,
    model_path: str,
    device_type: str,
    dtype: torch.dtype,
    conn,
    num_threads: int,
) -> None:
    """A worker's whole life: join the group, build this rank's shard, run steps until told to stop."""
    _exit_with_parent()
    # Ctrl-C in a terminal reaches the whole process group; rank 0 decides what it means, not the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(num_threads)
    try:
        from engine.runner.model_runner import ModelRunner

        device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        conn.send(("hello", None))
        group = connect(rank, size, new_store(size, port), device)
        runner = ModelRunner(config, hf_config, Path(model_path), device, dtype, tp=group)
        conn.send(("ready", runner.parameter_bytes()))
        with torch.inference_mode():
            while (data := conn.recv_bytes()) != _CLOSE:
                runner.execute(pickle.loads(data))
        code = 0
    except EOFError:
        code = 0  # the engine's end of the pipe closed: it is gone
    except BaseException:
        code = 1
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    # Skip the interpreter's teardown of torch (about a second): there is nothing left to save.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_with_parent() -> None:
    """Exit as soon as the engine's process dies, even in the middle of a collective."""
    parent = mp.parent_process()

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="pagoda-tp-parent-watch", daemon=True).start()
