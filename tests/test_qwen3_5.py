"""Qwen3.5's hybrid layers beyond the parity suite (tests/test_parity.py runs the tiny Qwen3.5 of tests/conftest.py:
logits at every step, a batch, chunked prefill): the two forms of the gated delta rule agree, a request's state
slot comes back when it finishes or is preempted, requests beyond the slots wait for one, and a prefix hit starts
from a state snapshot, kept least recently used first."""

import pytest
import torch
import transformers

from engine import SamplingParams
from engine.layers.gated_deltanet import chunked_delta_rule, l2norm, recurrent_delta_rule
from tests.conftest import build_tokenizer, qwen3_5_model, widen_weights
from tests.test_parity import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("length", [1, 63, 64, 150])
def test_the_chunked_rule_carries_the_state_the_recurrent_rule_does(length):
    g = torch.Generator().manual_seed(length)
    heads, dk, dv = 3, 8, 5
    q, k = (l2norm(torch.randn(heads, length, dk, generator=g)) for _ in range(2))
    v = torch.randn(heads, length, dv, generator=g)
    decay = -torch.rand(heads, length, generator=g)
    beta = torch.rand(heads, length, generator=g)
    start = torch.randn(heads, dk, dv, generator=g)
    out, state = chunked_delta_rule(q, k, v, decay, beta, start)
    expected, step_state = [], start[None]
    for t in range(length):
        o, step_state = recurrent_delta_rule(
            q[None, :, t], k[None, :, t], v[None, :, t], decay[None, :, t], beta[None, :, t], step_state
        )
        expected.append(o[0])
    torch.testing.assert_close(out, torch.stack(expected, dim=1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, step_state[0], rtol=1e-4, atol=1e-4)


def test_preempted_and_finished_requests_give_their_state_slots_back(tiny_models, make_llm, hf_model, random_prompt):
    """8 blocks of 16 hold the full-attention layer's KV of two 80-token requests: four run in turns, preempted
    and recomputed from a fresh state."""
    path = tiny_models["qwen3_5"]
    llm = make_llm(path, num_kvcache_blocks=8, max_num_batched_tokens=16)
    bm = llm.block_manager
    prompts = [random_prompt(n, 110 + n) for n in (30, 41, 25, 36)]
    results = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    for prompt, result in zip(prompts, results):
        assert result["token_ids"] == hf_greedy(hf_model(path), prompt, 40)
    assert sorted(bm.states.free_running) == list(range(bm.states.num_running))


def test_requests_beyond_the_state_slots_wait_for_one(tiny_models, make_llm, hf_model, random_prompt):
    path = tiny_models["qwen3_5"]
    llm = make_llm(path, max_num_seqs=2)
    assert llm.block_manager.states.num_running == 2
    prompts = [random_prompt(n, 120 + n) for n in (7, 19, 12, 3, 28)]
    seen = []
    schedule = llm.scheduler.schedule
    llm.scheduler.schedule = lambda: [seen.append(len(llm.scheduler.running)), schedule()][1]
    results = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert max(seen) <= 2
    for prompt, result in zip(prompts, results):
        assert result["token_ids"] == hf_greedy(hf_model(path), prompt, 40)


def test_a_shared_prompt_starts_from_the_newest_snapshot_before_the_hit(tiny_models, make_llm, hf_model, random_prompt):
    """Two chats with one 300-token system prompt: the second's KV hit is 288 tokens (18 blocks); its linear layers'
    state was kept at 128 and 256 tokens (state_snapshot_tokens), so it starts at 256 and computes the rest."""
    path = tiny_models["qwen3_5"]
    llm = make_llm(path, max_num_batched_tokens=100)  # chunks that end off the snapshot positions
    system = random_prompt(300, 130)
    prompts = [system + [5, 6], system + [7, 8, 9]]
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    second = llm.generate(prompts[1:], GREEDY, use_tqdm=False)[0]
    assert (first["num_cached_tokens"], second["num_cached_tokens"]) == (0, 256)
    stats = llm.stats()  # snapshots at 128 and 256; no chat runs now
    slot_bytes = 3 * (4 * 16 * 16 * 4 + (2 * 32 + 64) * 3 * 4)  # 3 linear layers: recurrent state and conv inputs
    assert (stats.state_snapshots, stats.used_state_slots, stats.state_slot_bytes) == (2, 0, slot_bytes)
    for prompt, result in zip(prompts, (first, second)):
        assert result["token_ids"] == hf_greedy(hf_model(path), prompt, 40)


def test_a_conversation_continues_from_the_snapshot_its_reply_passed(tiny_models, make_llm, hf_model, random_prompt):
    """Turn 1's prompt (100 tokens) and reply (40) pass position 128 while decoding: turn 2, which repeats them,
    starts there."""
    path = tiny_models["qwen3_5"]
    llm = make_llm(path)
    turn1 = random_prompt(100, 131)
    reply = llm.generate([turn1], GREEDY, use_tqdm=False)[0]["token_ids"]
    turn2 = turn1 + reply + random_prompt(10, 132)
    result = llm.generate([turn2], GREEDY, use_tqdm=False)[0]
    assert result["num_cached_tokens"] == 128
    assert result["token_ids"] == hf_greedy(hf_model(path), turn2, 40)


def test_snapshots_beyond_their_slots_evict_the_least_recently_used(tiny_models, make_llm, random_prompt):
    """A budget with room for 2 snapshots (a quarter of it each for running slots and snapshots): three prompts of
    their own, one snapshot each (at 128 tokens); the first, least recently used, is gone. Asked again one at a
    time, newest first, the others start from theirs."""
    slot_bytes = 3 * (4 * 16 * 16 * 4 + (2 * 32 + 64) * 3 * 4)  # 3 linear layers: recurrent state and conv inputs
    llm = make_llm(tiny_models["qwen3_5"], kv_cache_memory_bytes=4 * 2 * slot_bytes)
    assert (llm.block_manager.states.num_running, llm.block_manager.states.num_snapshots) == (2, 2)
    prompts = [random_prompt(140, 133 + i) for i in range(3)]
    for prompt in prompts:
        llm.generate([prompt], GREEDY, use_tqdm=False)
    again = [llm.generate([p + [5]], GREEDY, use_tqdm=False)[0] for p in reversed(prompts)]
    assert [r["num_cached_tokens"] for r in again] == [128, 128, 0]


def test_the_language_model_of_a_vision_checkpoint_loads(tmp_path, make_llm, random_prompt):
    """Qwen3.5's hub checkpoints hold a vision tower beside the language model (model.language_model.*)."""
    from tests.conftest import build_model

    text = transformers.AutoConfig.from_pretrained(build_model(tmp_path / "text", "qwen3_5")).to_dict()
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    torch.manual_seed(13)
    model = transformers.Qwen3_5ForConditionalGeneration(config)
    widen_weights(model)
    model.save_pretrained(tmp_path / "vl")
    build_tokenizer(tmp_path / "vl")
    llm = make_llm(tmp_path / "vl")
    assert type(llm.model_runner.model).__name__ == "Qwen3_5ForConditionalGeneration"
    prompt = random_prompt(20, 140)
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(model.eval(), prompt, 40)


def test_a_hybrid_config_with_a_layer_kind_the_engine_does_not_know_is_refused():
    """transformers' config itself puts its own kinds in place of unknown ones read from a config.json; a config
    object that keeps one (another library's, a newer family's) is refused by name."""
    from engine.models.qwen3_5 import Qwen3_5ForCausalLM

    config = qwen3_5_model(moe=False).config
    config.layer_types = ["linear_attention", "mamba", "linear_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"\['mamba'\].*linear_attention"):
        Qwen3_5ForCausalLM(config, 512)


@pytest.mark.parametrize("fresh,keep", [(False, -1), (True, -1), (False, 5)], ids=["decode", "fresh", "snapshot"])
def test_a_one_sequence_decode_updates_its_slot_in_place_exactly_as_the_batched_path(fresh, keep):
    """On the CPU a step of one sequence updates its state slot where it lies (no gather and scatter of MBs): the
    same output and states, bit for bit, as the batched path (forced here by a write-slot tensor of its own)."""
    from engine.layers.gated_deltanet import GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(qwen3_5_model(False).config)
    with torch.no_grad():
        for parameter in layer.parameters():  # some are made uninitialised
            parameter.normal_()
    states = {name: torch.randn(8, *shape) for name, (shape, _) in layer.state_shapes().items()}
    h, dk, dv = layer.num_v_heads, layer.k_dim, layer.v_dim
    inputs = (torch.randn(1, h, dk), torch.randn(1, h, dk), torch.randn(1, h, dv), -torch.rand(1, h), torch.rand(1, h))
    qkv = torch.randn(1, layer.conv_size)
    slots, fresh_rows, keep_rows = torch.tensor([2]), torch.tensor([fresh]), torch.tensor([keep])
    results = []
    for writes in (slots, slots.clone()):  # the same tensor: in place; another: the batched path
        layer.conv_state, layer.recurrent_state = (states[n].clone() for n in ("conv_state", "recurrent_state"))
        out = layer._delta_rule_rows(inputs, slots, fresh_rows, writes, keep_rows)
        mixed = layer._convolve_rows(qkv, slots, fresh_rows, writes, keep_rows)
        results.append((out, mixed, layer.recurrent_state[:7], layer.conv_state[:7]))  # 7: the scratch slot apart
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)
