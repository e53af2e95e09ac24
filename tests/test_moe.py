"""Mixture of experts (engine/layers/fused_moe.py, engine/models/qwen3_moe.py) against transformers: the block
alone, both checkpoint layouts, and the engine's paths that greedy parity in tests/test_parity.py does not take
(a prefix-cache hit, preemption). The tiny Qwen3-MoE (tests/conftest.py) has experts in layer 0 and a dense MLP
in layer 1."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import SamplingParams
from engine.layers.fused_moe import FusedMoE, Routing, TopKRouter
from engine.runner.distributed import TPGroup
from tests.test_parity import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def hf_moe_block(norm_topk_prob: bool):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=48, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob
    )
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return config, block.eval()


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_and_experts_equal_transformers_block(norm_topk_prob):
    config, block = hf_moe_block(norm_topk_prob)
    routing = Routing(config.num_experts, config.num_experts_per_tok, "softmax", norm_topk_prob)
    router, experts = TopKRouter(48, routing), FusedMoE(config.num_experts, 48, 24)
    with torch.no_grad():
        router.weight.copy_(block.gate.weight)
    assert experts.load_checkpoint_tensor("gate_up_proj", block.experts.gate_up_proj.data) == ["gate_up_proj"]
    assert experts.load_checkpoint_tensor("down_proj", block.experts.down_proj.data) == ["down_proj"]
    x = torch.randn(37, 48, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        weights, ids = router(x)
        ours = experts(x, weights, ids)
        theirs = block(x[None])[0]
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    # every token reaches top_k distinct experts, and some expert is left unused by some token
    assert all(len(set(row)) == 3 for row in ids.tolist())


def test_sigmoid_routing_scores_each_expert_alone_then_renormalizes():
    router = TopKRouter(4, Routing(num_experts=5, top_k=2, scoring="sigmoid", renormalize=True))
    with torch.no_grad():
        router.weight.copy_(torch.randn(5, 4, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    weights, ids = router(x)
    scores = (x @ router.weight.T).sigmoid()
    top, expected_ids = scores.topk(2, dim=-1)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True))


def test_bad_routing_and_tensor_parallelism_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match="scoring must be one of"):
        Routing(8, 2, scoring="softplus")
    with pytest.raises(ValueError, match=r"experts per token must be in 1\.\.8"):
        Routing(8, 9)
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 yet; use one device"):
        FusedMoE(4, 8, 8, tp=TPGroup(rank=0, size=2))


def stacked_copy(source, dest):
    """The tiny model's checkpoint with its experts stacked as transformers 5 holds them in memory."""
    shutil.copytree(source, dest)
    tensors = load_file(dest / "model.safetensors")
    experts = {}
    for name in [n for n in tensors if ".experts." in n]:
        prefix, _, rest = name.partition(".experts.")
        index, part, _ = rest.split(".")
        experts.setdefault(prefix, {}).setdefault(part, {})[int(index)] = tensors.pop(name)
    for prefix, parts in experts.items():
        count = len(parts["down_proj"])
        gate_up = [torch.cat([parts["gate_proj"][e], parts["up_proj"][e]]) for e in range(count)]
        tensors[f"{prefix}.experts.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{prefix}.experts.down_proj"] = torch.stack([parts["down_proj"][e] for e in range(count)])
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_stacked_and_per_expert_checkpoints_give_the_same_tokens(tiny_models, make_llm, random_prompt, tmp_path):
    per_expert = tiny_models["qwen3_moe"]
    stacked = stacked_copy(per_expert, tmp_path / "stacked")
    prompts = [random_prompt(9, 30), random_prompt(21, 31)]
    expected = [r["token_ids"] for r in make_llm(per_expert).generate(prompts, GREEDY, use_tqdm=False)]
    assert [r["token_ids"] for r in make_llm(stacked).generate(prompts, GREEDY, use_tqdm=False)] == expected


def test_a_checkpoint_missing_an_expert_names_what_it_lacks(tiny_models, make_llm, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_models["qwen3_moe"], broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.5.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 tensors, e\.g\. \['model\.layers\.0\.mlp\.experts\.gate_up_proj'\]"):
        make_llm(broken)


def test_a_prefix_cache_hit_keeps_transformers_tokens(tiny_models, make_llm, hf_model, random_prompt):
    path = tiny_models["qwen3_moe"]
    llm = make_llm(path)
    system = random_prompt(40, 40)
    first, second = system + random_prompt(7, 41), system + random_prompt(12, 42)
    llm.generate([first], GREEDY, use_tqdm=False)
    request = llm.generate([second], GREEDY, use_tqdm=False)[0]
    assert request["num_cached_tokens"] >= 32, "the shared 40-token prefix should have come from the cache"
    assert request["token_ids"] == hf_greedy(hf_model(path), second, 64)


def test_preempted_requests_keep_transformers_tokens(tiny_models, make_llm, hf_model, random_prompt, monkeypatch):
    path = tiny_models["qwen3_moe"]
    llm = make_llm(path, num_kvcache_blocks=14)  # 4 requests of up to 94 tokens need 24 blocks of 16
    preempted = []
    preempt = llm.scheduler._preempt
    monkeypatch.setattr(llm.scheduler, "_preempt", lambda seq: (preempted.append(seq.request_id), preempt(seq)))
    prompts = [random_prompt(n, 50 + n) for n in (30, 12, 25, 5)]
    results = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert preempted, "the cache was meant to be too small for every request at once"
    model = hf_model(path)
    for prompt, result in zip(prompts, results):
        assert result["token_ids"] == hf_greedy(model, prompt, 64)


def test_quantizing_a_moe_model_is_refused(tiny_models, make_llm):
    with pytest.raises(ValueError, match="does not cover mixture-of-experts layers yet"):
        make_llm(tiny_models["qwen3_moe"], quantization="int8")


def test_decode_steps_run_eagerly_and_stats_say_why(tiny_models, make_llm, monkeypatch):
    monkeypatch.setenv("PAGODA_CPU_COMPILE", "1")  # where a dense model would compile its decode steps
    llm = make_llm(tiny_models["qwen3_moe"])
    assert llm.stats().decode == "eager (its steps decide on the host)"
    assert len(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]["token_ids"]) == 64
