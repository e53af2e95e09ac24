"""Peak memory and time of loading a GGUF file (issue 38): `LLM(file)` in a fresh process.

    python -m bench.gguf_load_memory                       # a generated Qwen3-shaped Q4_K_M-like file (~470 MB)
    python -m bench.gguf_load_memory --shape small         # the CI test's file (~90 MB)
    python -m bench.gguf_load_memory --file model.gguf     # any file
    python -m bench.gguf_load_memory --repo /other/checkout # the same measurement of another checkout's engine
    python -m bench.gguf_load_memory --threads 1           # the load on one thread

The child imports what every load imports (torch, transformers, engine.front.llm_engine), reads its peak resident
memory (getrusage's ru_maxrss, the "Maximum resident set size" of /usr/bin/time -v) as the baseline, loads the
file, and reads the peak again. Reported: the load's own peak, (peak - baseline), over (file size + the KV cache
budget), and the load's wall and CPU time. Generated files are random-weight (tests/shaped_gguf.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KV_BYTES = 64 << 20

_CHILD = """
import json, resource, sys, time
import torch, transformers, engine.front.llm_engine  # the baseline: what every load imports
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
from engine import LLM
wall, cpu = time.perf_counter(), time.process_time()
llm = LLM(sys.argv[1], kv_cache_memory_bytes=int(sys.argv[2]), enforce_eager=True)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
kv = sum(t.numel() * t.element_size() for t in llm.model_runner.kv_cache)
print(json.dumps({"baseline_bytes": baseline, "peak_bytes": peak, "load_s": wall, "cpu_s": cpu, "kv_bytes": kv,
                  "held_bytes": llm.parameter_bytes()[0], "matmul": llm.stats().matmul}))
"""


def measure_load(
    path: Path, kv_bytes: int = KV_BYTES, repo: Path = REPO, threads: int | None = None, timeout: float = 1800
) -> dict:
    """Load `path` in a fresh process running `repo`'s engine; the figures the module docstring describes."""
    env = {**os.environ, "PAGODA_CPU_COMPILE": "0", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(repo)}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), str(kv_bytes)],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"loading {path} failed:\n{done.stderr[-3000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    figures["file_bytes"] = path.stat().st_size
    figures["ratio"] = (figures["peak_bytes"] - figures["baseline_bytes"]) / (figures["file_bytes"] + kv_bytes)
    return figures


def write_file(shape_name: str, folder: Path) -> Path:
    from tests.conftest import build_tokenizer
    from tests.shaped_gguf import MEDIUM, QWEN3_4B, SMALL, write_shaped_gguf

    shape = {"small": SMALL, "medium": MEDIUM, "qwen3-4b": QWEN3_4B}[shape_name]
    tokenizer = folder / "tokenizer"
    tokenizer.mkdir(exist_ok=True)
    build_tokenizer(tokenizer)
    return write_shaped_gguf(folder / f"{shape_name}.gguf", shape, tokenizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", type=Path, help="a GGUF file to load (default: generate one of --shape)")
    parser.add_argument("--shape", default="medium", choices=["small", "medium", "qwen3-4b"])
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose engine loads the file")
    parser.add_argument("--kv-bytes", type=int, default=KV_BYTES)
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the load (default: torch's, one per core)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.file or write_file(args.shape, Path(tmp))
        f = measure_load(path, args.kv_bytes, args.repo, args.threads)
    mb = lambda b: f"{b / 1e6:.0f} MB"
    print(f"{path.name}: {mb(f['file_bytes'])} on disk, KV cache {mb(args.kv_bytes)}")
    print(
        f"  baseline (imports) {mb(f['baseline_bytes'])}, peak {mb(f['peak_bytes'])}: the load adds "
        f"{mb(f['peak_bytes'] - f['baseline_bytes'])} = {f['ratio']:.2f}x (file + KV)"
    )
    print(f"  the loaded model holds {mb(f['held_bytes'])} of weights; the KV cache takes {mb(f['kv_bytes'])}")
    print(f"  load {f['load_s']:.1f} s wall, {f['cpu_s']:.1f} s CPU; kernels: {f['matmul']}")


if __name__ == "__main__":
    main()
