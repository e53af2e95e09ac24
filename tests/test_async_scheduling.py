"""Asynchronous scheduling: each step is launched before the previous one is read back.

On a GPU that overlaps the host's work with the device's. On the CPU nothing overlaps, but the
bookkeeping is the same (pending tokens, inputs taken from the previous step's samples, late
stops, blocks registered at launch unless their last token is pending), so here it is forced on
and must give exactly the outputs of the synchronous engine, with every feature that meets it.
"""

import pytest

from engine import LLM, SamplingParams


def outputs(results: list[dict]) -> list[tuple]:
    """What a caller reads. (How many prompt tokens the cache served may differ: preempted requests
    are readmitted a step later when their token is in flight.)"""
    return [(r["text"], r["token_ids"], r["finish_reason"]) for r in results]


def run_both(path, prompts, params, **settings):
    """generate() with async scheduling off and on; returns both outputs and the async engine."""
    results, engine = [], None
    for mode in (False, True):
        llm = LLM(str(path), **{"dtype": "float32", "num_kvcache_blocks": 64, **settings, "async_scheduling": mode})
        results.append(llm.generate(prompts, params, use_tqdm=False))
        engine = llm
    return [outputs(r) for r in results], engine


def assert_clean(llm):
    """Nothing left running, and every block back in the free pool. A step launched for requests
    that had finished by then may still be in flight: reading it back yields nothing."""
    if llm.has_unfinished_requests():
        assert llm.step() == []
    assert not llm.has_unfinished_requests() and not llm.scheduler.running and not llm.scheduler.waiting
    assert all(b.ref_count == 0 for b in llm.block_manager.blocks)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_greedy_batch_with_eos_and_mixed_lengths(tiny_qwen2, random_prompt):
    prompts = [random_prompt(n, seed) for seed, n in enumerate([5, 17, 33, 48, 9, 64])]
    params = [
        SamplingParams(temperature=0, max_tokens=m, ignore_eos=(i % 2 == 0))
        for i, m in enumerate([1, 2, 7, 30, 45, 12])
    ]
    (sync, asyn), llm = run_both(tiny_qwen2, prompts, params)
    assert asyn == sync
    assert [len(ids) for _, ids, _ in sync][::2] == [1, 7, 45]  # ignore_eos rows run to max_tokens
    assert_clean(llm)


def test_stop_strings_stop_tokens_and_sampling_options(tiny_qwen2, random_prompt):
    """A stop found one step late must not leak the extra step's token into the output."""
    probe = LLM(str(tiny_qwen2), dtype="float32", num_kvcache_blocks=64)
    prompt = random_prompt(20, 7)
    free_run = probe.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[
        0
    ]
    stop_token = free_run["token_ids"][10]
    stop_text = free_run["text"][len(free_run["text"]) // 2 :][:3]
    params = [
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_token], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, stop=[stop_text], ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=11, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, seed=5, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=24, ignore_eos=True),
    ]
    (sync, asyn), llm = run_both(tiny_qwen2, [prompt] * len(params), params)
    assert asyn == sync
    assert sync[0][2] == "stop" and sync[0][1][-1] == stop_token
    assert sync[1][2] == "stop" and stop_text not in sync[1][0]
    assert_clean(llm)


def test_chunked_prefill_and_a_shared_prefix(tiny_qwen2, random_prompt):
    system = random_prompt(40, 1)
    prompts = [system + random_prompt(n, 10 + n) for n in (3, 21, 50, 8)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    (sync, asyn), llm = run_both(tiny_qwen2, prompts, params, max_num_batched_tokens=24)
    assert asyn == sync
    assert llm.block_manager.prefix_cache_hits > 0  # blocks registered one step late still serve later requests
    assert_clean(llm)


def test_the_next_turn_hits_every_full_block_of_the_answer(tiny_qwen2, random_prompt):
    """The answer's last computed token completes a block, and was pending when the last step
    launched: its block is registered once the token is read back, as in the synchronous engine."""
    prompt = random_prompt(20, 5)
    params = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)  # 20 + 13 - 1 = 32 tokens computed
    for mode in (False, True):
        llm = LLM(str(tiny_qwen2), dtype="float32", num_kvcache_blocks=64, async_scheduling=mode)
        answer = llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"]
        follow_up = llm.generate([prompt + answer + [7, 8]], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        assert follow_up["num_cached_tokens"] == 32, f"async_scheduling={mode}"


def test_preemption_with_tokens_in_flight(tiny_qwen2, random_prompt, monkeypatch):
    """A request preempted while its token is still on the device keeps that token and is
    recomputed with it."""
    prompts = [random_prompt(30 + 5 * i, 40 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    sync = LLM(str(tiny_qwen2), dtype="float32", num_kvcache_blocks=64).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_qwen2), dtype="float32", num_kvcache_blocks=20, async_scheduling=True)
    pending_at_preemption = []
    preempt = llm.scheduler._preempt

    def recording_preempt(seq):
        pending_at_preemption.append(seq.num_pending_tokens)
        preempt(seq)

    monkeypatch.setattr(llm.scheduler, "_preempt", recording_preempt)
    assert outputs(llm.generate(prompts, params, use_tqdm=False)) == outputs(sync)
    assert any(pending_at_preemption), pending_at_preemption
    assert_clean(llm)


def test_step_returns_the_previous_steps_outputs(tiny_qwen2, random_prompt):
    llm = LLM(str(tiny_qwen2), dtype="float32", num_kvcache_blocks=64, async_scheduling=True)
    rid = llm.add_request(random_prompt(12, 3), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert llm.step() == []  # the prefill is launched; nothing has been read back yet
    first = llm.step()
    assert [o.request_id for o in first] == [rid] and len(first[0].new_token_ids) == 1
    llm.step()
    assert llm.has_unfinished_requests()  # the last token is still to be read back
    last = llm.step()
    assert last[0].finished and last[0].finish_reason == "length" and len(last[0].token_ids) == 3
    assert not llm.has_unfinished_requests()
    assert_clean(llm)


def test_a_length_limit_launches_no_extra_step(tiny_qwen2, random_prompt, monkeypatch):
    llm = LLM(str(tiny_qwen2), dtype="float32", num_kvcache_blocks=64, async_scheduling=True)
    sampled_for: dict[str, int] = {}
    launch = llm.model_runner.launch

    def counting_launch(batch):
        for item in batch:
            if item.samples:
                sampled_for[item.seq.request_id] = sampled_for.get(item.seq.request_id, 0) + 1
        return launch(batch)

    monkeypatch.setattr(llm.model_runner, "launch", counting_launch)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 4, 9)]
    out = llm.generate([random_prompt(10, s) for s in range(3)], params, use_tqdm=False)
    assert [len(o["token_ids"]) for o in out] == [1, 4, 9]
    assert sorted(sampled_for.values()) == [1, 4, 9]


def test_abort_while_a_step_is_in_flight(tiny_qwen2, random_prompt):
    llm = LLM(str(tiny_qwen2), dtype="float32", num_kvcache_blocks=64, async_scheduling=True)
    keep = llm.add_request(random_prompt(10, 1), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    drop = llm.add_request(random_prompt(10, 2), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    llm.step()
    llm.step()
    assert llm.abort_request(drop)  # its next token is on the device right now
    seen = []
    while llm.has_unfinished_requests():
        seen += [o.request_id for o in llm.step()]
    assert drop not in seen and keep in seen
    assert_clean(llm)


def test_async_scheduling_is_off_on_the_cpu_by_default_and_refused_with_tensor_parallel(tiny_qwen2):
    assert LLM(str(tiny_qwen2), dtype="float32", num_kvcache_blocks=16).async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling does not work with tensor_parallel_size"):
        LLM(str(tiny_qwen2), async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="async_scheduling must be"):
        LLM(str(tiny_qwen2), async_scheduling="yes")


def test_scheduler_plans_around_pending_tokens():
    """The scheduler on its own: a pending token is the next step's input, a request whose pending
    token is its last gets no step, and a preempted request waits for its pending token."""
    from engine.core.block_manager import BlockManager
    from engine.core.scheduler import Scheduler
    from engine.core.sequence import Sequence

    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    short, long = Sequence([1, 2, 3], SamplingParams(max_tokens=1)), Sequence([1, 2, 3], SamplingParams(max_tokens=5))
    for s in (short, long):
        sched.add(s)
    for item in sched.schedule():  # as the engine does when it launches a step
        item.seq.num_computed_tokens += item.num_new_tokens
        item.seq.num_pending_tokens += item.samples
    # Both tokens are still on the device: `long` decodes its pending token; `short` is at its limit.
    assert [(x.seq, x.num_new_tokens, x.samples) for x in sched.schedule()] == [(long, 1, True)]

    sched.running.remove(long)  # as if preempted with its token in flight
    bm.free(long)
    sched.waiting.insert(0, long)
    assert sched.schedule() == []  # `short` waits for its token; `long` may not be prefilled yet
    long.token_ids.append(9)  # the token is read back
    long.num_pending_tokens = 0
    assert [(x.seq, x.num_new_tokens) for x in sched.schedule()] == [(long, 4)]


def check_invariants(llm) -> None:
    """Ref counts equal the running requests' uses; a registered block holds its request's real
    tokens; the hash index points at blocks holding those hashes; at most one token is pending."""
    bm, bs = llm.block_manager, llm.block_manager.block_size
    uses: dict[int, int] = {}
    for seq in llm.scheduler.running:
        for block_id in seq.block_table:
            uses[block_id] = uses.get(block_id, 0) + 1
        assert seq.num_registered_blocks * bs <= len(seq.token_ids)
        for i in range(seq.num_registered_blocks):
            block = bm.blocks[seq.block_table[i]]
            if block.hash is not None:
                assert block.token_ids == tuple(seq.token_ids[i * bs : (i + 1) * bs])
        assert seq.num_pending_tokens in (0, 1)
    assert all(b.ref_count == uses.get(b.block_id, 0) for b in bm.blocks)
    assert all(bm.blocks[block_id].hash == h for (_, h), block_id in bm.hash_to_block_id.items())


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("trial", range(3))
def test_random_online_traffic_keeps_the_cache_consistent(tiny_qwen2, async_scheduling, trial):
    """Requests arrive and are aborted at random steps; many prompts continue earlier answers (prefix
    hits), the cache is small (preemption) and the budget tight (chunked prefill). The invariants
    hold after every step, and every answer equals the same prompt run alone."""
    import random

    rng = random.Random(100 + trial)
    alone = LLM(
        str(tiny_qwen2), dtype="float32", num_kvcache_blocks=200, kvcache_block_size=4, enable_prefix_caching=False
    )
    llm = LLM(
        str(tiny_qwen2),
        dtype="float32",
        num_kvcache_blocks=rng.choice([18, 22, 30]),
        kvcache_block_size=4,
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        max_num_seqs=rng.choice([2, 4, 8]),
        async_scheduling=async_scheduling,
    )
    base = [rng.randrange(3, 320) for _ in range(rng.randint(4, 20))]
    conversations, live, done = [], {}, {}

    def take(outputs):
        for out in outputs:
            assert out.request_id in live, f"output for {out.request_id}, which is finished or aborted"
            live[out.request_id][2].extend(out.new_token_ids)
            if out.finished:
                prompt, params, tokens = live.pop(out.request_id)
                assert tokens == out.token_ids
                done[out.request_id] = (prompt, params, tokens)
                conversations.append(prompt + tokens)

    for _ in range(60):
        if rng.random() < 0.45:
            start = rng.choice(conversations) if conversations and rng.random() < 0.6 else base
            prompt = (start + [rng.randrange(3, 320) for _ in range(rng.randint(0, 6))])[:60]
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.5)
            live[llm.add_request(prompt, params)] = (prompt, params, [])
        if live and rng.random() < 0.08:
            aborted = rng.choice(list(live))
            llm.abort_request(aborted)
            live.pop(aborted)
        take(llm.step())
        check_invariants(llm)
    while llm.has_unfinished_requests():
        take(llm.step())
        check_invariants(llm)
    assert not live and len(done) >= 5
    for prompt, params, tokens in done.values():
        assert tokens == alone.generate([prompt], params, use_tqdm=False)[0]["token_ids"]
