"""Several models served by name (entrypoints/model_registry.py): a model named by a request loads on first use,
an idle one unloads after the TTL (its memory goes back), one that does not fit in the memory budget is refused
with what it needs and what is free while the others keep serving; and the same through a real server and the
openai and ollama clients."""

import math

import anyio
import httpx
import pytest

from entrypoints.model_registry import ModelRegistry
from entrypoints.openai.errors import APIError
from tests.processes import ServeProcess, wait_until

openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")

pytestmark = pytest.mark.timeout(600)
MIB = 2**20
SETTINGS = {"dtype": "float32", "kv_cache_memory_bytes": MIB, "max_num_seqs": 4}
HELLO = [{"role": "user", "content": "Say hello."}]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def greedy(engine, prompt: list[int]) -> list[int]:
    from engine import SamplingParams

    return engine.engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]["token_ids"]


def test_jit_loads_ttl_unloads_and_a_model_that_does_not_fit_is_refused(tiny_models, random_prompt):
    clock = Clock()
    models = {name: str(tiny_models[name]) for name in ("llama", "qwen2", "qwen3")}
    registry = ModelRegistry(models, SETTINGS, ttl=60, clock=clock)
    registry.load("llama")  # what start() does, without its idle timer: this test turns the clock itself
    try:
        assert [e.state for e in registry.listing()] == ["loaded", "not-loaded", "not-loaded"]
        qwen2 = anyio.run(registry.pick, "qwen2")
        assert qwen2.name == "qwen2" and registry.entries["qwen2"].state == "loaded"
        assert anyio.run(registry.pick, "qwen2").engine is qwen2.engine  # loaded once
        held = {e.name: e.held_bytes for e in registry.listing()}
        assert held["qwen2"] > MIB and held["qwen3"] == 0
        prompt = random_prompt(12, 1)
        before = greedy(qwen2.engine, prompt)

        # Room for what is loaded and not much more: the third is refused, the others go on serving
        registry.budget_bytes = held["llama"] + held["qwen2"] + MIB // 2
        with pytest.raises(APIError) as refused:
            anyio.run(registry.pick, "qwen3")
        assert refused.value.status == 503 and refused.value.code == "insufficient_memory"
        assert "qwen3 needs about" in refused.value.message and "MiB of the" in refused.value.message
        assert "llama" in refused.value.message and "qwen2" in refused.value.message
        assert registry.entries["qwen3"].state == "not-loaded"
        assert greedy(anyio.run(registry.pick, "llama").engine, prompt)
        assert greedy(qwen2.engine, prompt) == before

        clock.now += 59  # not idle long enough yet
        assert registry.unload_idle() == []
        clock.now += 2
        assert registry.unload_idle() == ["qwen2"]  # never the default, loaded at start
        assert registry.entries["qwen2"].state == "not-loaded" and registry.entries["qwen2"].held_bytes == 0
        assert qwen2.engine.engine.model_runner.model is None  # its weights and KV cache are let go
        assert anyio.run(registry.pick, "qwen3").name == "qwen3"  # the room it freed serves another
        # Ollama's keep_alive: a model kept forever outlives the TTL; one kept for 0 s goes as soon as it is idle
        assert registry.keep("qwen3", math.inf) and not registry.keep("llama", 0)  # never the default's
        clock.now += 1000
        assert registry.unload_idle() == []
        assert registry.keep("qwen3", 0) and registry.unload_idle() == ["qwen3"]
        with pytest.raises(APIError) as unknown:
            anyio.run(registry.pick, "gpt-4o")
        assert unknown.value.status == 404 and "'qwen2'" in unknown.value.message
    finally:
        registry.shutdown()


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    srv = ServeProcess(
        tiny_models["llama"],
        tmp_path_factory.mktemp("registry") / "server.log",
        "--model",
        str(tiny_models["qwen2"]),
        "--ttl",
        "1",
        "--dtype",
        "float32",
        "--kv-cache-memory-bytes",
        str(MIB),
    ).wait_ready()
    yield srv
    srv.stop()


def test_two_models_named_in_turn_both_answer_and_the_idle_one_unloads(server):
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)

    def states() -> dict[str, str]:
        return {m.id: m.status for m in client.models.list().data}

    assert states() == {"llama": "loaded", "qwen2": "not-loaded"}
    for name in ("qwen2", "llama", "qwen2"):
        reply = client.chat.completions.create(model=name, messages=HELLO, max_tokens=4, temperature=0)
        assert reply.model == name and reply.usage.completion_tokens > 0
    assert states() == {"llama": "loaded", "qwen2": "loaded"}
    local = ollama.Client(host=server.base, timeout=120)
    assert sorted(m.model for m in local.list().models) == ["llama", "qwen2"]
    assert wait_until(lambda: states()["qwen2"] == "not-loaded", 30, interval=0.2)  # a second idle
    assert states()["llama"] == "loaded"
    assert [m.model for m in local.ps().models] == ["llama"]
    again = local.chat(model="qwen2:latest", messages=HELLO, options={"num_predict": 4, "temperature": 0})
    assert again.done and again.model == "qwen2"
    # `ollama stop`: an empty generate with keep_alive 0 unloads the model once it is idle
    assert local.generate(model="qwen2", keep_alive=0).done_reason == "unload"
    assert wait_until(lambda: [m.model for m in local.ps().models] == ["llama"], 30, interval=0.2)
    assert local.generate(model="llama", keep_alive=0).done_reason == "load"  # the default stays
    card = httpx.get(f"{server.url}/models/qwen2", timeout=10).json()
    assert card["status"] in ("loaded", "not-loaded") and card["id"] == "qwen2"
