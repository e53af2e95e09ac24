"""Hub failures become sentences a user can act on: through a download job against the fake hub (unreachable,
missing repo, gated repo) and from explain_error directly. The `hub` and `manager` fixtures are in hub_fixtures.py."""

import socket
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from hub_fixtures import REPO  # noqa: E402

from app.download_jobs import DownloadManager  # noqa: E402
from app.hub_errors import DownloadError, explain_error  # noqa: E402


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_hub_gives_the_offline_message(hub, tmp_path):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    manager = DownloadManager(tmp_path / "hub", endpoint=endpoint, token=False)
    started = time.monotonic()
    job = manager.wait(manager.start(REPO), timeout=30)
    assert job.status == "error"
    assert job.error.startswith("Could not reach the Hugging Face hub")
    assert endpoint in job.error and "connection refused" in job.error
    assert "bundled model works offline" in job.error
    assert time.monotonic() - started < 10
    with pytest.raises(DownloadError, match="Could not reach the Hugging Face hub"):
        manager.repo_files_size(REPO)


def test_missing_repo_is_named(manager):
    job = manager.wait(manager.start("pagoda-test/no-such-model"), timeout=20)
    assert job.status == "error"
    assert "pagoda-test/no-such-model was not found" in job.error
    with pytest.raises(DownloadError, match="not found"):
        manager.repo_files_size("pagoda-test/no-such-model")


def test_gated_repo_says_accept_license_and_log_in(manager, hub):
    hub.add_repo("pagoda-test/gated", {"config.json": b"{}", "model.safetensors": b"x" * 100}, gated=True)
    job = manager.wait(manager.start("pagoda-test/gated"), timeout=30)
    assert job.status == "error"
    assert "gated" in job.error and "accept its license" in job.error and "huggingface-cli login" in job.error
    assert manager.local_models(include_partial=False) == []


def test_explain_error_for_offline_mode(monkeypatch):
    from huggingface_hub import constants
    from huggingface_hub.errors import OfflineModeIsEnabled

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    message = explain_error(OfflineModeIsEnabled("offline"), REPO)
    assert "HF_HUB_OFFLINE" in message and "bundled model works offline" in message
