"""Continuous batching: preemption under a tight KV cache, sequence and token limits, progress.

Each test wraps `Scheduler.schedule` to see every batch the engine runs, along with the state
the scheduler started from.
"""

import pytest

from engine import SamplingParams
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus

MAX_STEPS = 2000


def greedy(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


class BatchLog:
    """Every schedule() call: (running decodes before the call, the batch as (request_id, n, samples))."""

    def __init__(self, llm, monkeypatch):
        self.steps = []
        self.recomputed = 0  # prefill chunks of requests that already have output: preempted ones coming back
        sched = llm.scheduler
        orig = sched.schedule

        def schedule():
            decoding = [s.request_id for s in sched.running if s.num_uncomputed_tokens == 1 and s.num_output_tokens > 0]
            batch = orig()
            self.recomputed += sum(item.num_new_tokens > 1 and item.seq.num_output_tokens > 0 for item in batch)
            self.steps.append(
                (
                    decoding,
                    [(item.seq.request_id, item.num_new_tokens, item.samples) for item in batch],
                    len(sched.running),
                )
            )
            return batch

        monkeypatch.setattr(sched, "schedule", schedule)


def drive(llm, prompts, params) -> dict[str, list[int]]:
    """Run requests through the online API with a bounded number of steps; request id -> output tokens."""
    ids = [llm.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    done: dict[str, list[int]] = {}
    for _ in range(MAX_STEPS):
        if not llm.has_unfinished_requests():
            break
        for out in llm.step():
            if out.finished:
                assert out.finish_reason == "length"
                done[out.request_id] = out.token_ids
    else:
        pytest.fail(f"no progress: {len(done)} of {len(ids)} requests finished after {MAX_STEPS} steps; {llm.stats()}")
    return {rid: done[rid] for rid in ids}


def test_preemption_completes_every_request_with_unchanged_outputs(tiny_qwen2, make_llm, random_prompt, monkeypatch):
    prompts = [random_prompt(8 + 2 * i, 600 + i) for i in range(8)]  # 8..22 tokens, + 40 < max_model_len
    params = greedy(40)
    expected = drive(make_llm(tiny_qwen2, num_kvcache_blocks=64), prompts, params)
    assert all(len(tokens) == 40 for tokens in expected.values())

    # max_model_len 64 needs 4 blocks; 8 blocks hold two sequences at full length, while the load
    # wants 8 x 3-5 blocks at once.
    for caching in (True, False):
        llm = make_llm(tiny_qwen2, num_kvcache_blocks=8, max_model_len=64, enable_prefix_caching=caching)
        log = BatchLog(llm, monkeypatch)
        assert drive(llm, prompts, params) == expected
        s = llm.stats()
        assert s.num_preemptions > 0
        assert (s.free_blocks, s.num_running, s.num_waiting) == (8, 0, 0)
        assert log.recomputed >= s.num_preemptions > 0


def test_preempted_request_goes_back_to_the_front_and_is_recomputed(tiny_qwen2, make_llm, random_prompt):
    llm = make_llm(tiny_qwen2, num_kvcache_blocks=4, max_model_len=64, enable_prefix_caching=False)
    a, b, c = (llm.add_request(random_prompt(15, i), greedy(30)) for i in range(3))
    llm.step()  # a, b and c take one block each
    d = llm.add_request(random_prompt(20, 3), greedy(30))  # needs two blocks: has to wait
    seqs = {rid: llm.requests[rid] for rid in (a, b, c, d)}
    llm.step()
    assert [s.request_id for s in llm.scheduler.running] == [a, b, c] and llm.stats().num_preemptions == 0
    llm.step()  # a takes the last free block for its 17th token; b's needs c's
    assert llm.stats().num_preemptions == 1
    assert [s.request_id for s in llm.scheduler.running] == [a, b]
    victim = seqs[c]
    assert [s.request_id for s in llm.scheduler.waiting] == [c, d]  # ahead of the request that never ran
    assert victim.status == SequenceStatus.WAITING and victim.block_table == [] and victim.num_computed_tokens == 0
    assert victim.num_output_tokens == 2  # its output so far is kept and recomputed, not resampled
    kept = victim.output_token_ids
    for _ in range(MAX_STEPS):
        if not llm.has_unfinished_requests():
            break
        llm.step()
    assert all(s.finish_reason == "length" and s.num_output_tokens == 30 for s in seqs.values())
    assert victim.output_token_ids[:2] == kept
    roomy = make_llm(tiny_qwen2)
    assert roomy.generate([random_prompt(15, 2)], greedy(30), use_tqdm=False)[0]["token_ids"] == victim.output_token_ids


def test_max_num_seqs_is_respected(tiny_qwen2, make_llm, random_prompt, monkeypatch):
    llm = make_llm(tiny_qwen2, max_num_seqs=3)
    log = BatchLog(llm, monkeypatch)
    prompts = [random_prompt(5 + i, 700 + i) for i in range(7)]
    expected = drive(make_llm(tiny_qwen2), prompts, greedy(10))
    assert drive(llm, prompts, greedy(10)) == expected
    assert max(len(batch) for _, batch, _ in log.steps) == 3
    assert max(running for _, _, running in log.steps) == 3


@pytest.mark.parametrize("budget", [1, 4, 5, 16])
def test_token_budget_decodes_first_then_prefill_chunks(budget, tiny_qwen2, make_llm, random_prompt, monkeypatch):
    llm = make_llm(tiny_qwen2, max_num_batched_tokens=budget)
    log = BatchLog(llm, monkeypatch)
    prompts = [random_prompt(n, 800 + n) for n in (3, 20, 9, 37, 1, 12)]
    expected = drive(make_llm(tiny_qwen2), prompts, greedy(8))
    # Stagger arrivals so that prefills meet running decodes.
    ids = [llm.add_request(p, greedy(8), request_id=f"r{i}") for i, p in enumerate(prompts[:3])]
    outputs = {}
    for step in range(MAX_STEPS):
        if step == 4:
            ids += [llm.add_request(p, greedy(8), request_id=f"r{i + 3}") for i, p in enumerate(prompts[3:])]
        if not llm.has_unfinished_requests() and step > 4:
            break
        for out in llm.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
    assert outputs == expected

    mixed = 0
    for decoding, batch, _ in log.steps:
        assert 0 < sum(n for _, n, _ in batch) <= budget
        scheduled = [rid for rid, _, _ in batch]
        # Running decodes come first, oldest first, and each costs exactly one token.
        expected_decodes = decoding[:budget]
        assert scheduled[: len(expected_decodes)] == expected_decodes
        assert all(n == 1 for _, n, _ in batch[: len(expected_decodes)])
        # Anything after them is prefill work, and only the last item can be a partial chunk.
        assert all(samples for _, _, samples in batch[:-1])
        mixed += bool(expected_decodes) and len(batch) > len(expected_decodes)
    if budget > 1:
        assert mixed > 0, "no step mixed decodes with prefill chunks"
    if budget < 37:
        assert any(not batch[-1][2] for _, batch, _ in log.steps), "no prefill was chunked"


def test_scheduler_preempts_the_newest_and_admits_nothing_in_that_step():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b, c = (Sequence([1, 2, 3], greedy(8)) for _ in range(3))
    for s in (a, b):
        sched.add(s)
    first = sched.schedule()
    assert [(x.seq, x.num_new_tokens, x.samples) for x in first] == [(a, 3, True), (b, 3, True)]
    for x in first:  # what the engine does after the model ran
        x.seq.num_computed_tokens += x.num_new_tokens
        x.seq.token_ids.append(7)
    sched.add(c)
    # a and b each hold 2 blocks (3 tokens); the 4th token fits, the 5th does not.
    second = sched.schedule()
    assert [(x.seq, x.num_new_tokens) for x in second] == [(a, 1), (b, 1)]
    for x in second:
        x.seq.num_computed_tokens += 1
        x.seq.token_ids.append(7)
    third = sched.schedule()
    assert [(x.seq, x.num_new_tokens) for x in third] == [(a, 1)]
    assert sched.running == [a] and list(sched.waiting) == [b, c]
    assert sched.num_preemptions == 1 and b.block_table == [] and b.num_computed_tokens == 0
    assert bm.num_free_blocks == 1  # b's two blocks are back, one went to a; c was not admitted


def test_a_request_that_cannot_fit_alone_is_refused_up_front(tiny_qwen2, make_llm):
    llm = make_llm(tiny_qwen2, num_kvcache_blocks=2, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.add_request(list(range(3, 35)), greedy(4))
    # The longest allowed request runs to max_model_len and stops with "length" without deadlock.
    result = llm.generate(
        [list(range(3, 34))], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False
    )[0]
    assert result["finish_reason"] == "length" and len(result["token_ids"]) == 1
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        make_llm(tiny_qwen2, num_kvcache_blocks=2, max_model_len=33)


def test_one_token_prefill_chunks_beside_decodes(tiny_qwen2, make_llm, random_prompt, monkeypatch):
    """A budget of 4 with three decodes running leaves one token for a new prompt: a batch of
    single-token rows where one row is a prefill chunk at position 0, not a decode."""
    short = [random_prompt(1, 900 + i) for i in range(3)]
    long = random_prompt(12, 903)
    expected = [r["token_ids"] for r in make_llm(tiny_qwen2).generate(short + [long], greedy(16), use_tqdm=False)]

    llm = make_llm(tiny_qwen2, max_num_batched_tokens=4)
    log = BatchLog(llm, monkeypatch)
    ids = [llm.add_request(p, greedy(16)) for p in short]
    outputs = {}
    for step in range(MAX_STEPS):
        if step == 1:
            ids.append(llm.add_request(long, greedy(16)))
        elif not llm.has_unfinished_requests():
            break
        outputs.update({out.request_id: out.token_ids for out in llm.step() if out.finished})
    assert log.steps[1][1] == [(ids[0], 1, True), (ids[1], 1, True), (ids[2], 1, True), (ids[3], 1, False)]
    assert [outputs[rid] for rid in ids] == expected


# ---- priority ---------------------------------------------------------------------------------------
def advance(batch) -> None:
    """What the engine does after the model ran: each chunk's KV is written, and a sampling one adds a token."""
    for x in batch:
        x.seq.num_computed_tokens += x.num_new_tokens
        if x.samples:
            x.seq.token_ids.append(7)


def test_a_more_urgent_request_takes_every_step_and_the_others_wait_with_their_blocks():
    bm = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    background = Sequence([1, 2, 3], greedy(8), priority=1)
    sched.add(background)
    advance(sched.schedule())
    chat = Sequence([4, 5, 6, 7], greedy(2))
    sched.add(chat)
    held = list(background.block_table)
    batch = sched.schedule()
    assert [(x.seq, x.num_new_tokens) for x in batch] == [(chat, 4)]  # no decode row for the background job
    advance(batch)
    assert [x.seq for x in sched.schedule()] == [chat]
    assert background.block_table == held and background.status == SequenceStatus.RUNNING
    chat.token_ids.append(7)  # the chat reaches its 2 tokens and finishes
    sched.remove(chat)
    assert [(x.seq, x.num_new_tokens) for x in sched.schedule()] == [(background, 1)]  # back to work


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    bm = BlockManager(num_blocks=32, block_size=2, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    late, first, second = (
        Sequence([1, 2], greedy(4), priority=5),
        Sequence([3, 4], greedy(4)),
        Sequence([5, 6], greedy(4)),
    )
    for s in (late, first, second):
        sched.add(s)
    assert sched.waiting == [first, second, late]
    assert [x.seq for x in sched.schedule()] == [first, second]


def test_a_more_urgent_request_preempts_less_urgent_ones_for_a_seat_or_blocks():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=100)
    old, new = Sequence([1, 2, 3], greedy(8), priority=2), Sequence([4, 5], greedy(8), priority=1)
    sched.add(old)
    advance(sched.schedule())
    sched.add(new)
    advance(sched.schedule())  # more urgent: admitted beside the old one, which waits
    assert sched.running == [new, old] and bm.num_free_blocks == 1
    chat = Sequence([6, 7, 8, 9, 10, 11, 12], greedy(1))  # needs all 4 blocks: both others give theirs up
    sched.add(chat)
    batch = sched.schedule()
    assert [(x.seq, x.num_new_tokens) for x in batch] == [(chat, 7)]
    assert sched.running == [chat] and sched.waiting == [new, old]
    assert sched.num_preemptions == 2 and old.num_computed_tokens == new.num_computed_tokens == 0


def test_equal_priorities_never_preempt_to_admit(tiny_qwen2, make_llm, random_prompt):
    """With every priority equal, a waiting request waits for room: it does not take a running one's."""
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=100)
    a, b = Sequence([1, 2, 3], greedy(8), priority=3), Sequence([4, 5], greedy(8), priority=3)
    sched.add(a)
    advance(sched.schedule())
    sched.add(b)
    assert [x.seq for x in sched.schedule()] == [a]
    assert sched.num_preemptions == 0 and sched.waiting == [b]


def test_generate_serves_urgent_prompts_first_and_gives_the_same_tokens(
    tiny_qwen2, make_llm, random_prompt, monkeypatch
):
    prompts = [random_prompt(n, 80 + n) for n in (6, 9, 12)]
    params = greedy(6)
    llm = make_llm(tiny_qwen2)
    alone = [llm.generate([p], params, use_tqdm=False)[0]["token_ids"] for p in prompts]
    log = BatchLog(llm, monkeypatch)
    outs = llm.generate(prompts, params, use_tqdm=False, priority=[1, 0, 1])
    assert [o["token_ids"] for o in outs] == alone
    served = [{rid for rid, _, _ in batch} for _, batch, _ in log.steps if batch]
    urgent = next(iter(served[0]))
    assert all(s == {urgent} for s in served[:6])  # the urgent prompt's prefill and its 5 decodes, alone
    assert len(served[6]) == 2  # then the other two, batched
    with pytest.raises(ValueError, match="got 2 priorities for 3 prompts"):
        llm.generate(prompts, params, priority=[0, 1])
    with pytest.raises(TypeError, match="priority must be an int"):
        llm.add_request([1, 2], params, priority="high")
