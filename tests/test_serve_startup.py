"""`python -m engine.serve` starting and stopping as a user meets it: a clear line and a non-zero exit
for a model it cannot load or a port it cannot bind, and a bounded wait on SIGTERM."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.processes import REPO, ServeProcess, free_port, wait_until

pytestmark = pytest.mark.timeout(900)  # one test starts the server on the bundled model


def serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine.serve", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def test_a_model_that_cannot_load_is_one_clear_message(tmp_path):
    missing = tmp_path / "no-such-model"
    run = serve("--model", str(missing), "--port", str(free_port()))
    assert run.returncode != 0
    assert "Traceback" not in run.stderr and f"Cannot load {missing}" in run.stderr
    assert len(run.stderr.strip().splitlines()) <= 3, run.stderr
    debug = serve("--model", str(missing), "--port", str(free_port()), "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_a_folder_without_tokenizer_files_says_so(tiny_llama, tmp_path):
    folder = tmp_path / "weights-only"
    folder.mkdir()
    for f in tiny_llama.iterdir():
        if f.name.endswith((".safetensors", "config.json")) and f.name != "tokenizer_config.json":
            shutil.copy(f, folder / f.name)
    run = serve("--model", str(folder), "--port", str(free_port()))
    assert run.returncode != 0 and "has no tokenizer files" in run.stderr, run.stderr
    assert "sentencepiece" not in run.stderr


def test_a_busy_port_is_said_before_the_model_loads(tiny_llama):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = serve("--model", str(tiny_llama), "--port", str(port), timeout=60)
    assert run.returncode != 0
    assert f"Cannot listen on 127.0.0.1:{port}" in run.stderr and "--port" in run.stderr
    assert "Serving" not in run.stdout


def test_sigterm_ends_a_read_stream_with_a_last_event_and_a_stream_nobody_reads_after_the_grace_period(
    bundled_model, tmp_path
):
    """SIGTERM once waited for every open generation: 83 s for one stream, for ever for a client that never
    reads. Then it cut the streams still running, so a client saw its reply stop with no finish and no [DONE].
    Now a stream still running after the grace period ends with a 503 error event and [DONE], and one nobody
    reads cannot hold the shutdown. The bundled model writes 1,900 tokens in well over 10 s on 2 cores."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled_model)
    stops = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")} | {tok.eos_token_id}
    srv = ServeProcess(
        bundled_model,
        tmp_path / "server.log",
        "--shutdown-grace",
        "2",
        "--max-model-len",
        "2048",
        "--served-model-name",
        "smollm2",
    ).wait_ready(timeout=600)
    try:
        request = {
            "model": "smollm2",
            "prompt": "Once upon a time",
            "max_tokens": 1900,
            "stream": True,
            "logit_bias": {str(t): -100 for t in stops},
        }
        body = json.dumps(request).encode()
        quiet = socket.create_connection(("127.0.0.1", srv.port))  # sends, and never reads a byte back
        quiet.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        lines: list[str] = []

        def read() -> None:
            with httpx.stream("POST", f"http://127.0.0.1:{srv.port}/v1/completions", json=request, timeout=60) as r:
                lines.extend(line for line in r.iter_lines() if line)

        reader = threading.Thread(target=read)
        reader.start()
        assert wait_until(lambda: len(lines) > 3, timeout=60)
        start = time.perf_counter()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(60)
        assert time.perf_counter() - start < 10  # the 2 s grace, the last events, then the engine's shutdown
        reader.join(10)
        quiet.close()
        assert lines[-1] == "data: [DONE]", lines[-3:]
        last = json.loads(lines[-2].removeprefix("data: "))
        assert last["error"]["code"] == "server_shutting_down" and "shutting down" in last["error"]["message"], last
        assert all(json.loads(line[6:])["choices"][0]["finish_reason"] is None for line in lines[:-2])
    finally:
        srv.stop()
