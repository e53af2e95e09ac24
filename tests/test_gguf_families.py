"""GGUF files of the families beyond Llama and Qwen, written as llama.cpp's convert_hf_to_gguf writes them (its
tensor names and metadata, and its own changes to the weights), give transformers' tokens on the weights as gguf-py
dequantizes them. Every kernel here is the float32 dequantizing one, so the products are the reference's."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T

from engine.quantization import chooser
from tests.quantized_weights import only_dequant
from tests.test_gguf_engine import encode, greedy, make_llm, prompt_ids, tokenizer_metadata
from tests.test_parity import hf_greedy

VOCAB = 320
GEMMA3_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str, layer_names: dict[str, str]) -> str:
    glob = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    stem, _, suffix = hf_name.rpartition(".")
    if stem in glob:
        return f"{glob[stem]}.{suffix}"
    _, _, layer, part = stem.split(".", 3)
    return f"blk.{layer}.{layer_names[part]}.{suffix}"


def new_writer(path: Path, architecture: str, config) -> gguf.GGUFWriter:
    """A GGUF writer with the metadata every architecture's file has."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    return writer


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    from tests.conftest import build_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(folder)
    return folder


@pytest.fixture
def exact_kernels(monkeypatch):
    monkeypatch.setattr(chooser, "_CHOICES", {})
    monkeypatch.setattr(chooser, "candidates", only_dequant)


# ---- Gemma 3 --------------------------------------------------------------------------------------------------------


def gemma3_model():
    """Six layers, llama.cpp's pattern: five local ones (W = 8, rope base 10000), then a global one (linear-scaled)."""
    torch.manual_seed(31)
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,  # the head size, as llama.cpp assumes for every Gemma 3 but 27B
        sliding_window=8,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
        max_position_embeddings=512,
        eos_token_id=2,
        bos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.1 if "norm" in name else 0.3 if "embed" in name or "lm_head" in name else 0.15)
    return model.eval()


def write_gemma3_gguf(path: Path, model, tokenizer_folder: Path) -> Path:
    config = model.config
    writer = new_writer(path, "gemma3", config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(1000000.0)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(8.0)
    writer.add_sliding_window(config.sliding_window)
    writer.add_vocab_size(VOCAB)
    tokenizer_metadata(writer, tokenizer_folder)
    for i, (name, p) in enumerate(model.state_dict().items()):
        w = p.detach().float().numpy()
        if name.endswith("norm.weight"):
            writer.add_tensor(gguf_name(name, GEMMA3_NAMES), (w + 1).astype(np.float32), raw_dtype=T.F32)
        else:
            data, qtype = encode(w, "Q8_0", seed=i)
            writer.add_tensor(gguf_name(name, GEMMA3_NAMES), data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def with_file_weights(model, path: Path, layer_names: dict[str, str], norm_offset: float = 0.0):
    """`model` holding the file's weights as gguf-py dequantizes them; `norm_offset` is taken off the norms (Gemma's
    files store 1 + weight)."""
    reader = gguf.GGUFReader(path)
    stored = {t.name: t for t in reader.tensors}
    state = {}
    for name in model.state_dict():
        t = stored[gguf_name(name, layer_names)]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))
        state[name] = w - norm_offset if name.endswith("norm.weight") else w
    model.load_state_dict(state)
    return model


def test_gemma3_file_gives_transformers_tokens(tokenizer_folder, tmp_path, exact_kernels):
    path = write_gemma3_gguf(tmp_path / "gemma3.gguf", gemma3_model(), tokenizer_folder)
    reference = with_file_weights(gemma3_model(), path, GEMMA3_NAMES, norm_offset=1.0)
    llm = make_llm(path)
    config = llm.model_runner.hf_config
    assert type(config).__name__ == "Gemma3TextConfig" and config.query_pre_attn_scalar == 16
    assert [layer.self_attn.attn.sliding_window for layer in llm.model_runner.model.model.layers] == [8] * 5 + [None]
    prompts = [prompt_ids(1, 5), prompt_ids(2, 30)]  # the second far longer than the window
    for prompt, result in zip(prompts, greedy(llm, prompts, max_tokens=24, k=1)):
        assert result["token_ids"] == hf_greedy(reference, prompt, 24)


# ---- Phi-3 / Phi-4-mini ---------------------------------------------------------------------------------------------

PHI3_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
SHORT, LONG = [1.0 + 0.2 * i for i in range(6)], [3.0 + 0.5 * i for i in range(6)]


def phi3_model():
    """Rotary over 12 of each head's 16 dimensions, LongRoPE over a 128-token pretraining length."""
    torch.manual_seed(32)
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": SHORT,
        "long_factor": LONG,
        "original_max_position_embeddings": 128,
    }
    config = transformers.Phi3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        original_max_position_embeddings=128,
        rope_parameters=rope,
        eos_token_id=2,
        bos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = transformers.Phi3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3 if "embed" in name or "lm_head" in name else 0.15)
    return model.eval()


def write_phi3_gguf(path: Path, model, tokenizer_folder: Path) -> Path:
    config = model.config
    writer = new_writer(path, "phi3", config)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(12)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_scaling_orig_ctx_len(128)
    writer.add_vocab_size(VOCAB)
    tokenizer_metadata(writer, tokenizer_folder)
    writer.add_tensor("rope_factors_short.weight", np.array(SHORT, dtype=np.float32), raw_dtype=T.F32)
    writer.add_tensor("rope_factors_long.weight", np.array(LONG, dtype=np.float32), raw_dtype=T.F32)
    for i, (name, p) in enumerate(model.state_dict().items()):
        w = p.detach().float().numpy()
        data, qtype = (w.astype(np.float32), T.F32) if w.ndim == 1 else encode(w, "Q8_0", seed=i)
        writer.add_tensor(gguf_name(name, PHI3_NAMES), data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_phi3_file_gives_transformers_tokens(tokenizer_folder, tmp_path, exact_kernels):
    path = write_phi3_gguf(tmp_path / "phi3.gguf", phi3_model(), tokenizer_folder)
    reference = with_file_weights(phi3_model(), path, PHI3_NAMES)
    llm = make_llm(path)
    rope = llm.model_runner.hf_config.rope_parameters
    assert rope["rope_type"] == "longrope" and rope["partial_rotary_factor"] == 0.75
    assert rope["short_factor"] == pytest.approx(SHORT) and rope["long_factor"] == pytest.approx(LONG)
    prompts = [prompt_ids(3, 5), prompt_ids(4, 30)]
    for prompt, result in zip(prompts, greedy(llm, prompts, max_tokens=24, k=1)):
        assert result["token_ids"] == hf_greedy(reference, prompt, 24)
