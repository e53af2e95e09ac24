"""The GPU's delta rule (engine/layers/gated_deltanet_triton.py) against the torch reference it stands in for
(engine/layers/gated_deltanet.py): outputs, each sequence's state left in its slot, and the snapshots kept mid-step,
for a decode step (one token a sequence) and a prefill step whose sequences are longer than a chunk, start from a
slot or from zeros, and keep snapshots at and between chunk boundaries. On a GPU (bench/device_check.sh runs this
file there) the kernels run compiled; without one, under Triton's interpreter (tests/conftest.py sets it)."""

import pytest

pytest.importorskip("triton")
import torch  # noqa: E402

from engine.layers.gated_deltanet import chunked_delta_rule, l2norm, recurrent_delta_rule  # noqa: E402
from engine.layers.gated_deltanet_triton import CHUNK, DeltaRulePlan, delta_rule  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KEY_HEADS, VALUE_HEADS, SLOTS = 2, 4, 8


def inputs(tokens: int, dk: int, dv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(tokens, KEY_HEADS, dk, generator=g)) * dk**-0.5
    k = l2norm(torch.randn(tokens, KEY_HEADS, dk, generator=g))
    v = torch.randn(tokens, VALUE_HEADS, dv, generator=g)
    decay = -torch.rand(tokens, VALUE_HEADS, generator=g) * 0.2  # slow enough that early tokens still count
    beta = torch.rand(tokens, VALUE_HEADS, generator=g)
    states = torch.randn(SLOTS, VALUE_HEADS, dk, dv, generator=g)
    return q, k, v, decay, beta, states


def reference(q, k, v, g, beta, states, lengths, slots, fresh, cuts, tiled, chunked):
    """The torch forms, a sequence and a piece between snapshots at a time, as GatedDeltaNet runs them."""
    groups = VALUE_HEADS // KEY_HEADS
    q, k = (t.repeat(1, groups, 1) if tiled else t.repeat_interleave(groups, dim=1) for t in (q, k))
    states, out, start = states.clone(), torch.empty_like(v), 0
    for n, slot, zero, kept in zip(lengths, slots, fresh, cuts, strict=True):
        state = torch.zeros_like(states[slot]) if zero else states[slot]
        first = 0
        for cut, snapshot in [*sorted(kept), (n, None)]:
            for t in range(start + first, start + cut) if not chunked else [None]:
                rows = slice(t, t + 1) if not chunked else slice(start + first, start + cut)
                if chunked:
                    o, state = chunked_delta_rule(*(x[rows].transpose(0, 1) for x in (q, k, v, g, beta)), state)
                    out[rows] = o.transpose(0, 1)
                else:
                    o, s = recurrent_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], state[None])
                    out[rows], state = o, s[0]
            if snapshot is not None:
                states[snapshot] = state
            first = cut
        states[slot] = state
        start += n
    return out, states


def check(lengths, slots, fresh, cuts, *, chunked, tiled=False, dk=16, dv=16, seed=0):
    q, k, v, g, beta, states = inputs(sum(lengths), dk, dv, seed)
    expected_out, expected_states = reference(q, k, v, g, beta, states, lengths, slots, fresh, cuts, tiled, chunked)
    plan = DeltaRulePlan.build(lengths, slots, fresh, cuts, torch.device(DEVICE), CHUNK if chunked else None)
    pool = states.to(DEVICE)
    out = delta_rule(*(t.to(DEVICE) for t in (q, k, v, g, beta)), pool, plan, chunked=chunked, tiled=tiled)
    # A GPU's chunked matmuls take TF32 inputs (10-bit mantissas); the interpreter's are float32
    tol = 5e-3 if chunked and DEVICE == "cuda" else 1e-4
    torch.testing.assert_close(out.cpu(), expected_out, rtol=tol, atol=tol)
    torch.testing.assert_close(pool.cpu(), expected_states, rtol=tol, atol=tol)


@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
def test_a_decode_step_of_one_token_a_sequence(tiled):
    # slot 5 starts from zeros (a one-token prompt); sequence 1 keeps a snapshot in slot 7 after its token
    check([1, 1, 1], [0, 3, 5], [False, False, True], [[], [(1, 7)], []], chunked=False, tiled=tiled)


def test_the_recurrent_form_over_several_tokens_keeps_snapshots_between_them():
    check([5, 3], [1, 2], [False, True], [[(0, 6), (2, 4)], [(3, 7)]], chunked=False)


@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
def test_a_prefill_step_longer_than_a_chunk(tiled):
    long = 2 * CHUNK + 7
    # one continues its slot and keeps snapshots mid-chunk and on a chunk boundary; one starts from zeros
    cuts = [[(CHUNK, 4), (CHUNK + 9, 6)], []]
    check([long, 11], [2, 0], [False, True], cuts, chunked=True, tiled=tiled)


def test_head_dims_wider_than_a_value_block_and_not_powers_of_two():
    check([CHUNK + 3, 1], [1, 3], [True, False], [[], [(1, 5)]], chunked=True, dk=48, dv=40, seed=1)
    check([1, 1], [1, 3], [True, False], [[], []], chunked=False, dk=48, dv=40, seed=2)


def test_a_plan_cuts_each_sequence_into_pieces_that_end_at_its_snapshots():
    lengths, slots, fresh, cuts = [3, 1, 5], [5, 6, 7], [True, False, False], [[(3, 9), (1, 8)], [], [(2, 4)]]
    plan = DeltaRulePlan.build(lengths, slots, fresh, cuts, "cpu")
    assert plan.slot.tolist() == [5, 6, 7] and plan.fresh.tolist() == [1, 0, 0]
    assert plan.piece_ptr.tolist() == [0, 3, 4, 6]
    assert plan.piece_start.tolist() == [0, 1, 3, 3, 4, 6] and plan.piece_len.tolist() == [1, 2, 0, 1, 2, 3]
    assert plan.piece_keep.tolist() == [8, 9, -1, -1, 4, -1]
    chunked = DeltaRulePlan.build(lengths, slots, fresh, cuts, "cpu", chunk=2)  # no piece longer than 2
    assert chunked.piece_len.tolist() == [1, 2, 0, 1, 2, 2, 1] and chunked.piece_ptr.tolist() == [0, 3, 4, 7]
    assert chunked.piece_keep.tolist() == [8, 9, -1, -1, 4, -1, -1]


def test_the_engine_on_the_kernels_gives_transformers_tokens(
    monkeypatch, tiny_models, make_llm, hf_model, random_prompt
):
    """The tiny Qwen3.5 with its linear layers on the kernels: a batch whose prompts are cut into chunks of the
    step's token budget, then a chat whose system prompt another left, starting from that one's snapshot."""
    from engine import SamplingParams
    from engine.layers import gated_deltanet
    from tests.test_parity import hf_greedy

    monkeypatch.setattr(gated_deltanet, "uses_triton", lambda x: True)
    path = tiny_models["qwen3_5"]
    llm = make_llm(path, max_num_batched_tokens=100)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    system = random_prompt(150, 140)
    prompts = [system + [5, 6], random_prompt(37, 141), random_prompt(9, 142)]
    results = llm.generate(prompts, greedy, use_tqdm=False)
    again = llm.generate([system + [7, 8, 9]], greedy, use_tqdm=False)[0]
    assert again["num_cached_tokens"] == 128  # the snapshot kept at 128 tokens, by the chunked kernels
    for prompt, result in zip([*prompts, system + [7, 8, 9]], [*results, again]):
        assert result["token_ids"] == hf_greedy(hf_model(path), prompt, 24)
