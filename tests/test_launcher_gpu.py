"""The launcher's check for an NVIDIA GPU that the installed PyTorch cannot use: instead of running on the CPU
without a word, it says why and what to do. nvidia-smi is faked by a script on PATH."""

import os
import stat
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import launcher  # noqa: E402

SMI_HEADER = """+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 535.183.01             Driver Version: 535.183.01     CUDA Version: 12.2     |
|-----------------------------------------+------------------------+----------------------+
"""


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """A fake `nvidia-smi` first on PATH: `-L` lists one GPU, a plain call prints `header`."""

    def install(header: str = SMI_HEADER, lists_gpu: bool = True) -> None:
        script = tmp_path / "nvidia-smi"
        listing = 'echo "GPU 0: NVIDIA GeForce RTX 4060 Laptop GPU (UUID: GPU-1)"; exit 0' if lists_gpu else "exit 9"
        script.write_text(f'#!/bin/sh\nif [ "$1" = "-L" ]; then {listing}; fi\ncat <<"EOF"\n{header}EOF\n')
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")

    return install


pytestmark = pytest.mark.skipif(os.name == "nt", reason="the fake nvidia-smi is a shell script")


def test_driver_cuda_version_is_read_from_nvidia_smi_header(fake_smi):
    fake_smi()
    assert launcher.driver_cuda_version() == "12.2"


def test_no_gpu_or_a_usable_one_says_nothing():
    assert launcher.unusable_gpu_message(False, "2.13.0", "12.8", False, None) is None
    assert launcher.unusable_gpu_message(True, "2.13.0", "12.8", True, "12.8") is None


def test_driver_older_than_the_wheels_cuda_says_to_update_the_driver():
    message = launcher.unusable_gpu_message(True, "2.13.0", "12.8", False, "12.2")
    assert "CUDA 12.8" in message and "up to 12.2" in message
    assert "Update the NVIDIA driver" in message and "runs on the CPU" in message


def test_versions_compare_as_numbers_not_text():
    # "12.10" is newer than "12.8": a text comparison would call the driver too old.
    message = launcher.unusable_gpu_message(True, "2.13.0", "12.8", False, "12.10", "some other failure")
    assert "Update the NVIDIA driver" not in message
    assert "some other failure" in message and "nvidia-smi" in message


def test_cpu_only_build_says_to_reinstall_the_environment():
    message = launcher.unusable_gpu_message(True, "2.13.0+cpu", None, False, "12.8")
    assert "CPU-only build" in message and str(launcher.VENV) in message


def test_check_prints_the_reason_when_torch_cannot_use_the_gpu(fake_smi, monkeypatch, capsys):
    fake_smi()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    launcher.check_gpu_is_usable()
    err = capsys.readouterr().err
    assert "PyTorch cannot use it" in err and "up to 12.2" in err


def test_check_is_silent_without_a_gpu(fake_smi, capsys):
    fake_smi(lists_gpu=False)
    launcher.check_gpu_is_usable()
    assert capsys.readouterr().err == ""
