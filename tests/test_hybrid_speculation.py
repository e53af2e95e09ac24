"""Speculative decoding on a hybrid model (Qwen3.5's Gated DeltaNet layers, a recurrent state per request): a step
that checks k drafts runs each request's rows through the recurrent layers one after another, keeping the state
after each row in a verify slot, and where only some drafts are accepted the request's state is restored from the
slot of its last accepted token (engine/runner/step_inputs.py chain_state_rows, engine/front/llm_engine.py).

A random tiny model seldom repeats itself, so n-gram drafts would all fail: a scripted proposer drafts the plain
run's own continuation instead, wrong at a chosen place every other time, so that steps accept all drafts, some,
or none. Greedy output must be the plain run's, token for token, alone, in a batch, beside prefill chunks, over
prefix-cache hits and after preemption.
"""

import pytest
import torch

from engine import SamplingParams


def greedy(max_tokens=40):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


class ScriptedProposer:
    """Drafts each request's plain continuation (`replies`, by prompt), with the token at `wrong_at` changed on
    every other proposal."""

    runner = None

    def __init__(self, replies: dict[tuple[int, ...], list[int]], wrong_at: int = 2):
        self.replies, self.wrong_at, self.calls = replies, wrong_at, 0

    def propose(self, requests):
        drafts = []
        for seq, length in requests:
            reply = self.replies[tuple(seq.token_ids[: seq.num_prompt_tokens])]
            done = seq.num_output_tokens
            draft = list(reply[done : done + length])
            self.calls += 1
            if self.calls % 2 and len(draft) > self.wrong_at:
                draft[self.wrong_at] = (draft[self.wrong_at] + 1) % 256
            drafts.append(draft)
        return drafts

    def retain(self, seqs):
        pass

    def release(self):
        pass


@pytest.fixture(scope="module")
def hybrid_prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 200, (n,), generator=g).tolist() for n in (9, 30, 13, 52)]


def speculating(make_llm, model, replies, **settings):
    llm = make_llm(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4}, **settings)
    llm.speculator.proposer = ScriptedProposer(replies)
    llm.speculator.min_acceptance = 0.0
    return llm


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_checked_drafts_leave_the_recurrent_state_of_the_accepted_tokens(make_llm, tiny_models, hybrid_prompts, family):
    model = tiny_models[family]
    plain = make_llm(model).generate(hybrid_prompts, greedy(), use_tqdm=False)
    replies = {tuple(p): r["token_ids"] for p, r in zip(hybrid_prompts, plain, strict=True)}
    llm = speculating(make_llm, model, replies)
    batched = llm.generate(hybrid_prompts, greedy(), use_tqdm=False)
    alone = [llm.generate([p], greedy(), use_tqdm=False)[0] for p in hybrid_prompts]
    for p, b, a in zip(plain, batched, alone, strict=True):
        assert b["token_ids"] == p["token_ids"]
        assert a["token_ids"] == p["token_ids"]
    stats = llm.stats()
    # all accepted on the even proposals, the first two of four on the odd ones: both kinds of step happened
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert stats.spec_mean_accepted_length > 2


def test_beside_prefill_chunks_prefix_hits_and_preemption(make_llm, tiny_models, hybrid_prompts):
    """Small chunks put checking rows and prefill chunks in one step (the recurrent layers' sequence-by-sequence
    path); the second run starts from state snapshots; a small cache preempts."""
    model = tiny_models["qwen3_5"]
    plain = make_llm(model).generate(hybrid_prompts, greedy(60), use_tqdm=False)
    replies = {tuple(p): r["token_ids"] for p, r in zip(hybrid_prompts, plain, strict=True)}
    llm = speculating(
        make_llm, model, replies, max_num_batched_tokens=24, num_kvcache_blocks=12, state_snapshot_tokens=16
    )
    first = llm.generate(hybrid_prompts, greedy(60), use_tqdm=False)
    again = llm.generate(hybrid_prompts, greedy(60), use_tqdm=False)
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.spec_accepted_tokens > 0
    for p, f, a in zip(plain, first, again, strict=True):
        assert f["token_ids"] == p["token_ids"]
        assert a["token_ids"] == p["token_ids"]
    assert stats.free_blocks == stats.num_blocks


def test_a_hybrid_model_speculates_on_the_cpu_only(make_llm, tiny_models):
    from engine.core.state_slots import StateSlots

    llm = make_llm(tiny_models["qwen3_5"], speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    states = llm.block_manager.states
    # three verify slots per running slot, after the running and snapshot slots
    assert states.verify_slot(0, 0) == states.num_running + states.num_snapshots
    assert states.verify_slot(1, 2) == states.num_running + states.num_snapshots + 5
    with pytest.raises(ValueError, match="no state slot"):
        StateSlots(2, 0, 0, 3).verify_slot(0, 3)


def test_state_snapshots_taken_in_a_checking_step_hold_the_right_state(make_llm, tiny_models, hybrid_prompts):
    """A prefix snapshot falls due in a step that checks drafts (every 16 tokens here): it must hold the state after
    its prefix, which a follow-up turn that sends the prompt and the reply back then starts from."""
    model = tiny_models["qwen3_5"]
    settings = {"state_snapshot_tokens": 16, "num_kvcache_blocks": 64}
    plain_llm = make_llm(model, **settings)
    plain = plain_llm.generate(hybrid_prompts, greedy(), use_tqdm=False)
    replies = {tuple(p): r["token_ids"] for p, r in zip(hybrid_prompts, plain, strict=True)}
    llm = speculating(make_llm, model, replies, **settings)
    assert [r["token_ids"] for r in llm.generate(hybrid_prompts, greedy(), use_tqdm=False)] == [
        r["token_ids"] for r in plain
    ]
    follow_ups = [p + r["token_ids"][:35] for p, r in zip(hybrid_prompts, plain, strict=True)]
    hits_before = llm.stats().prefix_cache_hits
    expected = plain_llm.generate(follow_ups, greedy(12), use_tqdm=False)
    llm.speculator = None  # the follow-ups decode plainly: only the snapshots differ between the two engines
    got = llm.generate(follow_ups, greedy(12), use_tqdm=False)
    assert llm.stats().prefix_cache_hits > hits_before
    assert [g["token_ids"] for g in got] == [e["token_ids"] for e in expected]
