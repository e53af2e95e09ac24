"""Sampling: the Sampler on crafted logits, per-request seeds, penalties, SamplingParams' validation, and
Sampler.prepare's columns. Stop conditions are in test_stop_conditions.py."""

import numpy as np
import pytest
import torch

from engine import SamplingParams
from engine.sample.sampler import Sampler, SamplingBatch, apply_repetition_penalty, greedy_tokens

V = 24
DRAWS = 20000


def make_batch(rows, temperature=1.0, top_k=None, top_p=None, min_p=None, penalty=None, seen=None, generators=None):
    def col(value, dtype):
        return None if value is None else torch.full((rows,), value, dtype=dtype)

    temps = torch.full((rows,), float(temperature))
    return SamplingBatch(
        temperatures=temps,
        top_k=col(top_k, torch.int64),
        top_p=col(top_p, torch.float32),
        min_p=col(min_p, torch.float32),
        repetition_penalties=col(penalty, torch.float32),
        seen_tokens=seen,
        generators=generators or [None] * rows,
        all_greedy=bool((temps == 0).all()),
    )


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    # Distinct values with a moderate spread: every token has a real chance before filtering.
    return torch.randn(V, generator=g) * 1.5


def allowed_and_probs(logits, temperature=1.0, top_k=None, top_p=None, min_p=None):
    """The reference: which tokens may be drawn, and with what probability (vLLM's definitions)."""
    probs = (logits / temperature).softmax(-1)
    keep = torch.ones(V, dtype=torch.bool)
    if top_k is not None:
        keep &= logits >= logits.topk(top_k).values[-1]
    if top_p is not None:
        p = torch.where(keep, probs, 0.0)
        p = p / p.sum()
        order = p.argsort(descending=True)
        before = torch.cumsum(p[order], 0) - p[order]  # mass of the strictly more likely tokens
        keep_sorted = before < top_p
        keep &= torch.zeros(V, dtype=torch.bool).scatter(0, order, keep_sorted)
    p = torch.where(keep, probs, 0.0)
    p = p / p.sum()
    if min_p is not None:
        keep &= p >= min_p * p.max()
        p = torch.where(keep, p, 0.0)
        p = p / p.sum()
    return keep, p


@pytest.mark.parametrize(
    "case",
    [
        dict(top_k=1),
        dict(top_k=5),
        dict(top_k=5, temperature=0.5),
        dict(top_p=0.5),
        dict(top_p=0.9, temperature=2.0),
        dict(min_p=0.2),
        dict(min_p=0.05, temperature=0.7),
        dict(top_k=8, top_p=0.6),
        dict(top_k=10, top_p=0.8, min_p=0.1),
        dict(),
        dict(temperature=3.0),
    ],
)
def test_samples_stay_in_the_allowed_set_with_the_right_frequencies(case, logits):
    torch.manual_seed(1)
    keep, expected = allowed_and_probs(logits, **case)
    assert 1 <= int(keep.sum()) < V or case in ({}, {"temperature": 3.0})
    tokens = Sampler()(logits.expand(DRAWS, V).clone(), make_batch(DRAWS, **case))
    assert tokens.shape == (DRAWS,)
    outside = set(tokens.tolist()) - set(keep.nonzero().flatten().tolist())
    assert not outside, f"sampled disallowed tokens {sorted(outside)}"
    freq = torch.bincount(tokens, minlength=V).float() / DRAWS
    # Binomial standard error is at most 0.0036 for 20000 draws: 0.015 is over 4 of them.
    assert (freq - expected).abs().max() < 0.015, (freq, expected)
    assert set(tokens.tolist()) == set(keep.nonzero().flatten().tolist()) or expected[keep].min() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_tokens_pick_the_first_largest_logit_as_argmax_does(dtype):
    """Ties (few distinct values) and NaNs: the same index as argmax, row by row."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        rows = torch.randint(0, 4, (3, 5000), generator=g).to(dtype)
        rows[1, 4000] = float("nan")
        rows[1, 17] = float("nan")
        assert greedy_tokens(rows).tolist() == rows.argmax(-1).tolist() == [rows[0].argmax(), 17, rows[2].argmax()]


def test_greedy_rows_and_top_k_1_take_the_argmax_in_a_mixed_batch(logits):
    rows = torch.stack([logits, logits.flip(0), logits * -1, logits])
    batch = make_batch(4, temperature=1.0)
    batch.temperatures = torch.tensor([0.0, 0.0, 1.0, 1.0])
    batch.top_k = torch.tensor([V, V, 1, 1])
    batch.all_greedy = False
    for _ in range(20):
        assert Sampler()(rows.clone(), batch).tolist() == rows.argmax(-1).tolist()
    assert Sampler()(rows.clone(), make_batch(4, temperature=0.0)).tolist() == rows.argmax(-1).tolist()


def test_per_row_generators_make_draws_reproducible_and_independent_of_the_batch(logits):
    def draw(seed, rows, row):
        gens = [None] * rows
        gens[row] = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(30):
            out.append(Sampler()(logits.expand(rows, V).clone(), make_batch(rows, generators=gens))[row].item())
        return out

    alone = draw(7, 1, 0)
    assert draw(7, 5, 3) == alone
    assert draw(7, 2, 1) == alone
    assert draw(8, 1, 0) != alone


COMPILED_CASES = {
    "temperature": dict(),
    "min-p, penalty, greedy rows": dict(min_p=0.02, penalty=1.3, greedy_rows=True),
    "greedy with a penalty": dict(greedy=True, penalty=1.3),
}


def compiled_case_batch(rows, vocab, top_k=None, top_p=None, min_p=None, penalty=None, greedy=False, greedy_rows=False):
    g = torch.Generator().manual_seed(5)
    seen = torch.rand(rows, vocab, generator=g) < 0.05 if penalty else None
    batch = make_batch(
        rows, temperature=0.0 if greedy else 0.8, top_k=top_k, top_p=top_p, min_p=min_p, penalty=penalty, seen=seen
    )
    if greedy_rows:
        batch.temperatures[::3] = 0.0
    return batch


@pytest.mark.parametrize("case", COMPILED_CASES.values(), ids=COMPILED_CASES.keys())
def test_compiled_sampler_picks_the_tokens_the_eager_one_does(case):
    """The GPU compiles the sampler for large batches; given the same noise, it must pick the same
    tokens (here through inductor's CPU backend: the same graph, compiled for another device)."""
    from engine.sample.sampler import CompiledPick

    rows, vocab = 16, 1000
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(4)) * 2
    batch = compiled_case_batch(rows, vocab, **case)
    compiled = Sampler(compiled=True)
    compiled.pick = CompiledPick(min_rows=rows)
    for draw in range(3):
        torch.manual_seed(draw)
        expected = Sampler()(logits.clone(), batch)
        torch.manual_seed(draw)
        assert compiled(logits.clone(), batch).tolist() == expected.tolist()
    assert compiled.kind == "compiled" and not compiled.pick.failed


def test_sampler_compiles_only_large_batches_and_falls_back_when_compiling_fails(caplog):
    from engine.sample.sampler import CompiledPick

    calls = []

    def broken(*args):
        calls.append(args[0].shape[0])
        raise RuntimeError("inductor: no C++ compiler\nmore detail")

    sampler = Sampler(compiled=True)
    sampler.pick = pick = CompiledPick(min_rows=8)
    pick.compiled = broken
    batch = compiled_case_batch(4, 50)
    logits = torch.randn(4, 50)
    torch.manual_seed(0)
    expected = Sampler()(logits, batch)
    torch.manual_seed(0)
    assert sampler(logits, batch).tolist() == expected.tolist() and calls == []  # 4 rows: eager, nothing compiled
    big, logits = compiled_case_batch(8, 50), torch.randn(8, 50)
    torch.manual_seed(1)
    expected = Sampler()(logits, big)
    torch.manual_seed(1)
    with caplog.at_level("WARNING", logger="engine"):
        assert sampler(logits, big).tolist() == expected.tolist()
    assert calls == [8] and sampler.kind == "eager (compile failed)"
    assert "sampling eagerly from now on: RuntimeError: inductor: no C++ compiler" in caplog.text
    sampler(logits, big)
    assert calls == [8]  # never tried again


def test_sampler_keeps_top_k_and_top_p_batches_eager():
    """Their sort dominates, and inductor (torch 2.11, CUDA) fails on their cumsum with dynamic shapes."""
    from engine.sample.sampler import CompiledPick

    pick = CompiledPick(min_rows=2)
    pick.compiled = lambda *args: pytest.fail("a top-k/top-p batch went to the compiler")
    sampler = Sampler(compiled=True)
    sampler.pick = pick
    for case in (dict(top_k=5), dict(top_p=0.9), dict(top_k=5, top_p=0.9, min_p=0.1)):
        batch, logits = compiled_case_batch(8, 50, **case), torch.randn(8, 50)
        torch.manual_seed(2)
        expected = Sampler()(logits, batch)
        torch.manual_seed(2)
        assert sampler(logits, batch).tolist() == expected.tolist()
    assert sampler.kind == "compiled"


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(3)
    scores = torch.randn(4, 50, generator=g) * 3
    scores[0, 5] = 0.0  # exactly zero stays zero
    input_ids = torch.randint(0, 50, (4, 12), generator=g)
    input_ids[0, 0] = 5
    seen = torch.zeros(4, 50, dtype=torch.bool).scatter(1, input_ids, True)
    for penalty in (1.3, 0.7, 2.0):
        ours = apply_repetition_penalty(scores.clone(), seen, torch.full((4,), penalty))
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, scores.clone())
        torch.testing.assert_close(ours, theirs)
        assert not torch.equal(ours, scores)
    # Per-row penalties: a row with 1.0 is untouched.
    ours = apply_repetition_penalty(scores.clone(), seen, torch.tensor([1.0, 1.5, 1.0, 1.5]))
    torch.testing.assert_close(ours[0], scores[0])
    torch.testing.assert_close(ours[1], RepetitionPenaltyLogitsProcessor(1.5)(input_ids[1:2], scores[1:2].clone())[0])


def test_repetition_penalty_end_to_end_matches_transformers_generate(tiny_qwen2, make_llm, hf_model, random_prompt):
    prompt = random_prompt(12, 40)
    llm = make_llm(tiny_qwen2)
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)[0]
    penalized = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, repetition_penalty=1.5), use_tqdm=False
    )[0]
    assert penalized["token_ids"] != plain["token_ids"]
    model = hf_model(tiny_qwen2)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=32,
            eos_token_id=[],
            pad_token_id=0,
            repetition_penalty=1.5,
        )
    assert penalized["token_ids"] == out[0, len(prompt) :].tolist()


# ---- through the engine ---------------------------------------------------------------------------
def test_seeded_requests_are_reproducible_alone_batched_and_under_preemption(tiny_qwen2, make_llm, random_prompt):
    prompt = random_prompt(10, 50)
    others = [random_prompt(n, 51 + n) for n in (4, 19, 33)]

    def seeded(seed):
        return SamplingParams(temperature=1.5, max_tokens=32, ignore_eos=True, seed=seed)

    llm = make_llm(tiny_qwen2)
    alone = llm.generate([prompt], seeded(7), use_tqdm=False)[0]["token_ids"]
    assert llm.generate([prompt], seeded(7), use_tqdm=False)[0]["token_ids"] == alone
    batched = llm.generate(
        others[:1] + [prompt] + others[1:] + [prompt],
        [seeded(1), seeded(7), SamplingParams(temperature=1.5, max_tokens=32), seeded(3), seeded(7)],
        use_tqdm=False,
    )
    assert batched[1]["token_ids"] == alone and batched[4]["token_ids"] == alone
    assert llm.generate([prompt], seeded(8), use_tqdm=False)[0]["token_ids"] != alone
    assert len({tuple(llm.generate([prompt], seeded(s), use_tqdm=False)[0]["token_ids"]) for s in range(4)}) == 4

    # Chunked prefill and preemption change how the work is split, not what a seed draws.
    tight = make_llm(tiny_qwen2, num_kvcache_blocks=6, max_model_len=64, max_num_batched_tokens=5)
    results = tight.generate([prompt] + others, [seeded(7)] + [seeded(9)] * 3, use_tqdm=False)
    assert tight.stats().num_preemptions > 0
    assert results[0]["token_ids"] == alone


def test_unseeded_sampling_actually_samples(tiny_qwen2, make_llm, random_prompt):
    llm = make_llm(tiny_qwen2)
    params = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True)
    outs = {tuple(r["token_ids"]) for r in llm.generate([random_prompt(6, 60)] * 4, params, use_tqdm=False)}
    assert len(outs) > 1


def test_greedy_is_temperature_zero_and_ignores_filters(tiny_qwen2, make_llm, random_prompt):
    llm = make_llm(tiny_qwen2)
    prompt = random_prompt(9, 70)
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    filtered = llm.generate(
        [prompt],
        SamplingParams(temperature=0, top_p=0.3, top_k=3, min_p=0.2, max_tokens=24, ignore_eos=True, seed=5),
        use_tqdm=False,
    )[0]
    top1 = llm.generate(
        [prompt], SamplingParams(temperature=1.0, top_k=1, max_tokens=24, ignore_eos=True), use_tqdm=False
    )[0]
    assert greedy["token_ids"] == filtered["token_ids"] == top1["token_ids"]
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.1).greedy


# ---- validation -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(stop=[1]), "stop"),
        (dict(stop_token_ids=["a"]), "stop_token_ids"),
        (dict(seed=1.5), "seed"),
    ],
)
def test_sampling_params_validation(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens, p.ignore_eos, p.seed) == (
        1.0,
        1.0,
        -1,
        0.0,
        1.0,
        64,
        False,
        None,
    )
    assert SamplingParams(stop="x").stop_list == ["x"]
    assert SamplingParams(stop=["a", "b"]).stop_list == ["a", "b"]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(top_k=0).top_k == 0  # 0 means off, as in vLLM


# ---- Sampler.prepare: each row's parameters as device columns, only those some row uses ------------------
PREP_VOCAB = 100


def cpu_upload(arrays, dtype):
    return [torch.from_numpy(np.ascontiguousarray(a)).to(dtype) for a in arrays]


def sampling_seq(prompt: list[int], params: SamplingParams, output: tuple[int, ...] = (), num_pending: int = 0):
    """A sequence about to sample, with `output` read by the host and `num_pending` more tokens only on the device."""
    from engine.core.sequence import Sequence

    seq = Sequence(prompt, params)
    seq.token_ids.extend(output)
    seq.num_pending_tokens = num_pending
    return seq


def prepare(seqs, last_sampled=None, rows=None):
    return Sampler(PREP_VOCAB).prepare(seqs, cpu_upload, last_sampled, rows)


def test_prepare_gives_greedy_rows_no_columns():
    batch = prepare(
        [
            sampling_seq([1, 2], SamplingParams(temperature=0)),
            sampling_seq([3], SamplingParams(temperature=0, top_k=5, top_p=0.5)),
        ]
    )
    assert batch.all_greedy and not batch.changes_logits
    assert all(
        getattr(batch, f) is None
        for f in (
            "temperatures",
            "top_k",
            "top_p",
            "min_p",
            "seen_tokens",
            "logit_bias",
            "output_counts",
            "grammar_rows",
        )
    )


def test_prepare_gives_only_the_columns_some_row_uses_with_top_k_clamped_to_the_vocabulary():
    batch = prepare(
        [
            sampling_seq([1], SamplingParams(temperature=0.7, top_k=5)),
            sampling_seq([2], SamplingParams(temperature=1.0, top_p=0.9)),  # top_k -1: the whole vocabulary
            sampling_seq([3], SamplingParams(temperature=0.0, top_k=1000)),  # a greedy row among sampled ones
            sampling_seq([4], SamplingParams(temperature=0.5, top_k=0)),  # 0 also means off
        ]
    )
    assert not batch.all_greedy
    assert batch.temperatures.dtype == torch.float32
    assert batch.temperatures.tolist() == pytest.approx([0.7, 1.0, 0.0, 0.5])
    assert batch.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0, 1.0])
    assert batch.top_k.dtype == torch.int64 and batch.top_k.tolist() == [5, PREP_VOCAB, PREP_VOCAB, PREP_VOCAB]
    assert batch.min_p is None and batch.repetition_penalties is None

    # top_k at or above the vocabulary limits nothing: no column.
    batch = prepare(
        [
            sampling_seq([1], SamplingParams(top_k=PREP_VOCAB)),
            sampling_seq([2], SamplingParams(top_k=PREP_VOCAB + 1, min_p=0.1)),
        ]
    )
    assert batch.top_k is None and batch.top_p is None
    assert batch.min_p.tolist() == pytest.approx([0.0, 0.1])


def test_prepare_marks_the_tokens_each_penalised_row_has_seen_and_counts_its_output():
    first = sampling_seq([3, 4, 3], SamplingParams(temperature=0, repetition_penalty=1.2))
    plain = sampling_seq([5, 6], SamplingParams(temperature=0))  # not penalised: nothing marked
    # Its output is 8, then another 8 still pending: row 4 of the last step's sampled tokens, added on the device.
    waiting = sampling_seq(
        [7], SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.5), output=(8,), num_pending=1
    )
    last_sampled = torch.tensor([0, 0, 0, 0, 8])
    batch = prepare([first, plain, waiting], last_sampled, {waiting.seq_id: 4})

    assert batch.all_greedy and batch.changes_logits
    assert batch.repetition_penalties.tolist() == pytest.approx([1.2, 1.0, 1.5])
    seen = {row: batch.seen_tokens[row].nonzero().flatten().tolist() for row in range(3)}
    assert seen == {0: [3, 4], 1: [], 2: [7, 8]}
    assert batch.frequency_penalties.tolist() == pytest.approx([0.0, 0.0, 0.5])
    assert batch.output_counts[2, 8].item() == 2  # the prompt's 7 is not output
    assert batch.output_counts.sum().item() == 2


def test_prepare_puts_each_logit_bias_in_its_row():
    batch = prepare(
        [
            sampling_seq([1], SamplingParams(temperature=0)),
            sampling_seq([2], SamplingParams(temperature=0, logit_bias={5: -100.0, 9: 2.5})),
        ]
    )
    assert batch.logit_bias.shape == (2, PREP_VOCAB)
    assert batch.logit_bias[0].abs().sum().item() == 0
    assert {t: batch.logit_bias[1, t].item() for t in batch.logit_bias[1].nonzero().flatten().tolist()} == {
        5: -100.0,
        9: 2.5,
    }
