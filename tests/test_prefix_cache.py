"""Prefix caching end to end: exact hit counts, and outputs that never depend on the cache.

The cases are the ones where nano-vllm's prefix cache went wrong: a fully cached prompt, a
prompt that is an exact multiple of the block size, preemption of a request whose blocks are
shared, and chunked prefill that continues over cached blocks.
"""

import dataclasses

import pytest

from engine import KVBlock, SamplingParams

BS = 16
DESIGN_STATS_KEYS = {
    "num_blocks",
    "free_blocks",
    "cached_blocks",
    "used_blocks",
    "block_size",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_running",
    "num_waiting",
    "num_preemptions",
}


def greedy(max_tokens=12):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def token_ids(results):
    return [r["token_ids"] for r in results]


@pytest.fixture
def system(random_prompt):
    return random_prompt(40, 100)  # two full blocks and 8 tokens


def test_shared_system_prompt_hits_its_full_blocks(tiny_qwen2, make_llm, system, random_prompt):
    a, b, c = (system + random_prompt(10, seed) for seed in (101, 102, 103))
    assert len({a[40], b[40], c[40]}) == 3  # the prompts part ways right after the system prompt

    llm = make_llm(tiny_qwen2)
    first = llm.generate([a], greedy(), use_tqdm=False)
    s = llm.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (50, 0)
    assert first[0]["num_cached_tokens"] == 0

    rest = llm.generate([b, c], greedy(), use_tqdm=False)
    s = llm.stats()
    # Each of b and c finds the system prompt's two full blocks; the third block differs.
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (150, 64)
    assert [r["num_cached_tokens"] for r in rest] == [32, 32]

    again = llm.generate([a], greedy(), use_tqdm=False)
    # a's third block (system[32:40] + 8 of its own tokens) was registered by the first run.
    assert again[0]["num_cached_tokens"] == 48
    assert llm.stats().prefix_cache_hits == 112

    off = make_llm(tiny_qwen2, enable_prefix_caching=False)
    expected = token_ids(off.generate([a, b, c, a], greedy(), use_tqdm=False))
    assert token_ids(first + rest + again) == expected
    assert off.stats().prefix_cache_hits == 0


@pytest.mark.parametrize("length", [16, 32, 40, 48])
def test_fully_cached_prompt_recomputes_its_last_block(length, tiny_qwen2, make_llm, random_prompt):
    prompt = random_prompt(length, length)
    reference = make_llm(tiny_qwen2, enable_prefix_caching=False).generate([prompt], greedy(), use_tqdm=False)[0]

    llm = make_llm(tiny_qwen2)
    results = [llm.generate([prompt], greedy(), use_tqdm=False)[0] for _ in range(3)]
    # The last prompt token is never served from the cache, so at most (length - 1) // 16 blocks hit.
    hit = (length - 1) // BS * BS
    assert [r["num_cached_tokens"] for r in results] == [0, hit, hit]
    assert llm.stats().prefix_cache_hits == 2 * hit
    for r in results:
        assert r["token_ids"] == reference["token_ids"]
        assert r["text"] == reference["text"]
    assert llm.stats().used_blocks == 0


def test_identical_prompts_in_one_batch_and_queued(tiny_qwen2, make_llm, random_prompt):
    prompt = random_prompt(48, 7)
    reference = make_llm(tiny_qwen2, enable_prefix_caching=False).generate([prompt], greedy(), use_tqdm=False)[0][
        "token_ids"
    ]

    # Admitted in the same step: nothing is registered yet, so no hits, and both compute the same blocks.
    together = make_llm(tiny_qwen2)
    assert token_ids(together.generate([prompt] * 3, greedy(), use_tqdm=False)) == [reference] * 3
    assert together.stats().prefix_cache_hits == 0

    # One at a time: each later copy finds the first copy's blocks.
    queued = make_llm(tiny_qwen2, max_num_seqs=1)
    results = queued.generate([prompt] * 3, greedy(), use_tqdm=False)
    assert token_ids(results) == [reference] * 3
    assert [r["num_cached_tokens"] for r in results] == [0, 32, 32]


def test_preempting_a_request_whose_blocks_are_shared(tiny_qwen2, make_llm, system, random_prompt):
    prompts = [system + random_prompt(8, 200 + i) for i in range(4)]
    params = greedy(max_tokens=40)

    roomy = make_llm(tiny_qwen2, num_kvcache_blocks=64)
    expected = token_ids(roomy.generate(prompts, params, use_tqdm=False))
    assert roomy.stats().num_preemptions == 0

    # Each request needs 6 blocks at its end (88 tokens), 2 of them the shared system prompt:
    # 2 + 4 * 4 = 18 blocks for all four at once, but there are only 10.
    tight = make_llm(tiny_qwen2, num_kvcache_blocks=10, max_model_len=128)
    tight.generate([system + random_prompt(3, 299)], greedy(max_tokens=1), use_tqdm=False)  # warm the system prompt
    results = tight.generate(prompts, params, use_tqdm=False)
    s = tight.stats()
    assert s.num_preemptions > 0
    assert token_ids(results) == expected
    assert all(r["num_cached_tokens"] >= 32 for r in results)
    assert (s.used_blocks, s.free_blocks) == (0, 10)


def test_chunked_prefill_continues_over_cached_blocks(tiny_qwen2, make_llm, system, random_prompt):
    tail = random_prompt(30, 300)
    prompt = system + tail  # 70 tokens: 2 cached blocks, then 38 to prefill in chunks of 7
    reference = make_llm(tiny_qwen2, enable_prefix_caching=False).generate([prompt], greedy(), use_tqdm=False)[0]

    llm = make_llm(tiny_qwen2, max_num_batched_tokens=7)
    llm.generate([system + random_prompt(5, 301)], greedy(max_tokens=1), use_tqdm=False)
    rid = llm.add_request(prompt, greedy())
    llm.step()
    seq = llm.scheduler.running[0]
    assert seq.request_id == rid
    assert (seq.num_cached_tokens, seq.num_computed_tokens) == (32, 39)  # the first chunk starts after the hit
    while llm.has_unfinished_requests():
        llm.step()
    assert seq.output_token_ids == reference["token_ids"]
    assert seq.output_text == reference["text"]


def test_second_copy_admitted_mid_chunked_prefill_hits_the_blocks_already_written(tiny_qwen2, make_llm, random_prompt):
    prompt = random_prompt(40, 400)
    reference = make_llm(tiny_qwen2, enable_prefix_caching=False).generate([prompt], greedy(), use_tqdm=False)[0][
        "token_ids"
    ]
    llm = make_llm(tiny_qwen2, max_num_batched_tokens=7)
    # Chunks of 7: the first copy's last chunk (35..40) leaves 2 tokens of budget, which admits the
    # second copy on the two blocks registered after earlier chunks.
    results = llm.generate([prompt, prompt], greedy(), use_tqdm=False)
    assert [r["num_cached_tokens"] for r in results] == [0, 32]
    assert token_ids(results) == [reference, reference]


def test_kv_blocks_and_stats_while_two_requests_share_blocks(tiny_qwen2, make_llm, system, random_prompt):
    llm = make_llm(tiny_qwen2, num_kvcache_blocks=20)
    s = llm.stats()
    assert DESIGN_STATS_KEYS <= {f.name for f in dataclasses.fields(s)}
    assert (s.num_blocks, s.free_blocks, s.used_blocks, s.cached_blocks, s.block_size) == (20, 20, 0, 0, BS)

    llm.generate([system + random_prompt(4, 500)], greedy(max_tokens=1), use_tqdm=False)
    s = llm.stats()
    assert (s.free_blocks, s.used_blocks) == (20, 0)
    assert s.cached_blocks == 2  # the two full blocks of the system prompt; the partial third is empty again

    r1 = llm.add_request(system + random_prompt(4, 501), greedy())
    r2 = llm.add_request(system + random_prompt(20, 502), greedy())
    llm.step()
    s = llm.stats()
    assert (s.num_running, s.num_waiting) == (2, 0)
    seq1, seq2 = llm.requests[r1], llm.requests[r2]
    shared = seq1.block_table[:2]
    assert seq2.block_table[:2] == shared

    blocks = llm.kv_blocks()
    assert len(blocks) == 20
    assert [b.id for b in blocks] == list(range(20))
    by_id = {b.id: b for b in blocks}
    for block_id in shared:
        assert by_id[block_id].ref_count == 2
        assert by_id[block_id].cached is True
        assert by_id[block_id].filled == BS
        assert sorted(by_id[block_id].owners) == sorted([r1, r2])
    # r1: 44 tokens computed, 3 blocks; its third block holds 12 tokens and only r1 uses it.
    assert by_id[seq1.block_table[2]] == KVBlock(
        seq1.block_table[2], ref_count=1, cached=False, filled=12, owners=(r1,)
    )
    # r2: 60 tokens computed: 4 blocks, the third is full and now registered, the fourth holds 12.
    assert by_id[seq2.block_table[2]].cached is True and by_id[seq2.block_table[2]].owners == (r2,)
    assert by_id[seq2.block_table[3]].filled == 12
    used = [b for b in blocks if b.ref_count > 0]
    assert len(used) == s.used_blocks == 5
    assert sum(b.ref_count for b in blocks) == len(seq1.block_table) + len(seq2.block_table)
    idle = [b for b in blocks if b.ref_count == 0]
    assert all(b.owners == () for b in idle)
    assert sum(b.cached for b in idle) == s.cached_blocks
    assert s.free_blocks == len(idle) == 15

    while llm.has_unfinished_requests():
        llm.step()
    blocks = llm.kv_blocks()
    assert all(b.ref_count == 0 and b.owners == () for b in blocks)
    s = llm.stats()
    assert (s.free_blocks, s.used_blocks, s.num_running) == (20, 0, 0)
    assert s.cached_blocks == sum(b.cached for b in blocks) > 2


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_mid_chunked_prefill_frees_its_blocks_and_a_retry_reuses_the_ones_it_wrote(
    async_scheduling, tiny_qwen2, make_llm, system, random_prompt
):
    """A user who presses Stop while a long prompt is still being prefilled: its blocks go back to the
    pool, the full ones it wrote stay registered, and sending the same prompt again starts from them and
    gives the tokens an uncached engine gives."""
    prompt = system + random_prompt(30, 500)  # 70 tokens: 2 cached blocks, then chunks of 7
    reference = make_llm(tiny_qwen2, enable_prefix_caching=False).generate([prompt], greedy(), use_tqdm=False)[0]

    llm = make_llm(tiny_qwen2, max_num_batched_tokens=7, async_scheduling=async_scheduling)
    llm.generate([system + random_prompt(5, 301)], greedy(max_tokens=1), use_tqdm=False)  # caches the system prompt
    rid = llm.add_request(prompt, greedy())
    for _ in range(3):
        assert llm.step() == []  # prefill chunks sample nothing
    seq = llm.scheduler.running[0]
    assert seq.request_id == rid and seq.num_cached_tokens == 32
    assert seq.num_computed_tokens == 32 + 3 * 7 < len(prompt)  # mid-prefill: 3 full blocks written, more to go
    assert llm.abort_request(rid)
    while llm.has_unfinished_requests():  # a chunk still in flight (async) is read back and dropped
        assert llm.step() == []
    s = llm.stats()
    assert (s.num_running, s.num_waiting, s.used_blocks, s.free_blocks) == (0, 0, 0, s.num_blocks)
    assert all(b.ref_count == 0 for b in llm.block_manager.blocks)
    assert s.cached_blocks >= 3

    again = llm.generate([prompt], greedy(), use_tqdm=False)[0]
    assert again["num_cached_tokens"] == 48  # the system prompt's 2 blocks and the one the aborted chunks filled
    assert again["token_ids"] == reference["token_ids"] and again["text"] == reference["text"]


@pytest.mark.parametrize("answered", ["one_after_the_other", "in_one_batch"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_follow_ups_on_every_answer_to_a_whole_block_prompt_hit_alike(
    answered, async_scheduling, tiny_qwen2, make_llm, random_prompt
):
    """Regenerate on a prompt of exactly 2 blocks, then follow-ups on each answer (issue 28 item 3).

    The second answer's prompt blocks are duplicates of the first's: recomputed because the last
    prompt token is never served from the cache (one after the other), or computed in the same step
    (in one batch). Its reply blocks used to chain to the unregistered duplicate, so a follow-up on
    it stopped at the prompt (32 cached tokens every time) while one on the first answer got 64, then
    80. The prefix a follow-up shares with its answer must hit the same way whichever answer it follows."""
    prompt = random_prompt(2 * BS, 600)
    llm = make_llm(tiny_qwen2, async_scheduling=async_scheduling)
    sampled = [SamplingParams(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=True) for seed in (1, 2)]
    if answered == "in_one_batch":
        answers = token_ids(llm.generate([prompt, prompt], sampled, use_tqdm=False))
    else:
        answers = [llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"] for params in sampled]
    assert answers[0] != answers[1]

    more = random_prompt(17, 601)  # 32 + 40 + 17 = 89 tokens
    cached = {
        i: [
            llm.generate([prompt + answer + more], greedy(max_tokens=1), use_tqdm=False)[0]["num_cached_tokens"]
            for _ in range(3)
        ]
        for i, answer in enumerate(answers)
    }
    # First follow-up: the prompt's 2 blocks and the answer's 2 full blocks whose KV was written (the
    # last sampled token never went through the model). Then all (89 - 1) // 16 = 5 blocks.
    assert cached == {0: [64, 80, 80], 1: [64, 80, 80]}
