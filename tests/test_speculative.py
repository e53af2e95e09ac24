"""Speculative decoding (engine/spec_decode/, engine/sample/rejection.py): n-gram drafts checked in one step.

What must hold: greedy output is the same token for token with and without speculation (alone, in batches beside
requests that do not speculate, over prefix-cache hits, chunked prefill, preemption and abort); sampled output
keeps the target's distribution; bad settings are refused at load with a message that says what to change.
"""

import argparse

import numpy as np
import pytest
import torch

from engine import SamplingParams
from engine.sample.rejection import verify_drafts
from engine.sample.sampler import SamplingBatch
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 5}
CODE = """def schedule(running, waiting, budget):
    batch = []
    for seq in running:
        if budget <= 0:
            break
        n = min(seq.num_uncomputed_tokens, budget)
        batch.append((seq, n))
        budget -= n
    while waiting and budget > 0:
        seq = waiting.pop(0)
        n = min(len(seq), budget)
        batch.append((seq, n))
        budget -= n
    return batch
"""


def greedy(max_tokens=40, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def repeating_prompts():
    """Prompts that repeat a random phrase, so the model's replies repeat too and n-gram drafts get accepted."""
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(3, 200, (n,), generator=g).tolist() * 3)[:40] for n in (9, 12, 13, 17)]


# ---- the proposer ------------------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_earlier_match():
    proposer = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=3)
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 7, 1, 2, 3]
    # suffix (1, 2, 3) occurs at 0 and 5; the latest is at 5, followed by 4, 5, 7
    assert proposer.lookup(tokens, 3) == [4, 5, 7]
    assert proposer.lookup(tokens, 10) == [4, 5, 7, 1, 2, 3]  # up to the end of the tokens
    assert proposer.lookup(tokens, 0) == []
    # the longest suffix wins: (8, 2, 3) is nowhere, (2, 3) is
    assert proposer.lookup([2, 3, 6, 8, 2, 3], 2) == [6, 8]
    assert proposer.lookup([1, 2, 3, 4], 4) == []  # no suffix occurs earlier
    assert proposer.lookup([5], 4) == []


# ---- verification ------------------------------------------------------------------------------------------------
def _rows_batch(temperatures: list[float], generators=None) -> SamplingBatch:
    all_greedy = all(t == 0 for t in temperatures)
    return SamplingBatch(
        temperatures=None if all_greedy else torch.tensor(temperatures),
        top_k=None,
        top_p=None,
        min_p=None,
        repetition_penalties=None,
        seen_tokens=None,
        generators=generators or [None] * len(temperatures),
        all_greedy=all_greedy,
    )


def test_greedy_verification_keeps_drafts_up_to_the_first_wrong_one():
    logits = torch.full((7, 10), -5.0)
    argmax = [4, 6, 1, 8, 3, 2, 5]
    logits[torch.arange(7), argmax] = 5.0
    # request A drafts [4, 6, 0] (third wrong: the model says 1); request B drafts [3, 2] (both right), then 5
    drafts = torch.tensor([4, 6, 0, -1, 3, 2, -1])
    offsets = torch.tensor([0, 1, 2, 3, 0, 1, 2])
    out = verify_drafts(logits, _rows_batch([0.0] * 7), drafts, offsets)
    assert out.tolist() == [4, 6, 1, -1, 3, 2, 5]


def test_sampled_verification_keeps_the_target_distribution():
    """Chi-square over 40,000 draws: the first token a request gets is distributed as p, whatever was drafted
    (a likely draft, an unlikely one, one outside top-k), and so is the token after an accepted draft."""
    torch.manual_seed(0)
    vocab, draws = 6, 40_000
    p = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])
    logits = p.log()
    for draft in (1, 5, 2):
        # each request: one drafted token, then the bonus row
        rows = logits.repeat(2 * draws, 1)
        drafts = torch.tensor([draft, -1]).repeat(draws)
        offsets = torch.tensor([0, 1]).repeat(draws)
        out = verify_drafts(rows, _rows_batch([1.0] * (2 * draws)), drafts, offsets).view(draws, 2)
        first = torch.bincount(out[:, 0], minlength=vocab).double()
        expected = p.double() * draws
        chi2 = float(((first - expected) ** 2 / expected).sum())
        assert chi2 < 20.5, (draft, first.tolist(), expected.tolist())  # 5 d.o.f.: p < 0.001
        accepted = out[:, 0] == draft
        assert abs(accepted.float().mean().item() - p[draft].item()) < 0.015
        # after an accepted draft the bonus row samples from p; after a rejection nothing follows
        assert (out[~accepted, 1] == -1).all()
        second = torch.bincount(out[accepted, 1], minlength=vocab).double()
        expected = p.double() * int(accepted.sum())
        assert float(((second - expected) ** 2 / expected).sum()) < 20.5


def test_a_seeded_request_verifies_the_same_way_twice():
    logits = torch.randn(6, 50)
    drafts, offsets = torch.tensor([3, 7, 9, -1, 4, -1]), torch.tensor([0, 1, 2, 3, 0, 1])

    def run():
        gen = torch.Generator().manual_seed(11)
        return verify_drafts(logits, _rows_batch([0.8] * 6, [gen] * 6), drafts, offsets).tolist()

    assert run() == run()


# ---- the engine: exact greedy output -----------------------------------------------------------------------------
def test_greedy_output_is_unchanged_alone_and_in_batches(make_llm, tiny_llama, repeating_prompts):
    plain = make_llm(tiny_llama).generate(repeating_prompts, greedy(), use_tqdm=False)
    llm = make_llm(tiny_llama, speculative_config=NGRAM)
    batched = llm.generate(repeating_prompts, greedy(), use_tqdm=False)
    alone = [llm.generate([p], greedy(), use_tqdm=False)[0] for p in repeating_prompts]
    for p, b, a in zip(plain, batched, alone, strict=True):
        assert b["token_ids"] == p["token_ids"]
        assert a["token_ids"] == p["token_ids"]
    stats = llm.stats()
    assert stats.speculative_method == "ngram"
    assert stats.spec_steps > 0 and stats.spec_draft_tokens >= stats.spec_accepted_tokens > 0
    # Each reply says what its drafts gave (its stats line in the app), and together they are the engine's counts
    assert all(p["speculation"] is None for p in plain)
    per_request = [r["speculation"] for r in batched + alone]
    assert all(steps > 0 and drafted >= accepted >= 0 for steps, drafted, accepted in per_request)
    totals = tuple(map(sum, zip(*per_request, strict=True)))
    assert totals == (stats.spec_steps, stats.spec_draft_tokens, stats.spec_accepted_tokens)
    assert stats.spec_mean_accepted_length > 1.5  # the repeating replies gain: more than one token a step
    assert stats.num_generated_tokens == 2 * 4 * 40  # every token counted once, drafted or not
    assert stats.free_blocks == stats.num_blocks  # every block given back, rejected drafts' included


def test_requests_that_cannot_speculate_run_beside_those_that_do(make_llm, tiny_llama, repeating_prompts):
    """A penalty, logprobs or a logit bias beside speculating requests in the same steps: each gets what it gets
    without speculation (the first two decode one token a step, the bias applies to every row it is in)."""
    params = [
        greedy(),
        greedy(repetition_penalty=1.3),
        greedy(logprobs=2),
        greedy(logit_bias={5: 3.0, 9: -2.0}),
    ]
    plain = make_llm(tiny_llama).generate(repeating_prompts, params, use_tqdm=False)
    llm = make_llm(tiny_llama, speculative_config=NGRAM)
    spec = llm.generate(repeating_prompts, params, use_tqdm=False)
    for p, s in zip(plain, spec, strict=True):
        assert s["token_ids"] == p["token_ids"]
    assert [d.keys() for d in spec[2]["logprobs"]] == [d.keys() for d in plain[2]["logprobs"]]
    for d_spec, d_plain in zip(spec[2]["logprobs"], plain[2]["logprobs"], strict=True):
        assert d_spec == pytest.approx(d_plain, abs=1e-4)
    assert llm.stats().spec_accepted_tokens > 0


def test_prefix_hits_chunked_prefill_and_preemption_change_nothing(make_llm, tiny_llama, repeating_prompts):
    plain = make_llm(tiny_llama).generate(repeating_prompts, greedy(60), use_tqdm=False)
    # 16 blocks of 16 for four requests of 100 tokens (7 blocks each): some are preempted; 32-token chunks
    llm = make_llm(tiny_llama, speculative_config=NGRAM, num_kvcache_blocks=16, max_num_batched_tokens=32)
    first = llm.generate(repeating_prompts, greedy(60), use_tqdm=False)
    again = llm.generate(repeating_prompts, greedy(60), use_tqdm=False)  # served from the prefix cache
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert stats.spec_accepted_tokens > 0
    for p, f, a in zip(plain, first, again, strict=True):
        assert f["token_ids"] == p["token_ids"]
        assert a["token_ids"] == p["token_ids"]
    assert stats.free_blocks == stats.num_blocks


def test_stop_strings_and_length_cut_accepted_drafts(make_llm, tiny_llama, repeating_prompts):
    """Several tokens arrive in one step; the reply still ends exactly where plain decoding ends it."""
    plain_llm = make_llm(tiny_llama)
    llm = make_llm(tiny_llama, speculative_config=NGRAM)
    prompt = repeating_prompts[0]
    reply = plain_llm.generate([prompt], greedy(30), use_tqdm=False)[0]
    stop_token = reply["token_ids"][17]
    for params in (greedy(23), greedy(30, stop_token_ids=[stop_token])):
        assert (
            llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"]
            == plain_llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"]
        )


def test_abort_mid_speculation_frees_every_block(make_llm, tiny_llama, repeating_prompts):
    llm = make_llm(tiny_llama, speculative_config=NGRAM)
    ids = [llm.add_request(p, greedy(200)) for p in repeating_prompts]
    for _ in range(12):
        llm.step()
    assert llm.stats().spec_steps > 0
    for request_id in ids:
        assert llm.abort_request(request_id)
    assert not llm.has_unfinished_requests()
    stats = llm.stats()
    assert stats.free_blocks == stats.num_blocks
    # and the engine serves on, exactly
    assert (
        llm.generate([repeating_prompts[1]], greedy(), use_tqdm=False)[0]["token_ids"]
        == make_llm(tiny_llama).generate([repeating_prompts[1]], greedy(), use_tqdm=False)[0]["token_ids"]
    )


def test_bundled_model_edit_is_token_identical():
    """The bundled SmolLM2 (its kernels round activations to bf16, where the smallest difference in attention
    turns a token) returns a file with one change, greedy, the same with and without n-gram drafts."""
    from engine import LLM
    from engine.loader.bundled import bundled_gguf_path

    # No prefix cache: a second run would prefill only the prompt's tail, which rounds differently on its own
    ngram = {"method": "ngram", "num_speculative_tokens": 8}
    llm = LLM(str(bundled_gguf_path()), dtype="float32", speculative_config=ngram, enable_prefix_caching=False)
    prompt = llm.encode_chat(
        [{"role": "user", "content": f"Return this code with `budget` renamed to `room`:\n\n{CODE}"}]
    )
    params = SamplingParams(temperature=0, max_tokens=160)
    spec = llm.generate([prompt], params, use_tqdm=False)[0]
    speculator, llm.speculator = llm.speculator, None
    plain = llm.generate([prompt], params, use_tqdm=False)[0]
    assert spec["token_ids"] == plain["token_ids"]
    assert speculator.stats.accepted_tokens > 10


# ---- sampled requests through the engine --------------------------------------------------------------------------
def test_sampled_requests_speculate_and_stay_in_range(make_llm, tiny_llama, repeating_prompts):
    llm = make_llm(tiny_llama, speculative_config=NGRAM)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=50, ignore_eos=True, seed=3)
    out = llm.generate(repeating_prompts, params, use_tqdm=False)
    assert all(len(o["token_ids"]) == 50 for o in out)
    assert llm.stats().spec_accepted_tokens > 0
    again = make_llm(tiny_llama, speculative_config=NGRAM).generate(repeating_prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in again] == [o["token_ids"] for o in out]  # seeded: reproducible


# ---- settings ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, message",
    [
        ({"method": "eagle"}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a whole number in 1..16"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "1..16"),
        ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "must not exceed"),
        ({"method": "ngram", "lookahead": 3}, "unknown speculative_config key"),
        ({"num_speculative_tokens": 3}, "needs a 'method'"),
    ],
)
def test_bad_speculative_config_is_refused(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_engine_refuses_what_speculation_cannot_serve_yet(make_llm, tiny_llama, tiny_models):
    with pytest.raises(TypeError, match="speculative_config is a dict"):
        make_llm(tiny_llama, speculative_config="ngram")
    with pytest.raises(ValueError, match="async_scheduling"):
        make_llm(tiny_llama, speculative_config=NGRAM, async_scheduling=True)
    # a hybrid model speculates on the CPU (tests/test_hybrid_speculation.py); its GPU kernels do not keep the states
    assert make_llm(tiny_models["qwen3_5"], speculative_config=NGRAM).speculator is not None


def test_command_line_takes_a_json_object():
    from entrypoints.cli import add_engine_settings

    ap = argparse.ArgumentParser()
    add_engine_settings(ap)
    args = ap.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(SystemExit):
        ap.parse_args(["--speculative-config", "ngram"])


def test_draft_rows_of_a_step(make_llm, tiny_llama):
    """Step inputs of a request checking drafts: its input and drafts as tokens, a logits row for each."""
    from engine.core.scheduler import ScheduledSeq
    from engine.core.sequence import Sequence
    from engine.runner.step_inputs import SampledRows, prepare_step

    seq = Sequence([5, 6, 7, 8, 9], greedy())
    seq.num_computed_tokens, seq.block_tables = 4, [[3]]
    other = Sequence([1, 2, 3], greedy())
    other.num_computed_tokens, other.block_tables = 2, [[4]]
    batch = [ScheduledSeq(seq, 3, [11, 12]), ScheduledSeq(other, 1)]
    assert batch[0].samples and batch[1].samples
    step = prepare_step(batch, 16, SampledRows([]))
    assert step.token_ids.tolist() == [9, 11, 12, 3]
    assert step.positions.tolist() == [4, 5, 6, 2]
    assert step.logits_index.tolist() == [0, 1, 2, 3]
    assert step.draft_token_ids.tolist() == [11, 12, -1, -1]
    assert step.draft_offsets.tolist() == [0, 1, 2, 0]
    assert np.array_equal(step.slot_mapping, [52, 53, 54, 66])
    # to attention: four decode rows, the checking request's each reading up to its own position
    assert step.query_lens.tolist() == [1, 1, 1, 1]
    assert step.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert step.seq_lens.tolist() == [5, 6, 7, 3]
    assert step.block_tables.tolist() == [[3], [3], [3], [4]]


def test_drafts_never_preempt_another_request():
    """With no block free, a request whose drafts would need a new block decodes without them; nobody is preempted."""
    from engine.core.block_manager import BlockManager
    from engine.core.scheduler import Scheduler
    from engine.core.sequence import Sequence, SequenceStatus

    bm = BlockManager(2, 4, True)
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    first, second = Sequence([1, 2, 3], greedy()), Sequence([5, 6], greedy())  # blocks of 4 tokens
    for seq in (first, second):
        scheduler.add(seq)
    assert [item.num_new_tokens for item in scheduler.schedule()] == [3, 2]  # both blocks taken
    for seq, token in ((first, 9), (second, 8)):
        seq.num_computed_tokens = len(seq.token_ids)
        seq.token_ids.append(token)
    first.draft_token_ids = [1, 2, 3]  # the first at position 4: a new block, and none is free
    second.draft_token_ids = [5]  # position 3: in its own block
    batch = scheduler.schedule()
    assert [(item.num_new_tokens, item.draft_token_ids) for item in batch] == [(1, []), (2, [5])]
    assert scheduler.num_preemptions == 0 and second.status == SequenceStatus.RUNNING


def test_a_chat_reply_carries_what_its_drafts_gave(make_llm, tiny_llama):
    """The app's local backend hands the engine's per-request counts to the reply (its stats line shows them)."""
    from app.backend import LocalBackend
    from app.chat_settings import ChatSettings
    from engine import EngineThread

    thread = EngineThread(make_llm(tiny_llama, speculative_config=NGRAM))
    try:
        messages = [{"role": "user", "content": "Paged attention stores keys and values in blocks. " * 6}]
        settings = ChatSettings(temperature=0, max_tokens=40)
        stream, _ = LocalBackend(thread, "tiny").submit(messages, settings)
        deltas = list(stream)
    finally:
        thread.shutdown()
    steps, drafted, accepted = deltas[-1].speculation
    assert deltas[-1].finished and steps > 0 and drafted >= accepted
    assert all(d.speculation is None for d in deltas[:-1])  # once, with the last increment


def test_a_request_whose_drafts_are_seldom_accepted_sits_out():
    """Below min_acceptance_rate a request stops checking drafts for a while (1, 2, 4, ... steps), as after a miss;
    at 0 only misses do that. Greedy output is unchanged either way: this only decides the cost."""
    from engine.core.sequence import Sequence
    from engine.spec_decode.speculator import DraftState, Speculator

    def run(least: float) -> list[int]:
        speculator = Speculator(SpeculativeConfig("ngram", 4), NgramProposer(2, 4), least)
        seq = Sequence([1, 2, 3], greedy())
        seq.draft_state = DraftState(4)
        skips = []
        for _ in range(3):  # each step: 1 of 4 drafts accepted
            speculator.record(seq, 4, 1)
            skips.append(seq.draft_state.skip_steps)
        return skips

    assert run(0.0) == [0, 0, 0]  # it keeps drafting a + 1 = 2 tokens
    assert run(0.5) == [0, 1, 2]  # the average falls to 0.625, 0.4375 (sits out 1 step), 0.34375 (2)
    with pytest.raises(ValueError, match="min_acceptance_rate must be a number in 0..1"):
        SpeculativeConfig.parse({"method": "ngram", "min_acceptance_rate": 1.5})


def test_the_cpu_default_threshold_is_applied(make_llm, tiny_llama):
    assert make_llm(tiny_llama, speculative_config=NGRAM).speculator.min_acceptance == 0.5
    never = {**NGRAM, "min_acceptance_rate": 0}
    assert make_llm(tiny_llama, speculative_config=never).speculator.min_acceptance == 0
