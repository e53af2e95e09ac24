"""Speculative decoding with a draft model (engine/spec_decode/draft_model.py): a smaller model with the same
tokenizer proposes k tokens a step, greedily, from its own paged KV cache, and the target checks them.

What must hold: greedy output is the same token for token as without speculation, with the target as its own draft
(every draft accepted) and with a draft of other weights (drafts rejected), alone and beside requests that do not
speculate, over prefix-cache hits, chunked prefill, preemption and abort; the draft's cache gives back every block;
a draft that cannot serve is refused at load with a message that says what to change.
"""

import pytest
import torch

from engine import SamplingParams

K = 4


def draft(model, k: int = K) -> dict:
    return {"method": "draft", "model": str(model), "num_speculative_tokens": k}


def greedy(max_tokens=40, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 200, (n,), generator=g).tolist() for n in (9, 23, 40, 17)]


def draft_cache_is_empty(llm) -> bool:
    proposer = llm.speculator.proposer
    bm = proposer.block_manager
    return not proposer.mirrors and bm.num_free_blocks == bm.num_blocks


def test_the_target_as_its_own_draft_accepts_every_token(make_llm, tiny_llama, prompts):
    plain = make_llm(tiny_llama).generate(prompts, greedy(), use_tqdm=False)
    llm = make_llm(tiny_llama, speculative_config=draft(tiny_llama))
    out = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o["token_ids"] for o in out] == [p["token_ids"] for p in plain]
    stats = llm.stats()
    assert stats.speculative_method == "draft"
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0
    # tokens per target step: k + 1 but where a reply's length limit leaves fewer to draft
    assert (stats.spec_accepted_tokens + stats.spec_steps) / stats.spec_steps >= 0.9 * (K + 1)
    assert stats.free_blocks == stats.num_blocks
    assert draft_cache_is_empty(llm)


def test_a_draft_of_other_weights_is_rejected_and_changes_nothing(make_llm, tiny_llama, tiny_qwen2, prompts):
    """Drafts from another model (same tokenizer) are mostly wrong; beside them, requests with a penalty or
    logprobs decode plainly in the same steps. Each gets exactly its plain tokens."""
    params = [greedy(), greedy(repetition_penalty=1.3), greedy(logprobs=2), greedy(logit_bias={5: 3.0})]
    plain = make_llm(tiny_llama).generate(prompts, params, use_tqdm=False)
    llm = make_llm(tiny_llama, speculative_config=draft(tiny_qwen2))
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in out] == [p["token_ids"] for p in plain]
    for d_spec, d_plain in zip(out[2]["logprobs"], plain[2]["logprobs"], strict=True):
        assert d_spec == pytest.approx(d_plain, abs=1e-4)
    stats = llm.stats()
    assert 0 < stats.spec_draft_tokens and stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert out[1]["speculation"] is None and out[2]["speculation"] is None  # they never drafted
    assert draft_cache_is_empty(llm)


def test_prefix_hits_chunked_prefill_and_preemption_change_nothing(make_llm, tiny_llama, tiny_qwen2, prompts):
    plain = make_llm(tiny_llama).generate(prompts, greedy(60), use_tqdm=False)
    for model in (tiny_llama, tiny_qwen2):
        # 16 blocks of 16 for four requests of up to 100 tokens: some are preempted; 32-token chunks
        llm = make_llm(tiny_llama, speculative_config=draft(model), num_kvcache_blocks=16, max_num_batched_tokens=32)
        first = llm.generate(prompts, greedy(60), use_tqdm=False)
        again = llm.generate(prompts, greedy(60), use_tqdm=False)  # both caches serve the prompts
        stats = llm.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.spec_steps > 0
        assert llm.speculator.proposer.block_manager.prefix_cache_hits > 0
        for p, f, a in zip(plain, first, again, strict=True):
            assert f["token_ids"] == p["token_ids"]
            assert a["token_ids"] == p["token_ids"]
        assert stats.free_blocks == stats.num_blocks
        assert draft_cache_is_empty(llm)


def test_abort_mid_speculation_frees_both_caches(make_llm, tiny_llama, prompts):
    llm = make_llm(tiny_llama, speculative_config=draft(tiny_llama))
    ids = [llm.add_request(p, greedy(200)) for p in prompts]
    for _ in range(6):
        llm.step()
    assert llm.speculator.proposer.mirrors  # the draft holds a copy of each running request
    for request_id in ids:
        assert llm.abort_request(request_id)
    stats = llm.stats()
    assert stats.free_blocks == stats.num_blocks
    assert draft_cache_is_empty(llm)
    reply = llm.generate([prompts[1]], greedy(), use_tqdm=False)[0]["token_ids"]
    assert reply == make_llm(tiny_llama).generate([prompts[1]], greedy(), use_tqdm=False)[0]["token_ids"]


def test_stop_tokens_and_length_cut_accepted_drafts(make_llm, tiny_llama, prompts):
    plain_llm, llm = make_llm(tiny_llama), make_llm(tiny_llama, speculative_config=draft(tiny_llama, 8))
    stop_token = plain_llm.generate([prompts[0]], greedy(30), use_tqdm=False)[0]["token_ids"][13]
    for params in (greedy(23), greedy(30, stop_token_ids=[stop_token])):
        assert (
            llm.generate([prompts[0]], params, use_tqdm=False)[0]["token_ids"]
            == plain_llm.generate([prompts[0]], params, use_tqdm=False)[0]["token_ids"]
        )


def test_sampled_requests_with_a_draft_are_reproducible(make_llm, tiny_llama, tiny_qwen2, prompts):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, ignore_eos=True, seed=11)
    runs = [
        make_llm(tiny_llama, speculative_config=draft(model)).generate(prompts, params, use_tqdm=False)
        for model in (tiny_llama, tiny_llama, tiny_qwen2)
    ]
    assert all(len(o["token_ids"]) == 30 for o in runs[0])
    assert [o["token_ids"] for o in runs[0]] == [o["token_ids"] for o in runs[1]]  # seeded: reproducible
    assert all(o["speculation"][2] > 0 for o in runs[0])  # its own draft is accepted where the target agrees


@pytest.mark.parametrize("family", ["qwen3", "mistral", "gemma3", "phi3", "gpt_oss", "qwen3_moe"])
def test_every_attention_family_as_its_own_draft(make_llm, tiny_models, prompts, family):
    """Sliding windows (Mistral, Gemma 3, gpt-oss), experts (gpt-oss, Qwen3-MoE), bf16 weights (Qwen3)."""
    model = tiny_models[family]
    plain = make_llm(model).generate(prompts[:2], greedy(30), use_tqdm=False)
    llm = make_llm(model, speculative_config=draft(model))
    out = llm.generate(prompts[:2], greedy(30), use_tqdm=False)
    assert [o["token_ids"] for o in out] == [p["token_ids"] for p in plain]
    assert llm.stats().spec_accepted_tokens > 0
    assert draft_cache_is_empty(llm)


def test_bundled_model_as_its_own_draft():
    """The bundled SmolLM2, greedy: the same reply with itself as draft, k + 1 tokens a step or nearly."""
    from engine import LLM
    from engine.loader.bundled import bundled_gguf_path

    path = str(bundled_gguf_path())
    llm = LLM(path, dtype="float32", num_kvcache_blocks=64, speculative_config=draft(path))
    prompt = llm.encode_chat([{"role": "user", "content": "Write a short poem about the sea."}])
    params = SamplingParams(temperature=0, max_tokens=60)
    spec = llm.generate([prompt], params, use_tqdm=False)[0]
    speculator, llm.speculator = llm.speculator, None
    plain = llm.generate([prompt], params, use_tqdm=False)[0]
    assert spec["token_ids"] == plain["token_ids"]
    steps, _, accepted = spec["speculation"]
    # Not every draft: the CPU's kernels for one row and for k + 1 rows may round apart, and a near tie then
    # flips (an AVX2-only CPU rejected 5 of 50 drafts, 4.46 tokens a step).
    assert (accepted + steps) / steps >= 0.8 * (K + 1)
    speculator.proposer.release()


# ---- refused at load ---------------------------------------------------------------------------------------------
def test_a_draft_with_another_tokenizer_is_refused(make_llm, tiny_llama):
    from engine.loader.bundled import bundled_gguf_path

    with pytest.raises(ValueError, match="different tokenizer .* same family"):
        make_llm(tiny_llama, speculative_config=draft(bundled_gguf_path()))


def test_a_draft_with_recurrent_state_is_refused(make_llm, tiny_llama, tiny_models):
    with pytest.raises(ValueError, match="keeps a recurrent state"):
        make_llm(tiny_llama, speculative_config=draft(tiny_models["qwen3_5"]))


@pytest.mark.parametrize(
    "value, message",
    [
        ({"method": "draft"}, 'needs a "model"'),
        ({"method": "draft", "model": "  "}, 'needs a "model"'),
        ({"method": "ngram", "model": "x"}, 'is the draft model of method "draft"'),
        ({"method": "draft", "model": "x", "num_speculative_tokens": 17}, "1..16"),
    ],
)
def test_bad_draft_settings_are_refused(value, message):
    from engine.spec_decode.config import SpeculativeConfig

    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_vllm_names_for_a_draft_model():
    from engine.spec_decode.config import SpeculativeConfig

    assert SpeculativeConfig.parse({"method": "draft_model", "model": "m"}).method == "draft"
    assert SpeculativeConfig.parse({"model": "m", "num_speculative_tokens": 3}) == SpeculativeConfig(
        "draft", 3, model="m"
    )


def test_on_a_gpu_the_target_leaves_the_draft_room():
    from engine.spec_decode.draft_loader import gpu_share_beside_draft

    gib = 2**30
    # a 1 GiB draft on an 8 GiB laptop GPU: 2.5 GiB (weights, a cache their size, activations) off the 0.9 share
    assert gpu_share_beside_draft(0.9, gib, 8 * gib) == pytest.approx(0.9 - 2.5 / 8)
    with pytest.raises(MemoryError, match="pick a smaller draft"):
        gpu_share_beside_draft(0.9, 4 * gib, 8 * gib)


def test_a_draft_that_fails_stops_speculation_not_the_replies(make_llm, tiny_llama, prompts, monkeypatch):
    llm = make_llm(tiny_llama, speculative_config=draft(tiny_llama))
    plain = make_llm(tiny_llama).generate(prompts, greedy(), use_tqdm=False)

    def broken(requests):
        raise RuntimeError("the draft's step failed")

    monkeypatch.setattr(llm.speculator.proposer, "propose", broken)
    out = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o["token_ids"] for o in out] == [p["token_ids"] for p in plain]
    assert llm.speculator.failed and llm.stats().spec_steps == 0


def test_a_draft_cache_too_small_drafts_for_whom_it_can(make_llm, tiny_llama, prompts, monkeypatch):
    """The draft's blocks run out (its pool is as big as the target's, but its copies need room for 8 drafts too):
    a copy that finds none is freed and starts again later; nothing is lost."""
    from engine.spec_decode.draft_model import DraftModelProposer

    dropped = []
    drop = DraftModelProposer._drop
    monkeypatch.setattr(DraftModelProposer, "_drop", lambda self, mirror: (dropped.append(mirror), drop(self, mirror)))
    plain = make_llm(tiny_llama).generate(prompts, greedy(60), use_tqdm=False)
    llm = make_llm(tiny_llama, speculative_config=draft(tiny_llama, 8), num_kvcache_blocks=16)
    out = llm.generate(prompts, greedy(60), use_tqdm=False)
    assert dropped
    assert [o["token_ids"] for o in out] == [p["token_ids"] for p in plain]
    assert llm.stats().spec_accepted_tokens > 0
    assert draft_cache_is_empty(llm)


def test_a_draft_with_a_shorter_context_drafts_only_within_it(make_llm, tiny_llama, prompts, tmp_path):
    """A draft trained on fewer positions than the model serves proposes nothing past them; the reply goes on."""
    import json
    import shutil

    short = shutil.copytree(tiny_llama, tmp_path / "short")
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 48}))
    plain = make_llm(tiny_llama).generate([prompts[2]], greedy(40), use_tqdm=False)[0]  # 40 + 40 tokens
    llm = make_llm(tiny_llama, speculative_config=draft(short))
    assert llm.speculator.proposer.max_model_len == 48
    out = llm.generate([prompts[2]], greedy(40), use_tqdm=False)[0]
    assert out["token_ids"] == plain["token_ids"]
    steps, drafted, _ = out["speculation"]
    assert 0 < drafted <= 48 - 40  # drafts only for positions 40..47
