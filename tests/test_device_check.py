"""The device check's two halves, run here on the CPU as the device will run them: without the app's
dependencies (gradio, platformdirs) and without network. A GPU run is rare and short; a mistake
the CPU can find must not spend it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Makes `import gradio` (and the others) fail as on a machine that has only the engine's packages.
WITHOUT_APP = """
import importlib.abc, runpy, sys
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"gradio", "gradio_client", "platformdirs", "app", "llguidance"}:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)")
sys.meta_path.insert(0, NotInstalled())
"""


def run_without_app(code: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "PATH": "/usr/bin:/bin",
        "TRANSFORMERS_VERBOSITY": "error",
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_APP + code, *args],
        cwd=ROOT,
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
    )


def test_the_blocker_hides_the_app():
    result = run_without_app("import gradio")
    assert result.returncode != 0 and "hidden by the test" in result.stderr


def test_gpu_bench_smoke_runs_every_section(tmp_path):
    result = run_without_app(
        "runpy.run_module('bench.gpu_bench', run_name='__main__')", "--smoke", "--json", str(tmp_path / "bench.json")
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = result.stdout[result.stdout.index("| benchmark | value | note |") :]
    assert "FAILED" not in table
    for name in (
        "batch-1 decode, CUDA graphs",
        "batch-1 decode, its steps",
        "batch-1 decode, synchronous scheduling",
        "batch-1 decode step, whole",
        "TTFT with 1,900 tokens cached",
        "throughput, synchronous scheduling",
        "batch-1 decode, eager",
        "transformers batch-1 decode",
    ):
        assert f"| {name} |" in table, name
    for written in ("bench.json", "profile.txt", "profile_prefill.txt", "profile_decode_full.txt"):
        assert (tmp_path / written).is_file(), written


def test_gpu_hybrid_smoke_runs_the_kernels_and_the_engine():
    result = run_without_app("runpy.run_module('bench.gpu_hybrid', run_name='__main__')", "--smoke")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = result.stdout[result.stdout.index("| benchmark | value | note |") :]
    assert "FAILED" not in table
    for name in ("delta rule, prefill of 2 x 1,000 tokens", "delta rule, decode of 16", "batch-16 decode"):
        assert name in table, name


def test_gpu_quantized_smoke_runs(tmp_path):
    result = run_without_app("runpy.run_module('bench.gpu_quantized', run_name='__main__')", "--smoke")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| smoke: int4 on the CPU | Int4PackMatmul" in result.stdout or "DequantMatmul" in result.stdout


def test_gpu_laptop_smoke_runs_with_the_catalog_but_no_gradio():
    # The laptop check asks the app's catalog (plain Python) what fits, as the Models tab does; the device has no
    # gradio or platformdirs, so only those are hidden here.
    code = WITHOUT_APP.replace('"app", ', "") + "runpy.run_module('bench.gpu_laptop', run_name='__main__')"
    env = {
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "PATH": "/usr/bin:/bin",
        "TRANSFORMERS_VERBOSITY": "error",
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        [sys.executable, "-c", code, "--smoke", "--models", "Qwen/Qwen3-1.7B"],
        cwd=ROOT,
        env=env,
        text=True,
        capture_output=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = result.stdout[result.stdout.index("| laptop GPU check") :]
    for name in ("the catalog's advice", "KV cache", "2 chats at once", "batch-1 decode"):
        assert f"| Qwen3 1.7B: {name} |" in table, name


def test_the_kv_cache_bench_runs_without_the_app():
    """The device check's KV part (bench/kv_cache_dtype.py --random-qwen3) imports nothing of the app's; its options
    parse (a full run builds a 0.6B model: too long for here)."""
    result = run_without_app("runpy.run_module('bench.kv_cache_dtype', run_name='__main__')", "--help")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "--random-qwen3" in result.stdout


def test_the_laptop_check_loads_with_the_apps_default_chats():
    from app.server import parse_args
    from bench.gpu_laptop import APP_MAX_CHATS

    assert parse_args([]).max_chats == APP_MAX_CHATS


def test_gpu_tests_collect_without_the_app():
    result = run_without_app("import pytest; sys.exit(pytest.main(['tests/gpu', '-q', '-p', 'no:cacheprovider']))")
    # On the CPU every GPU test skips; what is checked is that the module and its fixtures import.
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "skipped" in result.stdout and "error" not in result.stdout.lower()


def test_device_check_script_runs_its_test_half_and_reports(tmp_path):
    """The shell script itself (here its GPU tests all skip, and the benchmarks are skipped as on a rerun)."""
    import os

    env = {
        **os.environ,
        "SKIP_HYBRID": "1",
        "SKIP_BENCH": "1",
        "SKIP_QUANT": "1",
        "SKIP_KV": "1",
        "SKIP_LAPTOP": "1",
        "SKIP_STRUCTURED": "1",
        "SKIP_SPEC": "1",
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
    }
    result = subprocess.run(
        ["bash", "bench/device_check.sh", str(tmp_path)], cwd=ROOT, env=env, text=True, capture_output=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert (
        "device_check: tests exit 0, hybrid exit skipped, benchmarks exit skipped, quantized exit skipped, "
        "kv exit skipped, laptop exit skipped, structured exit skipped, spec exit skipped" in result.stdout
    )
    assert "skipped" in (tmp_path / "tests.log").read_text()


def test_device_check_keeps_to_its_time_budget_and_says_how_to_rerun(tmp_path):
    """A part with under a minute of DEVICE_BUDGET left is not started; the script says which parts are left and
    the switches for a rerun that does only those, and exits 3 (not 0: the check is incomplete)."""
    import os

    env = {
        **os.environ,
        "SKIP_TESTS": "1",
        "SKIP_HYBRID": "1",
        "SKIP_BENCH": "1",
        "DEVICE_BUDGET": "59",
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
    }
    for part in ("SKIP_QUANT", "SKIP_KV", "SKIP_LAPTOP", "SKIP_STRUCTURED", "SKIP_SPEC"):
        env.pop(part, None)
    result = subprocess.run(
        ["bash", "bench/device_check.sh", str(tmp_path)], cwd=ROOT, env=env, text=True, capture_output=True, timeout=120
    )
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-2000:]
    assert "quantized exit not run (time), kv exit not run (time), laptop exit not run (time)" in result.stdout
    assert "out of time for SKIP_QUANT SKIP_KV SKIP_LAPTOP" in result.stdout
    assert "rerun with: SKIP_TESTS=1 SKIP_HYBRID=1 SKIP_BENCH=1 " in result.stdout
    assert "== Quantized weights" not in result.stdout
