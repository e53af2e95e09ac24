"""Helpers for tests that drive real processes: a free port, polling, and `python -m engine.serve`."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.05) -> bool:
    """Poll `predicate` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


class ServeProcess:
    """`python -m engine.serve` on a model folder: the OpenAI-compatible server, as a user runs it."""

    def __init__(self, model: Path, log: Path, *args: str):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.base}/v1"
        self.log = log
        # /metrics wants the key when the server is exposed; sending it always is right either way
        key = args[args.index("--api-key") + 1] if "--api-key" in args else None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.serve", "--model", str(model), "--port", str(self.port), *args],
            env=env,
            cwd=REPO,
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 120.0) -> "ServeProcess":
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.log.read_text()[-3000:]}")
            try:
                return httpx.get(f"{self.base}/metrics", headers=self.headers, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        if not wait_until(ready, timeout, interval=0.25):
            raise RuntimeError(f"the server did not start: {self.log.read_text()[-3000:]}")
        return self

    def metric(self, name: str) -> float:
        """One of its /metrics values (vLLM's names)."""
        for line in httpx.get(f"{self.base}/metrics", headers=self.headers, timeout=10).text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
