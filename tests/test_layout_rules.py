"""The layout rules CI enforces. Imports (pyproject.toml, ruff's banned-api): engine/ is a library that imports no web
framework, no UI and nothing of app/, however the import is written; the rest of the tree may.
Size: no source file over 500 lines."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = [sys.executable, "-m", "ruff"]
FORBIDDEN = [
    "import fastapi",
    "from starlette.responses import JSONResponse",
    "import uvicorn",
    "import gradio as gr",
    "from app.store import ChatStore",
    "from app import ui",
]


def ruff(source: str, filename: str) -> subprocess.CompletedProcess:
    """ruff check on `source` as if it were the file `filename` of this project, with the project's settings."""
    return subprocess.run(
        [*RUFF, "check", "--no-cache", "--select", "TID251", "--stdin-filename", str(ROOT / filename), "-"],
        input=source,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


@pytest.mark.parametrize("line", FORBIDDEN)
def test_engine_may_not_import_web_frameworks_ui_or_app(line):
    inside_a_function = f"def later():\n    {line}\n    return None\n"  # a lazy import counts as well
    for source in (line + "\n", inside_a_function):
        result = ruff(source, "engine/runner/probe.py")
        assert result.returncode == 1 and "TID251" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("filename", ["app/probe.py", "entrypoints/openai/probe.py", "tests/probe.py"])
def test_the_rest_of_the_tree_may(filename):
    result = ruff("import fastapi\nimport gradio as gr\n\nfrom app import ui\n", filename)
    assert result.returncode == 0, result.stdout + result.stderr


def test_engine_as_it_is_passes():
    result = subprocess.run(
        [*RUFF, "check", "--no-cache", "--select", "TID251", "engine"], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr


MAX_SOURCE_LINES = 500  # past this a file has usually grown a second job: split it where that job starts


def test_no_source_file_grows_past_the_line_limit():
    too_long = {
        str(path.relative_to(ROOT)): lines
        for folder in ("engine", "entrypoints", "app")
        for path in (ROOT / folder).rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_SOURCE_LINES
    }
    assert not too_long, f"over {MAX_SOURCE_LINES} lines (split each where its second job starts): {too_long}"


def test_each_engine_package_imports_on_its_own():
    """A fresh interpreter imports each package first: an import cycle (models -> loader -> models) fails here, not
    in whichever entry point happens to import them in the one order that breaks."""
    import subprocess
    import sys

    for package in ("engine.models", "engine.loader", "engine.layers", "engine.runner", "engine.front", "app.catalog"):
        done = subprocess.run([sys.executable, "-c", f"import {package}"], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, f"import {package}: {done.stderr[-1500:]}"
