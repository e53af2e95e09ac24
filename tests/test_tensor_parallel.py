"""Tensor parallelism on CPU (gloo): N ranks give the same greedy tokens as one, each holds 1/N of
the weights, and the worker processes never outlive their engine."""

import gc
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.runner.distributed import TPGroup, check_tensor_parallel

FAMILIES = ["llama", "qwen2", "qwen3", "phi3"]  # phi3: fused q/k/v and gate/up split per rank
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# A small token budget splits the long prompt into chunks, so steps mix prefill chunks and decodes.
SETTINGS = dict(dtype="float32", num_kvcache_blocks=64, max_num_batched_tokens=32)


def prompts(random_prompt) -> list[list[int]]:
    return [random_prompt(n, seed) for seed, n in enumerate((5, 17, 40, 1))]


def greedy_ids(llm, batch, params=GREEDY) -> list[list[int]]:
    return [out["token_ids"] for out in llm.generate(batch, params, use_tqdm=False)]


def process_gone(pid: int) -> bool:
    """No such process, or only its zombie (PID 1 in a container may never reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def wait_gone(pids: list[int], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(process_gone(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def tp2_engines(tiny_models):
    """A TP=2 engine per family, all alive at once in this process."""
    engines = {f: LLM(str(tiny_models[f]), tensor_parallel_size=2, **SETTINGS) for f in FAMILIES}
    yield engines
    for llm in engines.values():
        llm.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_greedy_tokens_equal_tp1(family, tiny_models, tp2_engines, random_prompt):
    batch = prompts(random_prompt)
    expected = greedy_ids(LLM(str(tiny_models[family]), **SETTINGS), batch)
    assert greedy_ids(tp2_engines[family], batch) == expected
    # Again, now from the prefix cache: the cached KV blocks are the same on both ranks.
    assert greedy_ids(tp2_engines[family], batch) == expected


def test_two_tp_engines_in_one_process_do_not_collide(tiny_models, tp2_engines, random_prompt):
    a, b = tp2_engines["llama"], tp2_engines["qwen2"]
    assert a.workers.store.port != b.workers.store.port
    assert not set(a.workers.pids) & set(b.workers.pids)
    batch = prompts(random_prompt)
    expected = {f: greedy_ids(LLM(str(tiny_models[f]), **SETTINGS), batch) for f in ("llama", "qwen2")}
    engines = {"llama": a, "qwen2": b}
    ids = {f: [e.add_request(p, GREEDY) for p in batch] for f, e in engines.items()}
    got: dict[str, dict[str, list[int]]] = {f: {} for f in engines}
    while a.has_unfinished_requests() or b.has_unfinished_requests():  # steps of the two engines interleave
        for family, engine in engines.items():
            for out in engine.step():
                got[family].setdefault(out.request_id, []).extend(out.new_token_ids)
    for family in engines:
        assert [got[family][i] for i in ids[family]] == expected[family]


def test_each_rank_holds_half_the_weights(tiny_models, tp2_engines):
    for family in ("llama", "qwen2"):
        whole = LLM(str(tiny_models[family]), **SETTINGS).parameter_bytes()
        per_rank = tp2_engines[family].parameter_bytes()
        assert len(whole) == 1 and len(per_rank) == 2
        for b in per_rank:  # only the norms are not split
            assert abs(b / whole[0] - 0.5) < 0.02, (family, b, whole)


def test_a_head_count_that_does_not_divide_is_refused_before_spawning(tiny_llama):
    before = set(mp.active_children())
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by 3.*one of \[1, 2, 4\]"):
        LLM(str(tiny_llama), tensor_parallel_size=3, **SETTINGS)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a whole number >= 1"):
        LLM(str(tiny_llama), tensor_parallel_size=0, **SETTINGS)
    assert set(mp.active_children()) == before


def test_more_ranks_than_gpus_is_refused(tiny_llama, monkeypatch):
    from transformers import AutoConfig

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 2 GPUs, but torch sees 1"):
        check_tensor_parallel(2, AutoConfig.from_pretrained(tiny_llama), torch.device("cuda"))


def test_a_vocabulary_that_does_not_divide_is_padded_on_the_last_rank():
    vocab, dim = 10, 4  # three ranks of 4 rows: the last holds rows 8 and 9, then 2 rows of padding
    table, hidden, ids = torch.randn(vocab, dim), torch.randn(3, dim), torch.arange(vocab)

    class Alone(TPGroup):  # one rank seen alone; the test does the collectives by hand
        def all_reduce(self, x):
            return x

        def gather(self, x):
            return [F.linear(hidden, head.weight) for head in heads]

    def shard(cls, rank):
        layer = cls(vocab, dim, Alone(rank, 3))
        layer.load_weight(layer.weight, table)
        return layer

    embeds = [shard(VocabParallelEmbedding, r) for r in range(3)]
    assert torch.equal(sum(e(ids) for e in embeds), F.embedding(ids, table))
    heads = [shard(ParallelLMHead, r) for r in range(3)]
    assert heads[2].weight[2:].abs().sum() == 0
    torch.testing.assert_close(heads[0](hidden), F.linear(hidden, table))


def test_tp1_makes_no_distributed_calls(tiny_llama, random_prompt, monkeypatch):
    def refuse(*args):
        raise AssertionError("a collective was called with tensor_parallel_size=1")

    batch = prompts(random_prompt)
    expected = greedy_ids(LLM(str(tiny_llama), **SETTINGS), batch)
    for name in ("all_reduce", "gather", "min"):
        monkeypatch.setattr(TPGroup, name, refuse)
    llm = LLM(str(tiny_llama), **SETTINGS)
    assert llm.workers is None
    got = greedy_ids(llm, batch)
    assert got == expected and [len(ids) for ids in got] == [GREEDY.max_tokens] * len(batch)


# ---- the bundled SmolLM2-135M: 9 heads, 3 KV heads, tied embeddings -------------------------------
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer tersely."}, {"role": "user", "content": "List three colours."}],
]


@pytest.mark.timeout(900)  # builds the bundled model when it runs first, then three processes load it
def test_smollm2_tp3_greedy_tokens_and_weight_shares(bundled_model):
    settings = dict(dtype="float32", device="cpu", num_kvcache_blocks=32)
    whole = LLM(str(bundled_model), **settings)
    batch = [
        whole.tokenizer.encode(
            whole.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False), add_special_tokens=False
        )
        for c in CHATS
    ]
    params = SamplingParams(temperature=0, max_tokens=20)
    expected = greedy_ids(whole, batch, params)
    llm = LLM(str(bundled_model), tensor_parallel_size=3, **settings)
    try:
        assert greedy_ids(llm, batch, params) == expected
        assert "Paris" in whole.tokenizer.decode(expected[0])
        per_rank, total = llm.parameter_bytes(), whole.parameter_bytes()[0]
        assert len(per_rank) == 3
        for b in per_rank:
            assert abs(b / total - 1 / 3) < 0.005, (per_rank, total)
        assert llm.stats().num_blocks == 32
    finally:
        llm.close()


# ---- lifecycle ------------------------------------------------------------------------------------
def test_close_and_garbage_collection_end_the_workers(tiny_llama, random_prompt):
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, **SETTINGS)
    pids = llm.workers.pids
    llm.close()
    assert wait_gone(pids, 5)
    llm.close()  # a second close is harmless
    with pytest.raises(RuntimeError, match="closed; create a new LLM"):
        llm.generate(prompts(random_prompt), GREEDY, use_tqdm=False)

    llm = LLM(str(tiny_llama), tensor_parallel_size=2, **SETTINGS)
    pids = llm.workers.pids
    del llm
    gc.collect()
    assert wait_gone(pids, 15)


def test_the_engine_thread_serves_a_tp_engine_and_shutdown_ends_its_workers(tiny_llama, random_prompt):
    from engine import EngineThread

    thread = EngineThread(LLM(str(tiny_llama), tensor_parallel_size=2, **SETTINGS))
    pids = thread.engine.workers.pids
    outs = list(thread.submit(prompts(random_prompt)[0], GREEDY))
    assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == GREEDY.max_tokens
    thread.shutdown()  # what the app does when it unloads a model
    assert wait_gone(pids, 5)


def test_a_crashed_worker_is_a_clear_error_not_a_hang(tiny_llama, random_prompt):
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, **SETTINGS)
    os.kill(llm.workers.pids[0], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel worker rank 1 exited unexpectedly \(exit code -9\)"):
        llm.generate(prompts(random_prompt), GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 30
    with pytest.raises(RuntimeError, match="create a new LLM"):  # and it stays an error
        llm.generate(prompts(random_prompt), GREEDY, use_tqdm=False)


PARENT = """
import sys, time
from engine import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", num_kvcache_blocks=16)
print(*llm.workers.pids, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_exit_when_the_parent_is_killed(tiny_llama):
    root = Path(__file__).resolve().parents[1]
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tiny_llama)], cwd=root, stdout=subprocess.PIPE, text=True
    )
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 1 and not process_gone(pids[0])
    finally:
        parent.kill()
        parent.wait()
    assert wait_gone(pids, 10)


# ---- a worker that fails in the middle of a step ----------------------------------------------------
class RaiseOnLoad:
    """Unpickled by a worker at the start of its step, it raises there: rank 0, already in the step's
    forward pass, waits in a collective the worker never joins."""

    def __reduce__(self):
        return int, ("a worker's step failed here",)


class ExitOnLoad:
    """Unpickled by a worker at the start of its step, it ends the worker process at once (exit code 3)."""

    def __reduce__(self):
        return os._exit, (3,)


def poison_next_step(llm, poison) -> None:
    """The next step's message to the workers carries `poison`; rank 0 runs its share of the step as usual."""
    pool = llm.workers
    send = pool.send_step

    def send_poisoned(step):
        pool.send_step = send
        send((poison, step))

    pool.send_step = send_poisoned


def step_in_thread(llm) -> BaseException | None:
    """One engine step, on a thread joined with a generous bound: a step that never returns is a hang."""
    failure: list[BaseException] = []

    def run():
        try:
            llm.step()
        except BaseException as e:
            failure.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "rank 0 still waits in a collective after its worker failed"
    return failure[0] if failure else None


@pytest.mark.parametrize(
    "poison, says",
    [
        (
            RaiseOnLoad(),
            r"tensor-parallel worker rank 1 failed:\n.*ValueError: invalid literal for int\(\) with base 10: "
            r"\"a worker's step failed here\".*create a new LLM",
        ),
        (ExitOnLoad(), r"tensor-parallel worker rank 1 exited unexpectedly \(exit code 3\).*create a new LLM"),
    ],
    ids=["raises", "dies"],
)
def test_a_worker_failing_mid_step_is_a_clear_error_and_no_hang(tiny_llama, random_prompt, poison, says):
    from engine.runner.tp_workers import WorkerError

    llm = LLM(str(tiny_llama), tensor_parallel_size=2, **SETTINGS)
    pids = llm.workers.pids
    try:
        for p in prompts(random_prompt):
            llm.add_request(p, GREEDY)
        assert step_in_thread(llm) is None  # mid-generation: a step went through on both ranks
        poison_next_step(llm, poison)
        error = step_in_thread(llm)
        assert isinstance(error, WorkerError), error
        assert re.search(says, str(error), re.S), str(error)
        with pytest.raises(RuntimeError, match="create a new LLM"):  # and it stays an error
            llm.generate(prompts(random_prompt), GREEDY, use_tqdm=False)
        assert wait_gone(pids, 30)  # no worker is left waiting in the collective
    finally:
        llm.close()


def test_a_worker_dying_mid_stream_ends_the_engine_threads_streams(tiny_llama, random_prompt):
    from engine import EngineFailed, EngineThread

    thread = EngineThread(LLM(str(tiny_llama), tensor_parallel_size=2, **SETTINGS))
    try:
        stream = iter(
            thread.submit(prompts(random_prompt)[2], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        )
        assert next(stream).new_token_ids
        poison_next_step(thread.engine, ExitOnLoad())
        with pytest.raises(
            EngineFailed,
            match=r"the engine failed \(WorkerError: tensor-parallel worker rank 1 "
            r"exited unexpectedly \(exit code 3\)",
        ):
            for _ in stream:
                pass
        with pytest.raises(EngineFailed, match="load the model again"):
            thread.submit(prompts(random_prompt)[0], GREEDY)
    finally:
        thread.shutdown()
