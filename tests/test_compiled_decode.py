"""Compiled CPU decode steps (engine/runner/compiled_decode.py): the same tokens as transformers and as the
eager steps, through block boundaries, batches of mixed lengths, preemption and the prefix cache;
the rule for what a trace may assume; and the eager steps taking over whenever a graph cannot be
trusted or is not faster."""

import logging
import os
import sys
import threading
import time

import pytest
import sympy
import torch

from engine import SamplingParams
from engine.runner import compiled_decode as cd
from engine.runner.tracing import tracing_decode_step
from tests.test_parity import hf_greedy

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]  # mistral: a 12-token sliding window; gemma3: mixed
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture
def compiling(monkeypatch):
    monkeypatch.setenv(cd.ENV_SWITCH, "1")  # the suite's conftest turns compiling off for every other test


@pytest.fixture
def compiled_llm(make_llm):
    """`compiled_llm(path, **settings)`: make_llm's engine once its decode steps have compiled (or not)."""

    def make(path, **settings):
        llm = make_llm(path, **settings)
        assert llm.model_runner.wait_for_compiled_decode(timeout=600)
        return llm

    return make


def calls(llm) -> dict[str, int]:
    return {name: g.calls for name, g in llm.model_runner.compiled_decode.graphs.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers_alone_and_batched(
    compiling, family, tiny_models, compiled_llm, hf_model, random_prompt
):
    llm = compiled_llm(tiny_models[family], max_num_seqs=4)
    assert llm.stats().decode == "compiled (1 row, 2-4 rows)"
    # 40 new tokens cross two or three 16-token blocks; batched, the rows have different lengths.
    prompts = [random_prompt(n, seed) for n, seed in ((5, 1), (19, 2), (33, 3))]
    expected = [hf_greedy(hf_model(tiny_models[family]), p, GREEDY.max_tokens) for p in prompts]
    before = calls(llm)
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0]["token_ids"] for p in prompts]
    together = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert alone == expected
    assert together == expected
    after = calls(llm)
    # Every decode step ran compiled: 39 per request alone (the first token comes from the prefill), and
    # batched every step until the rows finish together.
    assert after["one row"] - before["one row"] == 3 * 39
    assert after["rows"] - before["rows"] == 39


def test_preemption_and_prefix_cache_under_compiled_steps(compiling, tiny_llama, compiled_llm, hf_model, random_prompt):
    """KV written by compiled steps is what preempted requests recompute over and what later requests
    share: the same tokens as transformers, with preemptions and prefix hits both happening."""
    system = random_prompt(32, 7)  # two full blocks every request shares
    prompts = [system + random_prompt(6 + i, 10 + i) for i in range(4)]
    expected = [hf_greedy(hf_model(tiny_llama), p, GREEDY.max_tokens) for p in prompts]
    llm = compiled_llm(tiny_llama, max_num_seqs=4, num_kvcache_blocks=12)  # 4 requests of 5 blocks: too few
    got = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    stats = llm.stats()
    assert got == expected
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert calls(llm)["rows"] > 0


def test_quantized_model_matches_its_eager_steps(
    compiling, monkeypatch, tiny_qwen2, make_llm, compiled_llm, random_prompt
):
    """int4 weights (PyTorch's int4 kernel inside the graph): tokens equal to the eager engine's, and
    the sampled tokens' logprobs within bf16 rounding of them."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    prompts = [random_prompt(9, 4), random_prompt(21, 5)]
    compiled = compiled_llm(tiny_qwen2, quantization="int4", max_num_seqs=2)
    assert compiled.stats().decode == "compiled (1 row, 2-2 rows)"
    got = compiled.generate(prompts, params, use_tqdm=False)
    monkeypatch.setenv(cd.ENV_SWITCH, "0")
    eager = make_llm(tiny_qwen2, quantization="int4", max_num_seqs=2)
    assert eager.stats().decode == "eager"
    want = eager.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g["token_ids"] == w["token_ids"]
        for g_lp, w_lp, token in zip(g["logprobs"], w["logprobs"], g["token_ids"], strict=True):
            assert g_lp[token] == pytest.approx(w_lp[token], abs=2e-2)


def test_eager_when_told(tiny_llama, make_llm, monkeypatch):
    monkeypatch.setenv(cd.ENV_SWITCH, "1")
    assert make_llm(tiny_llama, enforce_eager=True).stats().decode == "eager"
    monkeypatch.setenv(cd.ENV_SWITCH, "0")
    llm = make_llm(tiny_llama)
    assert llm.stats().decode == "eager"
    assert llm.model_runner.compiled_decode is None


def test_a_failed_compile_leaves_eager_steps_serving(
    compiling, monkeypatch, tiny_llama, compiled_llm, hf_model, random_prompt, caplog
):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("Compiler: cc is not found")

    monkeypatch.setattr(cd, "capture", no_compiler)
    with caplog.at_level(logging.WARNING, logger="engine"):
        llm = compiled_llm(tiny_llama)
    assert llm.stats().decode == "eager (compile failed)"
    assert "compiling them failed (Compiler: cc is not found)" in caplog.text
    prompt = random_prompt(11, 8)
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(hf_model(tiny_llama), prompt, 40)


def test_a_graph_that_disagrees_with_eager_is_not_used(compiling, monkeypatch, tiny_llama, compiled_llm):
    real = cd.eager_forward
    monkeypatch.setattr(cd, "eager_forward", lambda *args: real(*args) + 1.0)
    llm = compiled_llm(tiny_llama, max_num_seqs=2)
    assert llm.stats().decode == "eager"
    assert llm.model_runner.compiled_decode is None


def test_a_graph_slower_than_eager_is_not_kept(compiling, monkeypatch, tiny_llama, compiled_llm):
    real = cd.DecodeGraph.__call__

    def slow(self, args):
        time.sleep(0.05)  # far beyond a tiny model's eager step
        return real(self, args)

    monkeypatch.setattr(cd.DecodeGraph, "__call__", slow)
    assert compiled_llm(tiny_llama, max_num_seqs=2).stats().decode == "eager"


def test_what_a_trace_may_assume_about_its_sizes():
    rows_a, rows_b, blocks = sympy.symbols("s0 s1 s2", integer=True, positive=True)
    hints = {rows_a: cd._TRACE_ROWS, rows_b: cd._TRACE_ROWS, blocks: cd._TRACE_BLOCKS}
    # That two inputs have the same rows, or that there are at least 2 blocks, holds for every step.
    cd._check_guards([sympy.Eq(rows_a, rows_b), sympy.Ge(blocks, 2)], hints, max_rows=256)
    with pytest.raises(cd.CaptureRefused, match="false at 256 rows"):  # a branch that holds below 128 rows only
        cd._check_guards([sympy.Lt(rows_a, 128)], hints, max_rows=256)
    with pytest.raises(cd.CaptureRefused, match="false at 2 rows and 1024 blocks"):
        cd._check_guards([sympy.Lt(blocks, 100)], hints, max_rows=256)
    with pytest.raises(cd.CaptureRefused, match="other than the rows and blocks"):
        other = sympy.Symbol("s9", integer=True)
        cd._check_guards([sympy.Eq(other, 5)], {**hints, other: 5}, max_rows=256)


@torch.inference_mode()
def test_a_captured_graph_is_called_with_each_steps_tensors_and_sizes(tiny_llama, make_llm):
    """The calling plan: weights and KV tensors fixed, the step tensors and both sizes filled in per
    call, so a step of other sizes than the traced ones gives the eager step's logits."""
    llm = make_llm(tiny_llama, max_num_seqs=8)  # eager (the conftest's switch): this test captures its own
    model, block_size = llm.model_runner.model, llm.model_runner.block_size
    graph = cd.capture(
        model, cd.example_args(cd._TRACE_ROWS, cd._TRACE_BLOCKS, block_size, 0), dynamic_rows=True, max_rows=8
    )
    assert {name for _, name in graph.size_slots} == {"rows", "blocks"}
    assert sorted(index for _, index in graph.step_slots) == list(range(6))
    args = cd.example_args(5, 4, block_size, 1)
    torch.testing.assert_close(graph(args), cd.eager_forward(model, *args), rtol=1e-4, atol=1e-4)


def stepped(llm, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of `prompts`, through add_request and step as the online front drives the engine."""
    ids = [llm.add_request(p, GREEDY) for p in prompts]
    got = {i: [] for i in ids}
    while llm.has_unfinished_requests():
        for out in llm.step():
            got[out.request_id] += out.token_ids
    return [got[i] for i in ids]


def test_requests_run_eagerly_and_correctly_while_the_steps_compile(
    compiling, monkeypatch, tiny_qwen2, make_llm, hf_model, random_prompt
):
    """The load returns before the compiler is done; the engine's own steps run beside the trace (both
    through the same layers), and the graphs take over once ready, with the scratch block untouched
    by any request."""
    tracing = threading.Event()
    real_capture = cd.capture

    def capture(*args, **kwargs):
        tracing.set()
        return real_capture(*args, **kwargs)

    monkeypatch.setattr(cd, "capture", capture)
    llm = make_llm(tiny_qwen2, max_num_seqs=4)
    runner = llm.model_runner
    assert tracing.wait(60)
    prompts = [random_prompt(13 + i, 20 + i) for i in range(3)]
    expected = [hf_greedy(hf_model(tiny_qwen2), p, GREEDY.max_tokens) for p in prompts]
    assert stepped(llm, prompts) == expected
    assert runner.wait_for_compiled_decode(timeout=600)
    assert llm.stats().decode == "compiled (1 row, 2-4 rows)"
    assert runner.scratch_block == runner.num_blocks == llm.stats().num_blocks  # the cache holds one block more
    assert runner.attention_layers[0].k_cache.shape[0] == runner.num_blocks + 1
    assert stepped(llm, prompts) == expected
    assert calls(llm)["rows"] > 7  # beyond the load's measurement


def test_the_compile_stops_while_the_engine_has_requests(compiling, monkeypatch, tiny_llama, make_llm):
    """Beside the engine's steps, the compiling thread took the GIL for up to 5 ms at a time, hundreds of times a
    step: an 8B file's first prefill took 6.6-8 s instead of about 3 (runner/background.py). Now it stops at its
    next Python call while any request is unfinished, and compiles on once none is."""
    from tests.processes import wait_until

    at_capture, go, captured = threading.Event(), threading.Event(), []
    real_capture = cd.capture

    def mark_started():  # a Python call: where the thread stops, once told to go while the engine is busy
        captured.append("started")

    def capture(*args, **kwargs):
        at_capture.set()
        go.wait(60)
        mark_started()
        return real_capture(*args, **kwargs)

    monkeypatch.setattr(cd, "capture", capture)
    llm = make_llm(tiny_llama)
    activity = llm.model_runner.engine_activity
    assert at_capture.wait(120) and not activity.busy
    request = llm.add_request([1, 2, 3], GREEDY)
    assert activity.busy
    go.set()
    assert wait_until(lambda: activity.pauses > 0, timeout=60)
    for _ in range(3):
        llm.step()
    assert captured == [] and llm.has_unfinished_requests()  # it has not got past its next call
    llm.abort_request(request)
    assert not activity.busy
    assert llm.model_runner.wait_for_compiled_decode(timeout=600) and captured[0] == "started"  # a capture per graph
    assert llm.stats().decode.startswith("compiled")


def test_eager_steps_ignore_another_threads_trace(monkeypatch, tiny_llama, make_llm, hf_model, random_prompt):
    """While the background thread traces, torch.compiler.is_compiling() is True for the whole process;
    the engine's eager steps must still take the eager branches (a prefill through the decode-only
    attention raised). Only the tracing thread's own flag switches the layers."""
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)  # as while another thread traces
    assert torch.compiler.is_compiling()
    llm = make_llm(tiny_llama)  # eager (the conftest's switch)
    prompts = [random_prompt(19, 30), random_prompt(7, 31)]
    expected = [hf_greedy(hf_model(tiny_llama), p, GREEDY.max_tokens) for p in prompts]
    assert stepped(llm, prompts) == expected
    held, release, seen = threading.Event(), threading.Event(), []

    def trace_in_another_thread():
        with cd.decode_step_trace():
            seen.append(tracing_decode_step())
            held.set()
            release.wait(60)

    other = threading.Thread(target=trace_in_another_thread)
    other.start()
    assert held.wait(60)
    seen.append(tracing_decode_step())
    release.set()
    other.join()
    assert seen == [True, False]


def test_eager_steps_wait_out_a_window_in_which_fx_patches_every_module(
    compiling, monkeypatch, tiny_llama, make_llm, hf_model, random_prompt
):
    """While torch.fx traces, nn.Module.__call__ is its tracer's for the whole process; inductor traces so while it
    compiles (a cold compile of the bundled model's steps: 8.5 s of windows in 124 s). An engine step run in such a
    window raised "module is not installed as a submodule", and three servers on a busy machine died of it.
    Here the compiler is held inside a window until a step is waiting for it to close; the step then runs."""
    from torch._inductor import compile_fx as inductor

    from engine.runner.tracing import MODULE_CALLS
    from tests.processes import wait_until

    in_window, step_held_back = threading.Event(), []
    real_compile_fx = inductor.compile_fx

    def compile_fx(*args, **kwargs):
        def wait_inside(x):
            if not in_window.is_set():  # the first graph only
                in_window.set()
                step_held_back.append(wait_until(lambda: MODULE_CALLS.held_back > 0, timeout=60))
            return x

        torch.fx.symbolic_trace(wait_inside)  # as inductor's own codegen does (loop_body.py)
        return real_compile_fx(*args, **kwargs)

    # The reference runs before the compile starts: transformers' modules are not the engine's, and no guard
    # would keep them out of the window.
    prompts = [random_prompt(11, 40), random_prompt(6, 41)]
    expected = [hf_greedy(hf_model(tiny_llama), p, GREEDY.max_tokens) for p in prompts]
    monkeypatch.setattr(inductor, "compile_fx", compile_fx)
    llm = make_llm(tiny_llama, max_num_seqs=4)
    assert in_window.wait(120)
    assert stepped(llm, prompts) == expected  # its first step waited for the window to close
    assert step_held_back == [True]
    assert llm.model_runner.wait_for_compiled_decode(timeout=600)
    assert stepped(llm, prompts) == expected


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")
def test_the_compile_thread_and_its_workers_yield_to_the_engine():
    """The background compile runs at nice 19 (and whatever it starts inherits that), the engine's thread as before:
    at the same priority, a compile beside the first requests made a 4B file's first token 17 s on 2 cores."""
    seen = {}

    def compile_thread():
        cd.yield_to_the_engine()
        seen["compile"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        child = threading.Thread(target=lambda: seen.setdefault("started by it", os.getpriority(os.PRIO_PROCESS, 0)))
        child.start()
        child.join()

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    worker = threading.Thread(target=compile_thread)
    worker.start()
    worker.join()
    assert seen == {"compile": 19, "started by it": 19}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before < 19


@pytest.mark.parametrize("rounds", [False, True])
def test_a_graph_is_held_to_half_precisions_bound_where_a_kernel_rounds_its_input(monkeypatch, rounds):
    """Where a kernel rounds x to int8 per block, a graph that fuses the ops before it rounds some value to the next
    step: a random Qwen3-4B's logits moved by 4% of their largest through 36 layers. That graph is kept; in float32
    throughout, 4% is a wrong graph."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model[0].rounds_activations = rounds
    logits = torch.tensor([[4.9, 1.0, -2.0]])
    monkeypatch.setattr(cd, "eager_forward", lambda model, *args: logits)
    monkeypatch.setattr(cd, "_seconds_per_call", lambda fn: 1.0 if fn.__name__ == "eager" else 0.5)
    graph = lambda args: logits + torch.tensor([[0.19, -0.19, 0.0]])  # noqa: E731
    measured = cd.CompiledDecode.__new__(cd.CompiledDecode)
    measured.notes = []
    assert (measured._measure("one row", model, graph, ()) is graph) == rounds
