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
    assert str(failure.value) == (
        "Could not load tiny qwen2: the checkpoint is damaged. tiny llama was "
        "unloaded to free "
        "the GPU; load it again from the Models tab."
    )
    assert not host.ready and host.label == ""


def test_the_status_line_counts_the_seconds_of_a_load():
    import time

    from app.model_host import LoadState

    host = ModelHost()
    host.state = LoadState("loading", "Loading Qwen3-0.6B…", "Qwen/Qwen3-0.6B", {}, time.time() - 42.2)
    assert host.status_message() == "Loading Qwen3-0.6B… 42 s so far."
    host.state = LoadState(
        "ready", "Qwen3-0.6B is ready on cuda (bfloat16, context 40,960 tokens, 9,000 KV blocks) after 61 s."
    )
    assert host.status_message() == host.state.message


def test_an_engine_that_crashes_mid_reply_is_shown_and_the_model_loads_again(host, tiny_llama, tmp_path):
    """A step that raises: the chat keeps what streamed and says the engine failed, the next message is
    refused with the same words, the status line tells the user to load the model again, and loading it
    brings the chats back."""
    from app.store import ConversationStore
    from app.ui import PagodaUI

    greedy = [0.0, 1.0, -1, 0.0, 1.0]  # temperature, top_p, top_k, min_p, repetition_penalty
    ui = PagodaUI(ConversationStore(tmp_path / "chats.db"), host)
    engine = host.engine.engine
    steps, real_step = [0], engine.step

    def step_that_fails_third():  # the prefill and one decode stream two tokens, then the device fails
        steps[0] += 1
        if steps[0] == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_step()

    engine.step = step_that_fails_third
    conv = ui.store.create().id
    *_, last = ui.respond(conv, "Tell me a story.", "", *greedy, 200, None)
    shown = last[0][-1]["content"]
    assert "stopped: the engine failed (RuntimeError: CUDA error" in shown
    reply = ui.store.messages(conv)[-1]
    assert reply.role == "assistant" and reply.content and shown.startswith(reply.content)  # the partial reply
    assert "the engine failed" in reply.meta["error"]  # kept with the reply, for when the chat is opened again

    *_, refused = ui.respond(conv, "Are you there?", "", *greedy, 16, None)
    assert "the engine failed" in refused[2]["value"] and "load the model again" in refused[2]["value"]
    assert host.status_message().startswith("tiny llama stopped: the engine failed")
    assert "Load the model again" in host.status_message()

    host.load(str(tiny_llama), label="tiny llama", wait=True, **SETTINGS)
    assert host.state.status == "ready" and host.status_message() == host.state.message
    *_, last = ui.respond(conv, "Are you there now?", "", *greedy, 8, None)
    reply = ui.store.messages(conv)[-1]
    assert reply.role == "assistant" and reply.content and "error" not in reply.meta
    assert reply.meta["finish_reason"] in ("stop", "length")
