"""Serving benchmark: N concurrent streaming chat clients against an OpenAI-compatible server.

    python -m bench.serve [--base-url http://host:port] [--clients 16] [--requests 64] [--max-tokens 64]

Without --base-url it starts `python -m engine.serve` on a free local port (the bundled model unless
--model says otherwise) and stops it at the end. Every request is a chat with one shared system
prompt of about --system-tokens tokens and its own user message, the workload where the prefix
cache pays. It reports what vLLM's benchmark_serving and SGLang's bench_serving report: TTFT, TPOT
(time per output token after the first), ITL (inter-token latency), mean / p50 / p99, request and
output-token throughput, and the prefix-cache hit rate (from usage.cached_tokens and, when the
server exposes them, vLLM's /metrics counters). Works against vLLM, SGLang or llama.cpp too.
"""

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

SYSTEM_WORDS = (
    "You are a patient assistant for a team of engineers. You answer precisely, you cite the part of "
    "the question you answer, and you say plainly when you do not know. "
).split()
TOPICS = [
    "lighthouses",
    "paged attention",
    "sourdough",
    "bicycles",
    "tides",
    "compilers",
    "volcanoes",
    "chess",
    "beekeeping",
    "railways",
    "glaciers",
    "typography",
    "owls",
    "satellites",
    "tea",
    "bridges",
]


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


async def one_request(
    client: httpx.AsyncClient, url: str, headers: dict, model: str, system: str, user: str, max_tokens: int
) -> Result:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result, start = Result(), time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    result.output_tokens = usage["completion_tokens"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
        result.latency_s = time.perf_counter() - start
        result.ok = last is not None
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


def prometheus(base: str) -> dict[str, float]:
    try:
        text = httpx.get(f"{base}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            try:
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return values


async def run(args, base: str, model: str) -> tuple[list[Result], float, dict[str, float]]:
    system = " ".join(SYSTEM_WORDS[i % len(SYSTEM_WORDS)] for i in range(int(args.system_tokens * 0.75)))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    gate = asyncio.Semaphore(args.clients)

    async def client_request(i: int) -> Result:
        async with gate:
            user = f"Request {i}: explain {TOPICS[i % len(TOPICS)]} to a newcomer in a few sentences."
            return await one_request(http, f"{base}/v1/chat/completions", headers, model, system, user, args.max_tokens)

    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        # One request first, so the shared system prompt is in the cache, as in a running service.
        await one_request(http, f"{base}/v1/chat/completions", headers, model, system, "Hello.", 4)
        before = prometheus(base)
        start = time.perf_counter()
        results = await asyncio.gather(*(client_request(i) for i in range(args.requests)))
        return results, time.perf_counter() - start, before


def percentiles(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return 0.0, 0.0, 0.0
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return statistics.mean(ordered), statistics.median(ordered), p99


def start_server(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "engine.serve", "--port", str(port), "--max-num-seqs", str(max(args.clients, 1))]
    if args.model:
        cmd += ["--model", args.model]
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"pagoda-bench-serve-{port}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1])
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited; see {log.name}")
        try:
            if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server did not start within 300 s; see {log.name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", help="a running server (without /v1); default: start `python -m engine.serve`")
    ap.add_argument("--model", help="model to serve when starting a server (default: the bundled SmolLM2)")
    ap.add_argument("--api-key", default=os.environ.get("PAGODA_API_KEY"))
    ap.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=400, help="approximate length of the shared system prompt")
    args = ap.parse_args()

    proc = None
    base = (args.base_url or "").rstrip("/").removesuffix("/v1")
    if not base:
        proc, base = start_server(args)
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = httpx.get(f"{base}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        results, duration, before = asyncio.run(run(args, base, model))
        after = prometheus(base)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)

    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    rows = [
        ("Server", f"{base} ({model})"),
        ("Clients / requests", f"{args.clients} / {args.requests}"),
        ("Successful requests", f"{len(done)}"),
        ("Failed requests", f"{len(failed)}" + (f" (first: {failed[0].error})" if failed else "")),
        ("Benchmark duration (s)", f"{duration:.2f}"),
        ("Total input tokens", f"{prompt:,}"),
        ("Total generated tokens", f"{output:,}"),
        ("Request throughput (req/s)", f"{len(done) / duration:.2f}"),
        ("Output token throughput (tok/s)", f"{output / duration:.1f}"),
        ("Total token throughput (tok/s)", f"{(prompt + output) / duration:.1f}"),
    ]
    for label, values in (
        ("TTFT", [r.ttft_s for r in done]),
        ("TPOT", tpot),
        ("ITL", [x for r in done for x in r.itl_s]),
    ):
        mean, p50, p99 = percentiles(values)
        rows.append((f"{label} mean / p50 / p99 (ms)", f"{mean * 1e3:.1f} / {p50 * 1e3:.1f} / {p99 * 1e3:.1f}"))
    rows.append(("Prefix cache hit rate (usage)", f"{cached / prompt:.1%} of prompt tokens" if prompt else "n/a"))
    queries = after.get("vllm:prefix_cache_queries_total", 0) - before.get("vllm:prefix_cache_queries_total", 0)
    hits = after.get("vllm:prefix_cache_hits_total", 0) - before.get("vllm:prefix_cache_hits_total", 0)
    rows.append(("Prefix cache hit rate (/metrics)", f"{hits / queries:.1%}" if queries else "not reported"))
    width = max(len(k) for k, _ in rows)
    print("=" * 20, "Serving benchmark", "=" * 20)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
