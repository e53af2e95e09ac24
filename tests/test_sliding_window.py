"""Sliding-window attention end to end: families whose layers see only their last W positions give transformers'
greedy tokens with a window far shorter than the prompt, through a prefix-cache hit and preemption; layer types
the engine cannot serve are refused. (The tiny Mistral of tests/conftest.py, W = 12, also runs the parity suite
of tests/test_parity.py and tests/test_compiled_decode.py.)"""

import pytest
import torch
import transformers

from engine import SamplingParams
from engine.models.llama import layer_windows
from tests.conftest import COMMON, build_tokenizer
from tests.test_parity import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def save(model, folder):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3 if "embed" in name or "lm_head" in name else 0.15)
    model.save_pretrained(folder)
    build_tokenizer(folder)
    return folder, model.eval()


@pytest.fixture(scope="module")
def mixed_layer_models(tmp_path_factory):
    """Ministral (a sliding layer, then a full one) and Qwen2 with use_sliding_window (the reverse), W = 10."""
    root = tmp_path_factory.mktemp("sliding")
    torch.manual_seed(6)
    ministral = transformers.MinistralConfig(
        **COMMON, sliding_window=10, layer_types=["sliding_attention", "full_attention"], head_dim=16
    )
    qwen2 = transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=10, max_window_layers=1)
    return {
        "ministral": save(transformers.MinistralForCausalLM(ministral), root / "ministral"),
        "qwen2": save(transformers.Qwen2ForCausalLM(qwen2), root / "qwen2"),
    }


@pytest.mark.parametrize("family", ["ministral", "qwen2"])
def test_mixed_sliding_and_full_layers_give_transformers_tokens(family, mixed_layer_models, make_llm, random_prompt):
    path, model = mixed_layer_models[family]
    prompts = [random_prompt(n, 60 + n) for n in (3, 25, 41)]
    results = make_llm(path, max_num_batched_tokens=16).generate(prompts, GREEDY, use_tqdm=False)  # chunked
    for prompt, result in zip(prompts, results):
        assert result["token_ids"] == hf_greedy(model, prompt, 48)
    # The window really cuts: without it, transformers itself answers otherwise.
    full = {"layer_types": ["full_attention"] * 2, "use_sliding_window": False}
    unwindowed = type(model)(type(model.config)(**{**model.config.to_dict(), **full}))
    unwindowed.load_state_dict(model.state_dict())
    assert hf_greedy(unwindowed.eval(), prompts[2], 48) != results[2]["token_ids"]


@pytest.mark.parametrize("family, num_blocks", [("mistral", 6), ("ministral", 12)])
def test_a_prefix_hit_and_preemption_keep_transformers_tokens(
    family, num_blocks, tiny_models, mixed_layer_models, make_llm, hf_model, random_prompt, monkeypatch
):
    """With KV-cache groups (engine/runner/kv_cache.py) a sliding layer holds only its window's blocks, so four
    requests of 78 tokens that need 20 blocks of 16 as full attention fit in 6 where every layer slides (Mistral);
    with a full layer beside (Ministral) the full group still grows, and 12 blocks force preemptions."""
    path, model = (
        (tiny_models[family], hf_model(tiny_models[family])) if family == "mistral" else mixed_layer_models[family]
    )
    llm = make_llm(path, num_kvcache_blocks=num_blocks)
    preempted, held = [], []
    preempt = llm.scheduler._preempt
    monkeypatch.setattr(llm.scheduler, "_preempt", lambda seq: (preempted.append(seq.request_id), preempt(seq)))
    schedule = llm.scheduler.schedule
    monkeypatch.setattr(llm.scheduler, "schedule", lambda: [held.append(llm.stats().used_blocks), schedule()][1])
    system = random_prompt(34, 70)
    prompts = [system + random_prompt(n, 71 + n) for n in (2, 9, 14, 5)]
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert bool(preempted) == (family == "ministral"), preempted
    assert max(held) <= num_blocks
    assert any(r["num_cached_tokens"] >= 32 for r in rest), "the shared prefix should have come from the cache"
    for prompt, result in zip(prompts, [first, *rest]):
        assert result["token_ids"] == hf_greedy(model, prompt, 48)


def test_layer_types_the_engine_cannot_serve_are_refused():
    config = transformers.Qwen2Config(**COMMON)
    config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match=r"layer types \['chunked_attention'\] are not supported"):
        layer_windows(config)
    config.layer_types = ["sliding_attention", "full_attention"]
    config.sliding_window = None
    with pytest.raises(ValueError, match="sliding-attention layers but no sliding_window"):
        layer_windows(config)
    assert layer_windows(transformers.MistralConfig(**COMMON, sliding_window=None)) == [None, None]
    assert layer_windows(transformers.LlamaConfig(**COMMON)) == [None, None]


def test_sliding_groups_hold_their_window_and_a_shared_prompt_still_hits(tmp_path):
    """Gemma 3 4B's layout (34 layers, a global one after five sliding ones) at 32 windows of context: the blocks
    held while decoding weigh at most 0.25x the all-global layout's, and a second chat gets a shared system prompt
    from the prefix cache. bench/sliding_window_memory.py measures the same at 32k tokens and a 1,024 window."""
    from bench.sliding_window_memory import build, held_after_each_step
    from engine import LLM

    path = build(tmp_path / "gemma3-4b-shaped", window=64)
    llm = LLM(str(path), dtype="float32", max_model_len=2100, num_kvcache_blocks=600, max_num_batched_tokens=128)
    stats = llm.stats()
    assert stats.kv_groups == ("sliding 64",) * 6 + ("full",) and stats.layers_per_block == 5
    held = held_after_each_step(llm, [(7 * i) % 500 + 3 for i in range(2048)], max_tokens=4)
    decoding, all_global = held[-2] * 5, 2048 // 16 * 34
    assert decoding <= 0.25 * all_global, (held, all_global)
    assert held[-1] == 0 and llm.stats().used_blocks_per_group == (0,) * 7  # all given back
    system = [(11 * i) % 500 + 3 for i in range(300)]
    llm.generate([system + [5, 6, 7]], GREEDY, use_tqdm=False)
    second = llm.generate([system + [8, 9]], GREEDY, use_tqdm=False)[0]
    assert second["num_cached_tokens"] == 288  # every whole block of the shared 300 tokens
