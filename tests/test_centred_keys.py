"""Centred keys (engine/attention/key_mean.py): a cache that stores each key less its head's mean key, turned to the
key's position, gives every score back exactly once the backend adds the mean's share; the mean is measured at load
from the model's own keys, the same whatever the cache's size or max_model_len."""

import pytest
import torch

from engine.attention import torch_backend
from engine.attention.key_mean import KeyMean
from engine.attention.kv_format import KVFormat, kv_format
from engine.front.sampling_params import SamplingParams
from engine.layers.attention import Attention
from engine.layers.rotary_embedding import RotaryEmbedding
from tests.attention_batches import make_batch

ROPES = {
    "full": (16, {"rope_type": "default", "rope_theta": 10000.0}),
    "yarn (cos and sin scaled)": (
        16,
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "partial (a quarter of each head turns)": (
        16,
        {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
    ),
    "none (NoPE)": (16, None),
}


def key_mean(rope: str, num_kv_heads: int = 2, seed: int = 0) -> tuple[KeyMean, RotaryEmbedding | None]:
    head_dim, params = ROPES[rope]
    rotary = None if params is None else RotaryEmbedding(head_dim, 512, params)
    mean = KeyMean(num_kv_heads, head_dim, rotary, torch.device("cpu"))
    mean.set_mean(torch.randn(num_kv_heads, head_dim, generator=torch.Generator().manual_seed(seed)) * 3)
    return mean, rotary


def cache_positions(meta, block_size: int, num_slots: int) -> torch.Tensor:
    """Each cache slot's position in the sequence that holds it (0 for slots no sequence holds)."""
    positions = torch.zeros(num_slots, dtype=torch.long)
    for i, length in enumerate(meta.seq_lens_cpu):
        for p in range(length):
            positions[int(meta.block_tables[i, p // block_size]) * block_size + p % block_size] = p
    return positions


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("window", [None, 20])
def test_scores_come_back_exactly(rope, window):
    """Decode rows, prefills over a cached prefix and fresh ones, a sliding window: attention over keys stored less
    the turned mean, with the mean's scores added back, is attention over the keys themselves."""
    q_lens, seq_lens = [1] * 5 + [7, 40], [3, 17, 64, 1, 250, 55, 40]
    query, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, num_kv_heads=2, group=3, head_dim=16, seed=4)
    mean, _ = key_mean(rope)
    k_cache = k_cache + 2.0  # keys with a common part, as a trained model's have
    flat = k_cache.view(-1, 2, 16)
    centred = (flat - mean.at(cache_positions(meta, 16, flat.shape[0]))).view_as(k_cache)
    scores = mean.scores(query)
    got = torch_backend.paged_attention(query, centred, v_cache, meta, 0.25, window, mean_scores=scores)
    want = torch_backend.paged_attention(query, k_cache, v_cache, meta, 0.25, window)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    without = torch_backend.paged_attention(query, centred, v_cache, meta, 0.25, window)
    # Turned, the mean's share differs between positions; without rotary it is one constant the softmax drops
    assert torch.allclose(without, want, atol=1e-5) == (rope == "none (NoPE)")


@pytest.mark.parametrize("rope", list(ROPES))
def test_calibration_finds_the_mean_key_before_the_rotary_embedding(rope):
    """Keys the rotary embedding turned (and, for YaRN, scaled) at many positions are turned back: the measured mean
    is the mean of the keys before the embedding."""
    mean, rotary = key_mean(rope)
    g = torch.Generator().manual_seed(9)
    common = torch.randn(2, 16, generator=g) * 4
    keys = common + torch.randn(300, 2, 16, generator=g)
    positions = torch.randperm(500, generator=g)[:300]
    turned = keys if rotary is None else rotary(positions, keys, 0)
    mean.start_calibration()
    mean.observe(turned[:100], positions[:100])
    mean.observe(turned[100:], positions[100:])
    mean.finish_calibration()
    torch.testing.assert_close(mean.mean, keys.mean(0), rtol=1e-4, atol=1e-4)
    mean_keys = keys.mean(0).expand(300, -1, -1).contiguous()
    want = mean_keys if rotary is None else rotary(positions, mean_keys, 0)
    torch.testing.assert_close(mean.at(positions), want, rtol=1e-4, atol=1e-4)


def centred_layers(llm) -> list[Attention]:
    model = llm.model_runner.model
    return [m for m in model.modules() if isinstance(m, Attention) and m.key_mean is not None]


@pytest.mark.parametrize("name", ["fp8", "int4"])
def test_the_engine_measures_each_layers_mean_key_at_load_whatever_its_cache(name, tiny_qwen2, make_llm):
    roomy = make_llm(tiny_qwen2, kv_cache_dtype=name, num_kvcache_blocks=64)
    tight = make_llm(tiny_qwen2, kv_cache_dtype=name, num_kvcache_blocks=10, max_model_len=128)
    means = [layer.key_mean.mean for layer in centred_layers(roomy)]
    assert len(means) == roomy.model_runner.hf_config.num_hidden_layers
    assert all(m.abs().sum() > 0 for m in means)
    assert all(torch.equal(a, b.key_mean.mean) for a, b in zip(means, centred_layers(tight), strict=True))
    assert all(layer.kv_format.name == name and layer.k_cache.dtype == torch.uint8 for layer in centred_layers(tight))


def test_int8_and_auto_keep_keys_whole(tiny_qwen2, make_llm):
    assert not centred_layers(make_llm(tiny_qwen2, kv_cache_dtype="int8"))
    assert not centred_layers(make_llm(tiny_qwen2))
    assert not kv_format("int8").centres_keys and kv_format("fp8").centres_keys


def test_centred_keys_and_tensor_parallelism_are_refused_together():
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="tensor_parallel_size > 1.*use kv_cache_dtype='int8'"):
        EngineConfig(model="m", kv_cache_dtype="int4", tensor_parallel_size=2)


@pytest.mark.parametrize("family", ["smollm3", "phi3", "gemma3", "gpt_oss", "gemma4", "qwen3_5"])
def test_every_family_centres_its_keys_and_reads_them_back(family, tiny_models, make_llm, random_prompt, monkeypatch):
    """NoPE layers (SmolLM3), partial rotary (Phi-4-mini, Qwen3.5), two rotary tables and sliding windows (Gemma 3),
    sinks and YaRN (gpt-oss), layers that read another's cache (Gemma 4), recurrent layers beside attention
    (Qwen3.5): each calibrates at load and adds the mean's share back exactly. Centring int8 here (the format with
    the least rounding), the engine's logprobs for its own greedy tokens stay as near the plain engine's as int8's
    rounding allows; a wrong share would move them by whole nats. (On random tiny models centring buys nothing:
    their keys have no common part. bench/quality.py measures what it buys on a trained one.)"""
    monkeypatch.setattr(KVFormat, "centres_keys", property(lambda self: self.quantized))
    path = tiny_models[family]
    prompt = random_prompt(24, 8)
    quantized = make_llm(path, kv_cache_dtype="int8")
    layers = centred_layers(quantized)
    assert layers and all(layer.key_mean.mean.abs().sum() > 0 for layer in layers)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    out = quantized.generate([prompt], params, use_tqdm=False)[0]
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    plain = make_llm(path).generate([prompt + out["token_ids"]], scoring, use_tqdm=False)[0]["prompt_logprobs"]
    pairs = enumerate(zip(out["logprobs"], out["token_ids"], strict=True))
    gaps = [abs(float(lp[t]) - float(plain[len(prompt) + i][t])) for i, (lp, t) in pairs]
    assert sum(gaps) / len(gaps) < 0.05 and max(gaps) < 0.25
