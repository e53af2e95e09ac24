"""A real Pagoda app process for end-to-end tests."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.processes import free_port


class PortTaken(RuntimeError):
    pass


class AppProcess:
    """`args`: more start-up options (`--listen`); `auth`: the login its API client uses (default: none, or the
    one the app prints when it generates one); `env`: variables set for the app (after the offline defaults)."""

    def __init__(
        self,
        model: Path,
        home: Path,
        *args: str,
        auth: tuple[str, str] | None = None,
        env: dict[str, str] | None = None,
    ):
        self.model, self.home, self.port = model, home, free_port()
        self.args, self.auth, self.env = args, auth, env or {}
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log = home / f"app-{self.port}.log"
        self.proc = None

    def printed_login(self) -> tuple[str, str] | None:
        found = re.search(r"login \(generated[^)]*\): (\S+) / (\S+)", self.log.read_text())
        return found.groups() if found else None

    def start(self):
        for _attempt in range(3):
            try:
                return self._start()
            except PortTaken:  # another process took the free port between free_port() and the bind
                continue
        return self._start()

    def _start(self):
        from gradio_client import Client

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        env = {**os.environ, "PAGODA_HOME": str(self.home), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "app",
                "--model",
                str(self.model),
                "--port",
                str(self.port),
                "--no-browser",
                "--max-chats",
                "4",
                *self.args,
            ],
            env=env,
            stdout=open(self.log, "w"),
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parents[2],
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                log = self.log.read_text()
                if "Cannot find empty port" in log:
                    raise PortTaken(log[-3000:])
                raise RuntimeError(f"the app exited: {log[-3000:]}")
            try:
                client = Client(self.url, verbose=False, auth=self.auth or self.printed_login())
                if client.predict(api_name="/model_status")["status"] == "ready":
                    return client
            except Exception:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the app did not become ready: {self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


def reply_text(job) -> str:
    """The reply text the page has shown so far for a /respond job ("" before its first token, while the page
    may show how much of a long prompt is read)."""
    outputs = job.outputs()
    if not outputs:
        return ""
    last = outputs[-1][0][-1] if outputs[-1][0] else {}
    if last.get("role") != "assistant":
        return ""
    content = last.get("content")
    parts = content if isinstance(content, list) else [{"text": content}]
    text = "".join(p.get("text") or "" for p in parts if isinstance(p, dict)).strip()
    return "" if text.startswith("*Reading the prompt:") else text
