"""Load on `python -m engine.serve` (issue 13, Hardening): 64 concurrent streams, a burst of 200 requests sent
at once, clients that hang up mid-stream, and the server's memory after it all.

Bounded for CI (2 cores): a tiny random-weight Llama, short replies, loopback only, a timeout on every request
and on each test. The tests share one server and run in file order, the last one checking the server after
the others' load; each also holds on its own (`-k`).
"""

import asyncio
import json
import re
import time
from dataclasses import dataclass, field

import httpx
import psutil
import pytest

from tests.processes import ServeProcess, wait_until

# Each test takes under 30 s here but the repeated bursts' (~30-50 s), the whole file about a minute and a half with
# the server's start; the bounds also cover a slow start of the shared server on a busy machine.
pytestmark = pytest.mark.timeout(240)

MODEL = "tiny"
EOS = 2  # <|im_end|>, the tiny model's only end-of-sequence token (tests/conftest.py)
# The end token is all but banned (as vLLM's ignore_eos would do, through the sampler's bias instead): every reply
# then runs to max_tokens, and each request's token count and finish_reason ("length") are known in advance.
NO_EOS = {str(EOS): -100}
REQUEST_TIMEOUT = httpx.Timeout(60, connect=30)  # a request stuck past this fails the test, not the CI job
PHASE_TIMEOUT = 90  # one round of load; a few seconds here


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    # A KV cache sized to the load rather than the CPU default (1 GiB): 64 running requests of about 50
    # tokens take 4 blocks each of 16 tokens, and the disconnecting ones up to 26; 2048 blocks leave room
    # without the cache dwarfing the memory being measured.
    srv = ServeProcess(
        tiny_llama,
        tmp_path_factory.mktemp("load") / "server.log",
        "--served-model-name",
        MODEL,
        "--dtype",
        "float32",
        "--max-num-seqs",
        "64",
        "--max-model-len",
        "512",
        "--num-kvcache-blocks",
        "2048",
    ).wait_ready()
    yield srv
    srv.stop()


# ---- the client side ---------------------------------------------------------------------------------------
@dataclass
class Result:
    kind: str  # "chat" or "completion"
    stream: bool
    status: int = 0
    finish_reason: str | None = None
    completion_tokens: int | None = None
    content_chunks: int = 0  # events that carried some of the reply's text
    done: bool = False  # a stream ended with `data: [DONE]`
    problems: list[str] = field(default_factory=list)  # malformed events, errors, anything unexpected
    cut: bool = False  # the client hung up on purpose


def body(kind: str, i: int, max_tokens: int, stream: bool) -> dict:
    # Different prompts per request, so the load is not one shared prefix; greedy, so nothing is left to chance.
    text = f"Request {i}: tell me about the quick brown fox and paged attention, part {i % 7}."
    payload = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "logit_bias": NO_EOS, "stream": stream}
    if stream:
        payload["stream_options"] = {"include_usage": True}
    if kind == "chat":
        return {**payload, "messages": [{"role": "user", "content": text}]}
    return {**payload, "prompt": text}


async def run_stream(
    client: httpx.AsyncClient,
    kind: str,
    i: int,
    max_tokens: int,
    cut_after: int | None = None,
    opened: asyncio.Event | None = None,
    all_open: asyncio.Event | None = None,
) -> Result:
    """One streamed request, its server-sent events checked one by one. `cut_after`: hang up after that many
    events. `opened`/`all_open`: say when the response has started, then wait for every other stream to have
    started too, so the streams are open at the same time and not merely sent together."""
    result = Result(kind, stream=True)
    path = "/chat/completions" if kind == "chat" else "/completions"
    async with client.stream("POST", path, json=body(kind, i, max_tokens, True)) as response:
        result.status = response.status_code
        if opened is not None:
            opened.set()  # a failed one too: the others should not wait for it
        if response.status_code != 200:
            result.problems.append(f"status {response.status_code}: {(await response.aread())[:300]!r}")
            return result
        if all_open is not None:
            await all_open.wait()
        events = 0
        async for line in response.aiter_lines():
            if not line:
                continue  # the blank line that ends each event
            if result.done:
                result.problems.append(f"an event after [DONE]: {line[:200]!r}")
                continue
            if not line.startswith("data: "):
                result.problems.append(f"not an SSE data line: {line[:200]!r}")
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                result.done = True
                continue
            events += 1
            try:
                event = json.loads(data)
            except json.JSONDecodeError:
                result.problems.append(f"not JSON: {data[:200]!r}")
                continue
            if "error" in event:
                result.problems.append(f"an error event: {data[:300]}")
            for choice in event.get("choices") or []:
                text = choice.get("delta", {}).get("content") if kind == "chat" else choice.get("text")
                result.content_chunks += bool(text)
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
            if event.get("usage"):
                result.completion_tokens = event["usage"]["completion_tokens"]
            if cut_after is not None and events >= cut_after:
                result.cut = True
                break  # leaving the `async with` closes the connection mid-stream
    return result


async def run_whole(client: httpx.AsyncClient, kind: str, i: int, max_tokens: int) -> Result:
    result = Result(kind, stream=False)
    response = await client.post(
        "/chat/completions" if kind == "chat" else "/completions", json=body(kind, i, max_tokens, False)
    )
    result.status = response.status_code
    if response.status_code != 200:
        result.problems.append(f"status {response.status_code}: {response.text[:300]!r}")
        return result
    reply = response.json()
    choice = reply["choices"][0]
    text = choice["message"]["content"] if kind == "chat" else choice["text"]
    result.content_chunks = bool(text)
    result.finish_reason, result.completion_tokens = choice["finish_reason"], reply["usage"]["completion_tokens"]
    return result


def client_for(server: ServeProcess) -> httpx.AsyncClient:
    # httpx allows 100 connections by default and queues the rest on the client: the burst would never reach
    # the server all at once.
    return httpx.AsyncClient(
        base_url=server.url,
        timeout=REQUEST_TIMEOUT,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


def check_complete(results: list[Result], max_tokens: int) -> None:
    """Every request answered 200 and ran to max_tokens; a stream was well formed and ended with [DONE]."""
    bad = [r for r in results if r.status != 200 or r.problems]
    assert not bad, f"{len(bad)} of {len(results)} requests failed, e.g. {bad[:3]}"
    for r in results:
        assert r.finish_reason == "length" and r.completion_tokens == max_tokens, r
        # a token whose text is held back (part of a character) sends no chunk, so at most one per token
        assert 1 <= r.content_chunks <= max_tokens, r
        assert r.done or not r.stream, r


def server_statuses(server: ServeProcess) -> dict[str, int]:
    """Responses by status, from the server's one log line per API request (entrypoints/openai/request_log.py):
    a 5xx the client never saw (one cut short) still shows there."""
    counts: dict[str, int] = {}
    for match in re.finditer(r"^POST /v1/\S+ (\d{3}|\(no response\))", server.log.read_text(), re.MULTILINE):
        counts[match.group(1)] = counts.get(match.group(1), 0) + 1
    return counts


def assert_no_5xx(server: ServeProcess) -> None:
    statuses = server_statuses(server)
    assert not [s for s in statuses if not s.isdigit() or s.startswith("5")], statuses
    assert "Traceback" not in server.log.read_text()


def idle(server: ServeProcess) -> bool:
    return (
        server.metric("vllm:num_requests_running") == 0
        and server.metric("vllm:num_requests_waiting") == 0
        and server.metric("vllm:kv_cache_usage_perc") == 0
    )


def rss(pid: int) -> int:
    """Resident memory of the server and any processes it started (tensor-parallel workers, compile workers)."""
    process = psutil.Process(pid)
    total = process.memory_info().rss
    for child in process.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def settled_rss(pid: int, seconds: float = 4.0) -> int:
    """The least RSS seen over a few seconds: the memory a finished request frees is given back a moment
    later (the event loop drops its last references, the allocator trims), and one sample could catch it
    before."""
    least = rss(pid)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.2)
        least = min(least, rss(pid))
    return least


# ---- the load ----------------------------------------------------------------------------------------------
STREAMS, STREAM_TOKENS = 64, 32
BURST, BURST_TOKENS = 200, 16
CUT, CUT_TOKENS = 16, 400  # clients that hang up, on replies long enough that they are mid-stream then


def concurrent_streams(server: ServeProcess) -> list[Result]:
    async def go():
        async with client_for(server) as client:
            opened = [asyncio.Event() for _ in range(STREAMS)]
            all_open = asyncio.Event()

            async def when_all_open():
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in opened)), PHASE_TIMEOUT)
                all_open.set()

            waiter = asyncio.create_task(when_all_open())
            results = await asyncio.gather(
                *(
                    run_stream(
                        client, "chat" if i % 4 else "completion", i, STREAM_TOKENS, opened=opened[i], all_open=all_open
                    )
                    for i in range(STREAMS)
                )
            )
            await waiter
            return results

    return asyncio.run(asyncio.wait_for(go(), PHASE_TIMEOUT))


def burst(server: ServeProcess) -> list[Result]:
    """200 requests sent together: a quarter each of streamed chat, whole chat, streamed and whole completions.
    64 run at once (--max-num-seqs) and the rest wait in the engine's queue."""

    async def go():
        async with client_for(server) as client:
            kinds = [("chat", True), ("chat", False), ("completion", True), ("completion", False)]
            return await asyncio.gather(
                *(
                    run_stream(client, kind, i, BURST_TOKENS) if stream else run_whole(client, kind, i, BURST_TOKENS)
                    for i, (kind, stream) in ((i, kinds[i % 4]) for i in range(BURST))
                )
            )

    return asyncio.run(asyncio.wait_for(go(), PHASE_TIMEOUT))


def with_disconnects(server: ServeProcess) -> list[Result]:
    """48 streams that run to the end beside 16 whose clients hang up after a few events."""

    async def go():
        async with client_for(server) as client:
            return await asyncio.gather(
                *(
                    run_stream(client, "chat" if i % 8 else "completion", i, CUT_TOKENS, cut_after=4)
                    if i % 4 == 0
                    else run_stream(client, "chat" if i % 4 != 1 else "completion", i, STREAM_TOKENS)
                    for i in range(STREAMS)
                )
            )

    return asyncio.run(asyncio.wait_for(go(), PHASE_TIMEOUT))


def timed(what: str, run, *args):
    started = time.monotonic()
    out = run(*args)
    print(f"{what}: {time.monotonic() - started:.1f} s")
    return out


# ---- the tests ---------------------------------------------------------------------------------------------
def test_64_concurrent_streams_all_complete_well_formed(server):
    results = timed("64 concurrent streams", concurrent_streams, server)
    assert len(results) == STREAMS
    check_complete(results, STREAM_TOKENS)
    # They shared the engine's batch rather than running one after another: the largest step it recorded
    # (64 in every run so far). Asked for less than all 64: on 2 busy cores the first streams could finish
    # before the last ones are scheduled.
    print(f"largest batch: {server.metric('pagoda:max_batch_size'):.0f}")
    assert server.metric("pagoda:max_batch_size") >= 32
    assert wait_until(lambda: idle(server), timeout=30)
    assert_no_5xx(server)


def test_a_burst_of_200_at_once_all_complete_and_rss_comes_back(server):
    # The warm-up round is the same burst, and its results are checked as well. The first time a load runs,
    # memory grows for good reasons that are not leaks: the allocator keeps freed arenas for reuse, torch
    # caches kernels and workspaces for batch sizes it has not seen, the tokenizer and the event loop build
    # what they use lazily. A baseline taken before that would blame all of it on the burst.
    check_complete(timed("burst of 200 (warm-up)", burst, server), BURST_TOKENS)
    assert wait_until(lambda: idle(server), timeout=30)
    before = settled_rss(server.proc.pid)

    generated = server.metric("vllm:generation_tokens_total")
    results = timed("burst of 200", burst, server)
    assert len(results) == BURST
    check_complete(results, BURST_TOKENS)
    assert server.metric("vllm:generation_tokens_total") - generated == BURST * BURST_TOKENS
    assert wait_until(lambda: idle(server), timeout=30)
    after = settled_rss(server.proc.pid)
    print(f"RSS: {before / 2**20:.0f} MiB before the burst, {after / 2**20:.0f} MiB after ({after / before:.3f}x)")
    assert after <= 1.10 * before, f"RSS grew from {before / 2**20:.0f} MiB to {after / 2**20:.0f} MiB"
    assert_no_5xx(server)


REPEATS, LAST = 20, 5  # bursts in all; the last ones, by which a levelled-off server has stopped growing


@pytest.mark.timeout(480)
def test_rss_levels_off_over_repeated_bursts(server):
    # The requirement's single burst after one warm-up stays inside 10% (the test above). Memory that keeps
    # growing burst after burst still runs a long-lived server out of room, and one burst cannot show it: it
    # climbed 10-25 MiB a burst, towards ~1 GiB, while oneDNN cached a kernel for every row count a step had.
    # engine/layers/linear.py now asks it for a few row counts only (bucketed_rows): measured, RSS rises for
    # ~15 bursts while those fill (504 -> 594 MiB), then stays within a few MiB.
    rss = []
    started = time.monotonic()
    for _ in range(REPEATS):
        check_complete(burst(server), BURST_TOKENS)
        assert wait_until(lambda: idle(server), timeout=30)
        rss.append(psutil.Process(server.proc.pid).memory_info().rss)
    print(f"{REPEATS} bursts: {time.monotonic() - started:.1f} s; RSS after each (MiB): {[r >> 20 for r in rss]}")
    grown = rss[-1] - rss[-LAST - 1]
    # Before the fix the last five bursts added 50-125 MiB; a levelled-off server moves by a few.
    assert grown <= 0.05 * rss[-LAST - 1], f"RSS still grows: {grown >> 20} MiB over the last {LAST} bursts"
    assert_no_5xx(server)


def test_clients_that_hang_up_mid_stream_free_their_requests_and_kv_blocks(server):
    generated = server.metric("vllm:generation_tokens_total")
    results = timed("64 streams, 16 cut short", with_disconnects, server)
    cut = [r for r in results if r.cut]
    assert len(cut) == CUT and all(r.status == 200 and not r.problems and not r.done for r in cut)
    check_complete([r for r in results if not r.cut], STREAM_TOKENS)
    # Once their clients are gone, nothing runs, nothing waits and every KV block is free again.
    started = time.monotonic()
    assert wait_until(lambda: idle(server), timeout=30), (
        server.metric("vllm:num_requests_running"),
        server.metric("vllm:num_requests_waiting"),
        server.metric("vllm:kv_cache_usage_perc"),
    )
    print(f"idle {time.monotonic() - started:.1f} s after the last client")
    # The cut requests were aborted, not left to run to their 400 tokens unseen (which would make this all 6,400).
    # 100-650 here: a client slowed by a busy machine reads its 4 events while the server is tokens ahead.
    extra = server.metric("vllm:generation_tokens_total") - generated - (STREAMS - CUT) * STREAM_TOKENS
    print(f"tokens generated for the 16 cut streams: {extra:.0f} (of {CUT * CUT_TOKENS} asked)")
    assert extra < CUT * CUT_TOKENS / 2
    assert_no_5xx(server)


def test_after_the_load_the_server_still_answers(server):
    reply = httpx.post(f"{server.url}/chat/completions", timeout=60, json=body("chat", 0, 8, False))
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["finish_reason"] == "length"
    assert reply.json()["usage"]["completion_tokens"] == 8
    assert idle(server)
    statuses = server_statuses(server)
    print(f"responses by status over the module: {statuses}")
    assert_no_5xx(server)
