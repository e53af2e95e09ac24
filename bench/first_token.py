"""Time to first token from process start, and the process's peak memory: Pagoda against llama.cpp (issue 38).

    python -m bench.first_token --llama-completion PATH --files a.gguf,b.gguf [--prompt-words 100] [--rounds 2]
                                [--threads 2]

What a user waits for after starting a program on a downloaded file: each side is a fresh process that loads the
file, reads one prompt of --prompt-words words and writes one token, under `/usr/bin/time -v` (which also gives the
process's peak resident memory, imports included). llama.cpp's side is `llama-completion -n 1 -c 4096` (build it
for this bench only, as bench/RESULTS.md says), timed from spawn to exit. Pagoda's is the engine thread the app and
API serve from (`EngineThread.load(file)`, default settings), timed from spawn to its first token; the child also
reports where its time went (imports, load, first token), then waits for the background compile of decode steps
before it exits, so that the peak includes that too. The file is read just before each side runs, so both find it
in the page cache; each side goes first in every other round, and keeps its best.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.quantized import cpu_flags

REPO = Path(__file__).resolve().parents[1]

_CHILD = """
import json, sys, time
start = time.perf_counter()
import torch
torch.set_num_threads(int(sys.argv[3]))
from engine import SamplingParams
from engine.front.engine_thread import EngineThread
imported = time.perf_counter()
engine = EngineThread.load(sys.argv[1])
loaded = time.perf_counter()
params = SamplingParams(temperature=0, max_tokens=1)
next(out for out in engine.submit(sys.argv[2], params) if out.token_ids)
first = time.perf_counter()
print("first token", flush=True)
engine.engine.model_runner.wait_for_compiled_decode()  # the background compile's memory counts in the peak too
print(json.dumps({"imports_s": imported - start, "load_s": loaded - imported, "first_token_s": first - loaded,
                  "prompt_tokens": len(engine.tokenize(sys.argv[2])), "matmul": engine.stats().matmul,
                  "kv_bytes": sum(t.numel() * t.element_size() for t in engine.engine.model_runner.kv_cache)}))
engine.shutdown()
"""


def timed(command: list[str], env: dict | None = None, until: str | None = None) -> tuple[float, int, str]:
    """(seconds from spawn to exit, or to the first line of stdout starting with `until`; peak resident bytes;
    stdout) of `command` run under /usr/bin/time -v."""
    start = time.perf_counter()
    child = subprocess.Popen(
        ["/usr/bin/time", "-v", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    seconds, lines = None, []
    for line in child.stdout:
        lines.append(line)
        if seconds is None and until is not None and line.startswith(until):
            seconds = time.perf_counter() - start
    stderr = child.stderr.read()
    if child.wait() != 0:
        raise RuntimeError(f"{command[0]} failed:\n{stderr[-3000:]}")
    seconds = seconds if seconds is not None else time.perf_counter() - start
    peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr).group(1))
    return seconds, peak_kb * 1024, "".join(lines)


def llama_cpp(binary: str, file: str, prompt: str, threads: int) -> tuple[float, int]:
    command = [binary, "-m", file, "-p", prompt, "-n", "1", "-t", str(threads), "-no-cnv", "--temp", "0"]
    seconds, peak, _ = timed(command + ["-c", "4096"])
    return seconds, peak


def pagoda(file: str, prompt: str, threads: int) -> tuple[float, int, dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    seconds, peak, stdout = timed([sys.executable, "-c", _CHILD, file, prompt, str(threads)], env, "first token")
    return seconds, peak, json.loads(stdout.strip().splitlines()[-1])


def into_page_cache(file: str) -> None:
    """Read `file` so the side about to run finds it in the page cache: a machine's cache may not hold every file
    (this VM's kept about 6 GB), and the side that found it there started seconds earlier."""
    with open(file, "rb") as f:
        while f.read(64 << 20):
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-completion", required=True, help="path of llama.cpp's llama-completion binary")
    ap.add_argument("--files", required=True, help="comma-separated GGUF files")
    ap.add_argument("--prompt-words", type=int, default=100, help="a prompt of about this many words")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()
    prompt = " ".join(words[i % len(words)] for i in range(args.prompt_words))
    print(f"CPU flags: {cpu_flags()}; threads {args.threads}", flush=True)
    files = args.files.split(",")
    best: dict[tuple[str, str], tuple[float, int]] = {}
    details: dict[str, dict] = {}
    for round_ in range(args.rounds):
        for file in files:
            runs = {
                "llama.cpp": lambda: llama_cpp(args.llama_completion, file, prompt, args.threads),
                "pagoda": lambda: pagoda(file, prompt, args.threads),
            }
            got = {}
            for side in sorted(runs, reverse=bool(round_ % 2)):  # each side goes first in every other round
                into_page_cache(file)
                got[side] = runs[side]()
            (lt, lpeak), (pt, ppeak, details[file]) = got["llama.cpp"], got["pagoda"]
            for side, figures in (("llama.cpp", (lt, lpeak)), ("pagoda", (pt, ppeak))):
                kept = best.get((file, side))
                best[file, side] = figures if kept is None or figures[0] < kept[0] else kept
            d = details[file]
            print(
                f"round {round_ + 1} {Path(file).name}: llama.cpp {lt:.1f} s, {lpeak / 1e9:.2f} GB; Pagoda {pt:.1f} s "
                f"(imports {d['imports_s']:.1f}, load {d['load_s']:.1f}, first token {d['first_token_s']:.1f} of "
                f"{d['prompt_tokens']} prompt tokens), {ppeak / 1e9:.2f} GB",
                flush=True,
            )
    print(
        "\n| file | on disk | llama.cpp to first token | Pagoda | ratio | Pagoda's peak (time -v) | KV cache | "
        "peak / (file + KV) | llama.cpp's peak |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for file in files:
        (lt, lpeak), (pt, ppeak) = best[file, "llama.cpp"], best[file, "pagoda"]
        size, kv = Path(file).stat().st_size, details[file]["kv_bytes"]
        print(
            f"| {Path(file).name} | {size / 1e9:.2f} GB | {lt:.1f} s | {pt:.1f} s | {pt / lt:.2f}x | "
            f"{ppeak / 1e9:.2f} GB | {kv / 1e9:.2f} GB | {ppeak / (size + kv):.2f}x | {lpeak / 1e9:.2f} GB |"
        )


if __name__ == "__main__":
    main()
