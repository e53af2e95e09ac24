"""Gemma 4 GGUF files, written as llama.cpp's convert_hf_to_gguf writes them (its tensor names and metadata: a
sliding flag per layer, head sizes and KV heads per kind of layer, MLP widths per layer, shared-KV layers, per-layer
inputs, the experts' gate and up in one stacked tensor, the global rotary's `rope_freqs`), give transformers'
tokens on the weights as gguf-py dequantizes them, through the float32 dequantizing kernels."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T

from tests.conftest import gemma4_config, widen_weights
from tests.test_gguf_engine import encode, greedy, make_llm, prompt_ids, tokenizer_metadata
from tests.test_gguf_families import VOCAB, exact_kernels, tokenizer_folder  # noqa: F401 (fixtures)
from tests.test_parity import hf_greedy

GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight",
    "layer_scalar": "layer_output_scale.weight",
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    _, _, layer, part = hf_name.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[part]}"


def gemma4_model(moe: bool):
    torch.manual_seed(40 + moe)
    model = transformers.Gemma4ForCausalLM(gemma4_config(moe))
    widen_weights(model)
    return model.eval()


def write_gemma4_gguf(path: Path, model, tokenizer_dir: Path) -> Path:
    """Matrices in Q8_0, the experts' stacks too; norms, scales, the router, the per-layer table and matrices of
    rows too short for a block (the per-layer projection's 8 columns) in F32."""
    config = model.config
    layers = config.num_hidden_layers
    sliding = [kind == "sliding_attention" for kind in config.layer_types]
    shared_from = layers - config.num_kv_shared_layers
    wide = [2 if config.use_double_wide_mlp and i >= shared_from else 1 for i in range(layers)]
    writer = gguf.GGUFWriter(str(path), "gemma4")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(layers)
    writer.add_feed_forward_length([config.intermediate_size * w for w in wide])
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv([config.per_layer_config[i].num_key_value_heads for i in range(layers)])
    writer.add_key_length(config.per_layer_config["full_attention"].head_dim)
    writer.add_value_length(config.per_layer_config["full_attention"].head_dim)
    writer.add_key_length_swa(config.per_layer_config["sliding_attention"].head_dim)
    writer.add_value_length_swa(config.per_layer_config["sliding_attention"].head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern(sliding)
    writer.add_shared_kv_layers(config.num_kv_shared_layers)
    writer.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input or 0)
    writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(config.rope_parameters["sliding_attention"]["rope_theta"])
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.enable_moe_block:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.top_k_experts)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_vocab_size(VOCAB)
    tokenizer_metadata(writer, tokenizer_dir)
    full_head = config.per_layer_config["full_attention"].head_dim
    turning = int(0.25 * full_head // 2)  # proportional rotary over a quarter of each global head
    factors = np.array([1.0] * turning + [1e30] * (full_head // 2 - turning), dtype=np.float32)
    writer.add_tensor("rope_freqs.weight", factors, raw_dtype=T.F32)
    for i, (name, p) in enumerate(model.state_dict().items()):
        w = p.detach().float().numpy()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, rows, cols = w.shape
            data = gguf.quants.quantize(np.ascontiguousarray(w).reshape(experts * rows, cols), T.Q8_0)
            writer.add_tensor(gguf_name(name), data.reshape(experts, rows, -1), raw_dtype=T.Q8_0)
        elif w.ndim == 2 and w.shape[1] % 32 == 0 and "router" not in name and "per_layer" not in name.split(".")[1]:
            data, qtype = encode(w, "Q8_0", seed=i)
            writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(w, dtype=np.float32), raw_dtype=T.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def with_file_weights(model, path: Path):
    """`model` holding the file's weights as gguf-py dequantizes them."""
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    state = {}
    for name, value in model.state_dict().items():
        t = stored[gguf_name(name)]
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        state[name] = torch.from_numpy(w.reshape(value.shape))
    model.load_state_dict(state)
    return model


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gemma4_file_gives_transformers_tokens(moe, tokenizer_folder, tmp_path, exact_kernels):  # noqa: F811
    path = write_gemma4_gguf(tmp_path / "gemma4.gguf", gemma4_model(moe), tokenizer_folder)
    reference = with_file_weights(gemma4_model(moe), path)
    llm = make_llm(path, max_num_batched_tokens=16)  # chunked prefill too
    config, model = llm.model_runner.hf_config, llm.model_runner.model
    expected = reference.config
    for key in ("layer_types", "num_kv_shared_layers", "use_double_wide_mlp", "attention_k_eq_v"):
        assert getattr(config, key) == getattr(expected, key), key
    for i in range(config.num_hidden_layers):
        mine, theirs = config.per_layer_config[i], expected.per_layer_config[i]
        assert (mine.head_dim, mine.num_key_value_heads) == (theirs.head_dim, theirs.num_key_value_heads)
    assert config.rope_parameters == expected.rope_parameters
    if moe:
        assert type(model.model.layers[0].experts).__name__ == "Gemma4QuantizedExperts"
    prompts = [prompt_ids(7, 5), prompt_ids(8, 30)]  # the second far longer than the 10-token window
    for prompt, result in zip(prompts, greedy(llm, prompts, max_tokens=24, k=1)):
        assert result["token_ids"] == hf_greedy(reference, prompt, 24)
