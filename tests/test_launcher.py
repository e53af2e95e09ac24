"""`python launcher.py` as a new user types it: with a Python that has nothing installed but the standard library.

The launcher checks its options (and answers --help) before it installs anything, so that part must import no
third-party package; a regression once made `python launcher.py` fail with "No module named 'torch'" on every
fresh machine while `--test` kept CI green."""

import os
import signal
import subprocess
import sys
import venv
from pathlib import Path

import httpx
import pytest

from tests.processes import REPO, free_port, wait_until

sys.path.insert(0, str(REPO))
import launcher  # noqa: E402


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    """A venv with no packages at all (not even pip): what a fresh machine's Python can import."""
    folder = tmp_path_factory.mktemp("bare-venv")
    venv.EnvBuilder(with_pip=False).create(folder)
    python = folder / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    probe = subprocess.run([python, "-c", "import torch"], capture_output=True)
    assert probe.returncode != 0, "the bare venv sees torch: it is not bare"
    return python


def test_help_answers_from_a_bare_python_before_installing(bare_python, tmp_path):
    out = subprocess.run(
        [bare_python, str(REPO / "launcher.py"), "--help"], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "usage: pagoda" in out.stdout and "--share" in out.stdout and "--max-chats" in out.stdout
    assert "setting up" not in out.stdout  # answered before any install


def test_a_bad_option_is_refused_from_a_bare_python(bare_python, tmp_path):
    out = subprocess.run(
        [bare_python, str(REPO / "launcher.py"), "--port", "seven"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert out.returncode == 2 and "invalid int value: 'seven'" in out.stderr


@pytest.mark.timeout(240)
def test_the_app_starts_from_a_bare_python(bare_python, tmp_path):
    """The README's run command, from a Python without torch: the launcher finds .venv installed and starts the app
    in it, which then serves its page."""
    if not launcher.install_stamp(launcher.has_nvidia_gpu()).exists():
        pytest.skip("this checkout's .venv was not installed by launcher.py (run the tests with `launcher.py --test`)")
    port = free_port()
    env = {**os.environ, "PAGODA_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "PAGODA_CPU_COMPILE": "0"}
    for name in ("VIRTUAL_ENV", "PYTHONPATH"):  # what a user's plain shell has
        env.pop(name, None)
    log = tmp_path / "app.log"
    proc = subprocess.Popen(
        [bare_python, str(REPO / "launcher.py"), "--no-browser", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    def serving() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the launcher exited ({proc.returncode}): {log.read_text()[-3000:]}")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        assert wait_until(serving, timeout=200, interval=0.5), log.read_text()[-3000:]
        assert "setting up" not in log.read_text()  # the tests' install serves the app as it is
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
