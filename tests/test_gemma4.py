"""Gemma 4 beyond the parity suite (tests/test_parity.py runs both tiny Gemma 4s of tests/conftest.py): layers
that read another layer's KV cache hold none of their own, global layers twice as wide as the sliding ones share
block ids with them through narrower views, a backend that needs whole caches gets a tensor per layer, and a
checkpoint with vision and audio towers serves its language model."""

import pytest
import torch
import transformers

from engine import SamplingParams
from engine.runner.kv_cache import plan_kv_cache
from tests.conftest import build_tokenizer, gemma4_config
from tests.test_parity import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def test_shared_layers_read_their_source_cache_and_narrow_layers_view_wide_rows(tiny_models, make_llm):
    runner = make_llm(tiny_models["gemma4"]).model_runner
    attention = [layer.self_attn.attn for layer in runner.model.model.layers]
    # layers 3 (sliding) and 4 (global) share the caches of layers 2 and 1, the last of their kind before them
    assert attention[3].kv_source is attention[2] and attention[4].kv_source is attention[1]
    assert runner.attention_layers == attention[:3]
    assert runner.kv_groups.windows == (10, 10, None)  # one cache tensor pair serves a layer of each group
    assert runner.kv_layout.slot_widths == (64,)  # the global layer's 2 KV heads of 32
    assert len(runner.kv_cache) == 2
    sliding, full = attention[0], attention[1]
    assert full.k_cache.is_contiguous() and full.k_cache.shape[2:] == (2, 32)
    assert sliding.k_cache.shape[2:] == (2, 16) and not sliding.k_cache.is_contiguous()
    assert sliding.k_cache.data_ptr() == full.k_cache.data_ptr()  # the first half of each token's row


def test_a_backend_that_reads_whole_caches_gets_a_tensor_per_layer(tiny_models, make_llm):
    layers = make_llm(tiny_models["gemma4"]).model_runner.attention_layers
    groups, layout = plan_kv_cache(layers, 16, torch.float32, split=True, strided=False)
    assert groups.windows == (None,) and layout.slot_widths == (32, 64, 32)
    assert layout.uniform(layers, groups)
    groups, layout = plan_kv_cache(layers, 16, torch.float32, split=True, strided=True)
    assert len(groups.windows) == 3 and not layout.uniform(layers, groups)


def test_a_prefix_hit_chunked_prefill_and_preemption_keep_transformers_tokens(
    tiny_models, make_llm, hf_model, random_prompt, monkeypatch
):
    """Prompts of 36 to 48 tokens against a 10-token window, and 40 new tokens: a request holds 6 blocks of 16 in
    the global group and 2 or 3 in each sliding one, so three at once do not fit 20 blocks and are preempted."""
    path = tiny_models["gemma4"]
    llm = make_llm(path, num_kvcache_blocks=20, max_num_batched_tokens=16)
    preempted = []
    preempt = llm.scheduler._preempt
    monkeypatch.setattr(llm.scheduler, "_preempt", lambda seq: (preempted.append(seq.request_id), preempt(seq)))
    system = random_prompt(34, 90)
    prompts = [system + random_prompt(n, 91 + n) for n in (2, 9, 14, 5)]
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert preempted
    assert any(r["num_cached_tokens"] >= 32 for r in rest), "the shared prefix should have come from the cache"
    for prompt, result in zip(prompts, [first, *rest]):
        assert result["token_ids"] == hf_greedy(hf_model(path), prompt, 40)


@pytest.fixture(scope="module")
def gemma4_multimodal(tmp_path_factory):
    """A Gemma 4 checkpoint as the hub ships them: vision and audio towers beside the language model, whose
    tensors are named model.language_model.*; its embeddings tied to the head."""
    folder = tmp_path_factory.mktemp("gemma4_mm")
    torch.manual_seed(12)
    text = gemma4_config(moe=False).to_dict() | {"tie_word_embeddings": True}
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16
    )
    audio = transformers.Gemma4AudioConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        output_proj_dims=32,
        subsampling_conv_channels=[8, 4],
    )
    config = transformers.Gemma4Config(text_config=text, vision_config=vision.to_dict(), audio_config=audio.to_dict())
    model = transformers.Gemma4ForConditionalGeneration(config)
    with torch.no_grad():  # small embeddings: scaled by sqrt(hidden) and tied, large ones make the model repeat itself
        for name, p in model.named_parameters():
            p.normal_(0, 0.03 if "embed" in name else (0.1 if "norm" in name else 0.3))
    model.save_pretrained(folder)
    build_tokenizer(folder)
    return folder, model.eval()


def test_the_language_model_of_a_vision_and_audio_checkpoint_gives_transformers_tokens(
    gemma4_multimodal, make_llm, random_prompt
):
    folder, model = gemma4_multimodal
    llm = make_llm(folder)
    assert type(llm.model_runner.model).__name__ == "Gemma4ForConditionalGeneration"
    names = [name for name, _ in llm.model_runner.model.named_parameters()]
    assert not any("vision" in name or "audio" in name for name in names)
    prompts = [random_prompt(n, 100 + n) for n in (4, 29)]
    results = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, result in zip(prompts, results):
        assert result["token_ids"] == hf_greedy(model, prompt, 40)
    assert len(set(results[1]["token_ids"])) > 5  # not one token repeated, which a broken model also gives


def test_a_config_that_attends_both_ways_is_refused(tmp_path, make_llm):
    config = gemma4_config(moe=False)
    config.use_bidirectional_attention = "all"
    transformers.Gemma4ForCausalLM(config).save_pretrained(tmp_path)
    build_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="attends both ways"):
        make_llm(tmp_path)
