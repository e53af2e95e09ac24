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


def test_a_prefix_hit_and_preemption_keep_transformers_tokens(
    tiny_models, make_llm, hf_model, random_prompt, monkeypatch
):
    path = tiny_models["mistral"]
    model = hf_model(path)
    llm = make_llm(path, num_kvcache_blocks=12)  # 4 requests of up to 78 tokens need 20 blocks of 16
    preempted = []
    preempt = llm.scheduler._preempt
    monkeypatch.setattr(llm.scheduler, "_preempt", lambda seq: (preempted.append(seq.request_id), preempt(seq)))
    system = random_prompt(34, 70)
    prompts = [system + random_prompt(n, 71 + n) for n in (2, 9, 14, 5)]
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert preempted, "the cache was meant to be too small for every request at once"
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
