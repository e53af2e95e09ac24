"""Qwen3-Next GGUF files (llama.cpp's `qwen3next`), written as its convert_hf_to_gguf writes them: each linear layer's
in_proj_qkvz split per key head into one attn_qkv (every head's q, then k, then v) and attn_gate (z), the value heads
left grouped by key head (unlike Qwen3.5's files, where they are tiled); in_proj_ba kept fused as ssm_beta_alpha;
decay rates as -exp(A_log), zero-centred norms as 1 + weight, the convolution squeezed; experts in every layer with
a shared expert. Older files keep in_proj_qkvz fused too (ssm_in). They give transformers' tokens on the weights as
gguf-py dequantizes them, through the float32 dequantizing kernels, alone, in a batch and with chunked prefill."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.conftest import COMMON, widen_weights
from tests.test_gguf_engine import greedy, make_llm, prompt_ids, tokenizer_metadata
from tests.test_gguf_families import VOCAB, exact_kernels, tokenizer_folder  # noqa: F401 (fixtures)
from tests.test_gguf_qwen3_5 import GLOBAL, NAMES, QUANTIZED, write_tensors
from tests.test_parity import hf_greedy

ARCH = "qwen3next"


def tiny_qwen3_next():
    """Three Gated DeltaNet layers then a gated full-attention one; 4 value heads over 2 key heads (so their order
    matters); 8 experts (2 a token) and a shared expert in every layer, as the released models have them."""
    import transformers

    torch.manual_seed(61)
    config = transformers.Qwen3NextConfig(
        **{**COMMON, "num_hidden_layers": 4},
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=1,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen3NextForCausalLM(config)
    widen_weights(model)
    return model.eval()


def qkvz_split(w: np.ndarray, config) -> tuple[np.ndarray, np.ndarray]:
    """convert_hf_to_gguf's Qwen3NextModel: in_proj_qkvz's per-key-head [q, k, v, z] rows as (q k v, z)."""
    k_dim, v_rows = config.linear_key_head_dim, config.linear_num_value_heads // config.linear_num_key_heads
    v_rows *= config.linear_value_head_dim
    heads = w.reshape(config.linear_num_key_heads, -1, w.shape[-1])
    q, k, v, z = np.split(heads, np.cumsum([k_dim, k_dim, v_rows])[:3], axis=1)
    flat = [part.reshape(-1, w.shape[-1]) for part in (q, k, v, z)]
    return np.concatenate(flat[:3]), flat[3]


def converted_tensors(model, fused_qkvz: bool) -> dict[str, np.ndarray]:
    config, tensors = model.config, {}
    for name, p in model.state_dict().items():
        w = p.detach().float().numpy()
        if name.endswith("A_log"):
            w = -np.exp(w)
        elif name.endswith("conv1d.weight"):
            w = w.squeeze(1)
        elif name.endswith("norm.weight") and "linear_attn.norm" not in name:
            w = w + 1
        w = np.ascontiguousarray(w, dtype=np.float32)
        if name in GLOBAL:
            tensors[GLOBAL[name]] = w
            continue
        _, _, layer, part = name.split(".", 3)
        prefix = f"blk.{layer}"
        if part == "linear_attn.in_proj_qkvz.weight":
            if fused_qkvz:
                tensors[f"{prefix}.ssm_in.weight"] = w
            else:
                tensors[f"{prefix}.attn_qkv.weight"], tensors[f"{prefix}.attn_gate.weight"] = qkvz_split(w, config)
        elif part == "linear_attn.in_proj_ba.weight":
            tensors[f"{prefix}.ssm_beta_alpha.weight"] = w
        elif part == "mlp.experts.gate_up_proj":
            half = w.shape[1] // 2
            tensors[f"{prefix}.ffn_gate_exps.weight"] = np.ascontiguousarray(w[:, :half])
            tensors[f"{prefix}.ffn_up_exps.weight"] = np.ascontiguousarray(w[:, half:])
        else:
            tensors[f"{prefix}.{NAMES[part]}"] = w
    return tensors


def write_qwen3_next_gguf(path: Path, model, tokenizer_dir: Path, fused_qkvz: bool = False) -> Path:
    """Attention, expert, embedding and head matrices in Q8_0, and the linear layers' input projections (so the
    fused ones split as quantized rows at load); routers, shared expert and the small tensors in F32."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), ARCH)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(int(config.head_dim * config.rope_parameters["partial_rotary_factor"]))
    writer.add_uint32(f"{ARCH}.ssm.conv_kernel", config.linear_conv_kernel_dim)
    writer.add_uint32(f"{ARCH}.ssm.state_size", config.linear_key_head_dim)
    writer.add_uint32(f"{ARCH}.ssm.group_count", config.linear_num_key_heads)
    writer.add_uint32(f"{ARCH}.ssm.time_step_rank", config.linear_num_value_heads)
    writer.add_uint32(f"{ARCH}.ssm.inner_size", config.linear_value_head_dim * config.linear_num_value_heads)
    writer.add_uint32(f"{ARCH}.full_attention_interval", 4)  # no recurrent_layers array: qwen3next's converter
    writer.add_vocab_size(VOCAB)
    tokenizer_metadata(writer, tokenizer_dir)
    write_tensors(
        writer,
        converted_tensors(model, fused_qkvz),
        (*QUANTIZED, "attn_qkv.", "attn_gate.", "ssm_in.", "ssm_beta_alpha."),
    )
    return path


def with_qwen3_next_file_weights(model, path: Path):
    """`model` with each quantized matrix as gguf-py dequantizes it, put back in the checkpoint's layout."""
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}

    def read(gname: str) -> np.ndarray:
        t = stored[gname]
        return np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)

    config, state = model.config, dict(model.state_dict())
    heads, k_dim = config.linear_num_key_heads, config.linear_key_head_dim
    for name, value in state.items():
        prefix = "" if name in GLOBAL else f"blk.{name.split('.')[2]}"
        if name.endswith("mlp.experts.gate_up_proj"):
            halves = [
                read(f"{prefix}.ffn_{part}_exps.weight").reshape(value.shape[0], -1, value.shape[2])
                for part in ("gate", "up")
            ]
            state[name] = torch.from_numpy(np.concatenate(halves, axis=1))
        elif name.endswith("linear_attn.in_proj_qkvz.weight") and f"{prefix}.ssm_in.weight" in stored:
            state[name] = torch.from_numpy(read(f"{prefix}.ssm_in.weight")).reshape(value.shape)
        elif name.endswith("linear_attn.in_proj_ba.weight"):
            state[name] = torch.from_numpy(read(f"{prefix}.ssm_beta_alpha.weight")).reshape(value.shape)
        elif name.endswith("linear_attn.in_proj_qkvz.weight"):
            # the inverse of qkvz_split: each key head's q, k, v, z rows back together
            qkv, z = read(f"{prefix}.attn_qkv.weight"), read(f"{prefix}.attn_gate.weight")
            q, k, v = np.split(qkv, [heads * k_dim, 2 * heads * k_dim])
            parts = [x.reshape(heads, -1, x.shape[-1]) for x in (q, k, v, z)]
            state[name] = torch.from_numpy(np.concatenate(parts, axis=1).reshape(value.shape))
        elif name in GLOBAL or name.split(".", 3)[-1] in NAMES:
            gname = GLOBAL.get(name) or f"{prefix}.{NAMES[name.split('.', 3)[-1]]}"
            if stored[gname].tensor_type != T.F32:
                state[name] = torch.from_numpy(read(gname)).reshape(value.shape)
    model.load_state_dict(state)
    return model


@pytest.mark.parametrize("fused_qkvz", [False, True], ids=["split-qkv", "legacy-ssm_in"])
def test_qwen3_next_file_gives_transformers_tokens(fused_qkvz, tokenizer_folder, tmp_path, exact_kernels):  # noqa: F811
    path = write_qwen3_next_gguf(tmp_path / "qwen3next.gguf", tiny_qwen3_next(), tokenizer_folder, fused_qkvz)
    reference = with_qwen3_next_file_weights(tiny_qwen3_next(), path)
    llm = make_llm(path, max_num_batched_tokens=16)  # chunked prefill too
    config = llm.model_runner.hf_config
    assert type(config).__name__ == "Qwen3NextConfig" and not getattr(config, "linear_v_heads_tiled", False)
    assert config.layer_types == reference.config.layer_types and config.mlp_only_layers == []
    prompts = [prompt_ids(9, 5), prompt_ids(10, 70)]
    for prompt, result in zip(prompts, greedy(llm, prompts, max_tokens=24, k=1), strict=True):
        assert result["token_ids"] == hf_greedy(reference, prompt, 24)
