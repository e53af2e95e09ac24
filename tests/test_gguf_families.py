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


# ---- gpt-oss --------------------------------------------------------------------------------------------------------

GPT_OSS_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.router": "ffn_gate_inp",
}
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def gpt_oss_model():
    """gpt-oss's layer pattern over 4 layers (a 6-token window on the even ones), YaRN, 8 experts (2 a token) of 32
    columns (MXFP4's group): the widths small, the rest as OpenAI's config has it."""
    torch.manual_seed(33)
    rope = {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 8.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
    }
    config = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=512,
        rope_parameters=rope,
        eos_token_id=2,
        bos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3 if any(k in name for k in ("embed", "lm_head", "experts", "router")) else 0.15)
    return model.eval()


def gpt_oss_name(hf_name: str) -> str:
    if hf_name.endswith(".self_attn.sinks"):  # convert_hf_to_gguf's name for it
        return f"blk.{hf_name.split('.')[2]}.attn_sinks.weight"
    return gguf_name(hf_name, GPT_OSS_NAMES)


def gpt_oss_gguf_tensors(model) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names and in its shapes, in float32: the experts' gate and up apart
    (transformers interleaves them column by column) and each expert's matrix [rows, columns]."""
    tensors = {}
    for name, p in model.state_dict().items():
        w = p.detach().float().numpy()
        if ".mlp.experts." not in name:
            tensors[gpt_oss_name(name)] = w
            continue
        layer, part = name.split(".")[2], name.rsplit(".", 1)[1]
        prefix = f"blk.{layer}"
        if part == "gate_up_proj":  # [E, H, 2I]
            tensors[f"{prefix}.ffn_gate_exps.weight"] = w[:, :, 0::2].transpose(0, 2, 1)
            tensors[f"{prefix}.ffn_up_exps.weight"] = w[:, :, 1::2].transpose(0, 2, 1)
        elif part == "gate_up_proj_bias":
            tensors[f"{prefix}.ffn_gate_exps.bias"], tensors[f"{prefix}.ffn_up_exps.bias"] = w[:, 0::2], w[:, 1::2]
        elif part == "down_proj":  # [E, I, H]
            tensors[f"{prefix}.ffn_down_exps.weight"] = w.transpose(0, 2, 1)
        else:
            tensors[f"{prefix}.ffn_down_exps.bias"] = w
    return tensors


def write_gpt_oss_gguf(path: Path, model, tokenizer_folder: Path) -> Path:
    """As convert_hf_to_gguf writes OpenAI's checkpoint: experts in MXFP4, other matrices here in Q8_0 (the hub's
    files keep them in F16, Q8_0 or a K-quant), the router, norms, sinks and biases in F32."""
    config = model.config
    writer = new_writer(path, "gpt-oss", config)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    writer.add_rope_freq_base(150000.0)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(8.0)
    writer.add_rope_scaling_orig_ctx_len(64)
    writer.add_rope_scaling_yarn_beta_fast(32.0)
    writer.add_rope_scaling_yarn_beta_slow(1.0)
    writer.add_vocab_size(VOCAB)
    tokenizer_metadata(writer, tokenizer_folder)
    for i, (name, w) in enumerate(gpt_oss_gguf_tensors(model).items()):
        if name.endswith("_exps.weight"):
            experts, rows, cols = w.shape
            data = gguf.quants.quantize(np.ascontiguousarray(w).reshape(experts * rows, cols), T.MXFP4)
            writer.add_tensor(name, data.reshape(experts, rows, -1), raw_dtype=T.MXFP4)
        elif w.ndim == 2 and name.endswith(".weight") and "ffn_gate_inp" not in name:  # nor the router
            data, qtype = encode(w, "Q8_0", seed=i)
            writer.add_tensor(name, data, raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32), raw_dtype=T.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gpt_oss_with_file_weights(model, path: Path):
    """`model` holding the file's weights as gguf-py dequantizes them, gate and up interleaved back."""
    reader = gguf.GGUFReader(path)
    stored = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        stored[t.name] = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    state = {}
    for name, value in model.state_dict().items():
        if ".mlp.experts." not in name:
            state[name] = torch.from_numpy(stored[gpt_oss_name(name)])
            continue
        prefix, part = f"blk.{name.split('.')[2]}", name.rsplit(".", 1)[1]
        w = torch.empty_like(value)
        if part == "gate_up_proj":
            w[:, :, 0::2] = torch.from_numpy(stored[f"{prefix}.ffn_gate_exps.weight"]).transpose(1, 2)
            w[:, :, 1::2] = torch.from_numpy(stored[f"{prefix}.ffn_up_exps.weight"]).transpose(1, 2)
        elif part == "gate_up_proj_bias":
            w[:, 0::2] = torch.from_numpy(stored[f"{prefix}.ffn_gate_exps.bias"])
            w[:, 1::2] = torch.from_numpy(stored[f"{prefix}.ffn_up_exps.bias"])
        elif part == "down_proj":
            w = torch.from_numpy(stored[f"{prefix}.ffn_down_exps.weight"]).transpose(1, 2)
        else:
            w = torch.from_numpy(stored[f"{prefix}.ffn_down_exps.bias"])
        state[name] = w
    model.load_state_dict(state)
    return model


def test_gpt_oss_file_with_mxfp4_experts_gives_transformers_tokens(tokenizer_folder, tmp_path, exact_kernels):
    from engine.models.gpt_oss import GptOssQuantizedExperts

    path = write_gpt_oss_gguf(tmp_path / "gpt-oss.gguf", gpt_oss_model(), tokenizer_folder)
    reference = gpt_oss_with_file_weights(gpt_oss_model(), path)
    llm = make_llm(path, max_num_batched_tokens=16)  # chunked prefill too
    config, model = llm.model_runner.hf_config, llm.model_runner.model
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["truncate"] is False
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [6, None, 6, None]
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, GptOssQuantizedExperts)
    assert {k.source for p in experts.kernels.values() for k in p} == {"MXFP4"}
    prompts = [prompt_ids(5, 5), prompt_ids(6, 30)]  # the second far longer than the window
    for prompt, result in zip(prompts, greedy(llm, prompts, max_tokens=24, k=1)):
        assert result["token_ids"] == hf_greedy(reference, prompt, 24)
