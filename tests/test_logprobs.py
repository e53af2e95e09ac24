"""Logprobs and prompt logprobs (vLLM's contract) against transformers' log_softmax of its logits.

Each check replays the request's prompt and output through transformers in one teacher-forced
forward (float32), so every reported value, and every top-k set, is compared with the reference
distribution at that position: the raw one, whatever temperature or top-k sampled the token.
"""

import pytest
import torch

from engine import LLM, SamplingParams

TOL = 2e-4  # float32 logits agree to ~1e-5 (tests/test_parity.py); log_softmax adds one reduction


def reference_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, vocab]: row p is the distribution of token p + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(-1)[:-1]


def check_row(row: dict[int, float], ref: torch.Tensor, token: int, k: int, where: str) -> None:
    """`row` holds `token` first and a top-k of `ref`, each with ref's value."""
    assert next(iter(row)) == token, f"{where}: the chosen token must come first, got {list(row)}"
    ids = list(row)
    values = torch.tensor([row[t] for t in ids])
    torch.testing.assert_close(values, ref[ids], atol=TOL, rtol=0, msg=lambda m: f"{where}: {m}")
    top = [t for t in ids if t != token] if len(ids) > k else ids
    assert len(top) == k, f"{where}: {len(ids)} entries for k={k}: {row}"
    if k:  # a valid top-k: nothing outside it beats its smallest member (up to the tolerance)
        kth = ref.topk(k).values[-1]
        assert min(row[t] for t in top) >= kth - TOL, f"{where}: {row} is not a top-{k}"


def check_result(model, prompt: list[int], result: dict, params: SamplingParams) -> None:
    ref = reference_logprobs(model, prompt + result["token_ids"])
    if params.logprobs is None:
        assert result["logprobs"] is None
    else:
        assert len(result["logprobs"]) == len(result["token_ids"]) > 0
        for i, (token, row) in enumerate(zip(result["token_ids"], result["logprobs"])):
            check_row(row, ref[len(prompt) - 1 + i], token, params.logprobs, f"output {i}")
    if params.prompt_logprobs is None:
        assert result["prompt_logprobs"] is None
    else:
        pl = result["prompt_logprobs"]
        assert len(pl) == len(prompt) and pl[0] is None
        for p in range(1, len(prompt)):
            check_row(pl[p], ref[p - 1], prompt[p], params.prompt_logprobs, f"prompt token {p}")


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 7}], ids=["whole", "chunked"])
def test_a_mixed_batch_matches_transformers(settings, tiny_llama, make_llm, hf_model, random_prompt):
    llm = make_llm(tiny_llama, **settings)
    cases = [
        (
            random_prompt(20, 1),
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2),
        ),
        (random_prompt(9, 2), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)),  # asks for nothing
        # Sampled with temperature and top-k: the reported logprobs are still the raw distribution's.
        (
            random_prompt(33, 3),
            SamplingParams(temperature=1.5, top_k=4, seed=7, max_tokens=8, ignore_eos=True, logprobs=5),
        ),
        (
            random_prompt(14, 4),
            SamplingParams(temperature=0.8, seed=3, max_tokens=4, ignore_eos=True, logprobs=0, prompt_logprobs=0),
        ),
        (random_prompt(2, 5), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=20)),
    ]
    results = llm.generate([p for p, _ in cases], [s for _, s in cases], use_tqdm=False)
    model = hf_model(tiny_llama)
    for (prompt, params), result in zip(cases, results):
        check_result(model, prompt, result, params)
    # The requests that asked for nothing got the same tokens as without the others asking.
    alone = llm.generate([cases[1][0]], cases[1][1], use_tqdm=False)[0]
    assert alone["token_ids"] == results[1]["token_ids"]


def test_the_sampled_token_logprob_is_raw_not_tempered(tiny_llama, make_llm, hf_model, random_prompt):
    """With a high temperature the tempered distribution differs a lot; the reported value must not."""
    prompt = random_prompt(12, 8)
    params = SamplingParams(temperature=2.0, seed=1, max_tokens=10, ignore_eos=True, logprobs=1)
    result = make_llm(tiny_llama).generate([prompt], params, use_tqdm=False)[0]
    ref = reference_logprobs(hf_model(tiny_llama), prompt + result["token_ids"])
    got = torch.tensor([row[t] for row, t in zip(result["logprobs"], result["token_ids"])])
    want = ref[len(prompt) - 1 :].gather(1, torch.tensor(result["token_ids"])[:, None])[:, 0]
    tempered = (ref[len(prompt) - 1 :] / 2.0).log_softmax(-1).gather(1, torch.tensor(result["token_ids"])[:, None])
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    assert (got - tempered[:, 0]).abs().max() > 10 * TOL


def test_prompt_logprobs_skip_the_prefix_cache_but_register_their_blocks(tiny_llama, make_llm, hf_model, random_prompt):
    llm = make_llm(tiny_llama)
    prompt = random_prompt(40, 11)
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = llm.generate([prompt], plain, use_tqdm=False)[0]
    assert first["num_cached_tokens"] == 0
    wanting = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    second = llm.generate([prompt], wanting, use_tqdm=False)[0]
    assert second["num_cached_tokens"] == 0  # a hit was there (32 tokens) but would have hidden 32 positions
    check_result(hf_model(tiny_llama), prompt, second, wanting)
    # Asking for logprobs of the generated tokens only does not need the prompt's logits: it hits.
    third = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=2), use_tqdm=False
    )[0]
    assert third["num_cached_tokens"] == 32
    check_result(hf_model(tiny_llama), prompt, third, SamplingParams(logprobs=2))
    assert first["token_ids"] == second["token_ids"] == third["token_ids"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_and_recompute_add_no_duplicates(async_scheduling, tiny_llama, make_llm, hf_model, random_prompt):
    llm = make_llm(tiny_llama, num_kvcache_blocks=14, max_num_batched_tokens=24, async_scheduling=async_scheduling)
    prompts = [random_prompt(30 + 4 * i, 50 + i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    results = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats().num_preemptions > 0
    model = hf_model(tiny_llama)
    for prompt, result in zip(prompts, results):
        check_result(model, prompt, result, params)


def test_step_outputs_carry_each_new_tokens_logprobs(tiny_llama, make_llm, random_prompt):
    llm = make_llm(tiny_llama, max_num_batched_tokens=8)
    prompt = random_prompt(21, 12)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    whole = llm.generate([prompt], params, use_tqdm=False)[0]
    llm.add_request(prompt, params, request_id="r")
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()
    assert [o.logprobs for o in outputs] == [[row] for row in whole["logprobs"]]
    assert outputs[0].prompt_logprobs == whole["prompt_logprobs"]
    assert all(o.prompt_logprobs is None for o in outputs[1:])
    llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=2), request_id="plain")
    while llm.has_unfinished_requests():
        assert all(o.logprobs is None and o.prompt_logprobs is None for o in llm.step())


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True])
@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_out_of_range_k_is_refused(name, bad):
    with pytest.raises(ValueError, match=f"{name} must be None"):
        SamplingParams(**{name: bad})


def test_tensor_parallel_logprobs_equal_one_rank(tiny_llama, random_prompt):
    prompts = [random_prompt(25, 21), random_prompt(6, 22)]
    params = [
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=3),
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    ]
    settings = dict(dtype="float32", num_kvcache_blocks=32, max_num_batched_tokens=16)
    one = LLM(str(tiny_llama), **settings).generate(prompts, params, use_tqdm=False)
    tp = LLM(str(tiny_llama), tensor_parallel_size=2, **settings)
    try:
        two = tp.generate(prompts, params, use_tqdm=False)
    finally:
        tp.close()
    assert two[0]["token_ids"] == one[0]["token_ids"] and two[1]["logprobs"] is None
    for key in ("logprobs", "prompt_logprobs"):
        for a, b in zip(one[0][key], two[0][key]):
            assert (a is None) == (b is None)
            if a is not None:
                assert list(a) == list(b)
                torch.testing.assert_close(
                    torch.tensor(list(a.values())), torch.tensor(list(b.values())), atol=TOL, rtol=0
                )


def test_quality_kl_over_the_top_tokens_is_a_lower_bound_and_exact_with_the_whole_vocabulary():
    from bench.quality import bucketed_kl

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        p, q = (torch.randn(50, generator=g).mul(2).log_softmax(-1) for _ in range(2))
        exact = float((p.exp() * (p - q)).sum())

        def top(lp: torch.Tensor, k: int) -> dict[int, float]:
            return {int(t): float(lp[t]) for t in lp.topk(k).indices}

        assert bucketed_kl(top(p, 50), top(q, 50)) == pytest.approx(exact, rel=1e-4, abs=1e-6)
        assert bucketed_kl(top(p, 5), top(p, 5)) == pytest.approx(0, abs=1e-6)
        assert 0 <= bucketed_kl(top(p, 10), top(q, 10)) <= exact + 1e-6
