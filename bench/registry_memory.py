"""Does an unloaded model's memory go back? `python -m engine.serve` serving a small default model and the bundled
SmolLM2 GGUF by name, with a short TTL: the server's resident memory at start, after a request loads the GGUF, and
after the TTL unloads it, for a few cycles. The start figure is the baseline of the same run.

    python -m bench.registry_memory --default <a small model folder> [--cycles 4] [--ttl 3]
"""

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from engine.loader.bundled import bundled_gguf_path

MIB = 2**20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resident_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no VmRSS: this measures Linux processes only")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--default", required=True, help="the model loaded at start (a small one)")
    ap.add_argument("--cycles", type=int, default=4)
    ap.add_argument("--ttl", type=float, default=3.0)
    args = ap.parse_args()
    gguf, port = bundled_gguf_path(), free_port()
    command = [sys.executable, "-m", "engine.serve", "--model", args.default, "--model", str(gguf), "--port", str(port)]
    command += ["--ttl", str(args.ttl), "--kv-cache-memory-bytes", str(256 * MIB)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=os.environ)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        while True:
            try:
                states = {m["id"]: m["status"] for m in httpx.get(f"{base}/models", timeout=2).json()["data"]}
                break
            except httpx.HTTPError:
                if server.poll() is not None:
                    raise SystemExit("the server exited") from None
                time.sleep(0.5)
        name = gguf.name
        start = resident_mib(server.pid)
        print(f"start: {start} MiB, {states}")
        for cycle in range(1, args.cycles + 1):
            body = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
            httpx.post(f"{base}/chat/completions", json=body, timeout=600).raise_for_status()
            loaded = resident_mib(server.pid)
            while {m["id"]: m["status"] for m in httpx.get(f"{base}/models").json()["data"]}[name] != "not-loaded":
                time.sleep(0.2)
            time.sleep(1)
            unloaded = resident_mib(server.pid)
            print(f"cycle {cycle}: loaded {loaded} MiB, unloaded {unloaded} MiB ({unloaded / start:.2f}x start)")
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
