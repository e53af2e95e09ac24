"""Swapping models: on the CPU the old model serves until the new one is ready; on a GPU, which
seldom holds two, the old one goes first and gives its memory back. (The GPU is simulated: these
tests run on the CPU, with `_must_unload_first` answering as it would for an engine on CUDA.)"""
import pytest

import app.model_host
from app.model_host import ModelHost
from engine import SamplingParams

SETTINGS = dict(dtype="float32", num_kvcache_blocks=64, max_num_seqs=4)


@pytest.fixture
def host(tiny_llama):
    host = ModelHost()
    host.load(str(tiny_llama), label="tiny llama", wait=True, **SETTINGS)
    yield host
    host.unload()


def recording_llm(monkeypatch, host, fail: bool = False) -> list:
    """Replace the LLM the host builds with one that notes what it found when it was called."""
    seen, real = [], app.model_host.LLM

    def llm(model, **settings):
        old = seen_engine[0]
        seen.append({"old_released": old.model_runner.model is None, "message": host.state.message})
        if fail:
            raise ValueError("the checkpoint is damaged")
        return real(model, **settings)

    seen_engine = [host.engine.engine]
    monkeypatch.setattr(app.model_host, "LLM", llm)
    return seen


def test_on_the_cpu_the_old_model_serves_until_the_new_one_is_ready(host, tiny_qwen2, monkeypatch):
    assert not host._must_unload_first({})  # an engine on the CPU
    seen = recording_llm(monkeypatch, host)
    host.load(str(tiny_qwen2), label="tiny qwen2", wait=True, **SETTINGS)
    assert seen == [{"old_released": False, "message": "Loading tiny qwen2…"}]
    assert host.label == "tiny qwen2" and host.state.status == "ready"


def test_on_a_gpu_the_old_model_goes_first_and_its_replies_end_as_stopped(host, tiny_qwen2, monkeypatch):
    monkeypatch.setattr(ModelHost, "_must_unload_first", lambda self, settings: self.engine is not None)
    old = host.engine
    stream = old.submit([5, 17, 33, 7], SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True))
    first = next(iter(stream))
    assert first.new_token_ids
    seen = recording_llm(monkeypatch, host)
    host.load(str(tiny_qwen2), label="tiny qwen2", wait=True, **SETTINGS)
    assert seen == [{"old_released": True, "message": "Loading tiny qwen2… (tiny llama was unloaded to free the GPU.)"}]
    assert [out.finish_reason for out in stream][-1] == "abort"
    assert host.label == "tiny qwen2" and host.state.status == "ready" and host.engine is not old


def test_a_failed_load_after_unloading_says_what_was_unloaded(host, tiny_qwen2, monkeypatch):
    monkeypatch.setattr(ModelHost, "_must_unload_first", lambda self, settings: self.engine is not None)
    recording_llm(monkeypatch, host, fail=True)
    with pytest.raises(RuntimeError) as failure:
        host.load(str(tiny_qwen2), label="tiny qwen2", wait=True, **SETTINGS)
    assert str(failure.value) == ("Could not load tiny qwen2: the checkpoint is damaged. tiny llama was "
                                  "unloaded to free "
                                  "the GPU; load it again from the Models tab.")
    assert not host.ready and host.label == ""


def test_the_status_line_counts_the_seconds_of_a_load():
    import time

    from app.model_host import LoadState

    host = ModelHost()
    host.state = LoadState("loading", "Loading Qwen3-0.6B…", "Qwen/Qwen3-0.6B", {}, time.time() - 42.2)
    assert host.status_message() == "Loading Qwen3-0.6B… 42 s so far."
    host.state = LoadState("ready", "Qwen3-0.6B is ready on cuda (bfloat16, context 40,960 tokens, 9,000 KV "
                           "blocks) after 61 s.")
    assert host.status_message() == host.state.message
