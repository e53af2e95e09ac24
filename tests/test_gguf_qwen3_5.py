"""Qwen3.5 and Qwen3.5-MoE GGUF files, written as llama.cpp's convert_hf_to_gguf writes them: the hybrid layers under
its ssm names, the value heads reordered from grouped to tiled across the key heads (the tiny model has 4 value heads
over 2 key heads, so the order matters), decay rates as -exp(A_log), zero-centred norms as 1 + weight, the
convolution squeezed; the experts' gate and up apart, the shared expert under its own names. They give
transformers' tokens on the weights as gguf-py dequantizes them, through the float32 dequantizing kernels, alone, in
a batch and with chunked prefill."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.conftest import qwen3_5_model, widen_weights
from tests.test_gguf_engine import encode, greedy, make_llm, prompt_ids, tokenizer_metadata
from tests.test_gguf_families import VOCAB, exact_kernels, tokenizer_folder  # noqa: F401 (fixtures)
from tests.test_parity import hf_greedy

NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
GLOBAL["lm_head.weight"] = "output.weight"
QUANTIZED = ("attn_q.", "attn_k.", "attn_v.", "attn_output.", "ffn_gate.", "ffn_up.", "ffn_down.", "ffn_gate_exps")
QUANTIZED += ("ffn_up_exps", "ffn_down_exps", "token_embd.", "output.")


def gguf_name(hf_name: str) -> str:
    if hf_name in GLOBAL:
        return GLOBAL[hf_name]
    _, _, layer, part = hf_name.split(".", 3)
    return f"blk.{layer}.{NAMES[part]}"


def tiled(w: np.ndarray, dim: int, key_heads: int, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf's _reorder_v_heads: value heads grouped by key head -> tiled across key heads."""
    shape = list(w.shape)
    per_key = shape[dim] // key_heads // head_dim
    w = w.reshape(*shape[:dim], key_heads, per_key, head_dim, *shape[dim + 1 :])
    return np.swapaxes(w, dim, dim + 1).reshape(shape)


def as_converted(name: str, w: np.ndarray, config) -> np.ndarray:
    key_heads, k_dim, v_dim = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    keys = 2 * key_heads * k_dim
    if name.endswith("in_proj_qkv.weight"):
        w = np.concatenate([w[:keys], tiled(w[keys:], 0, key_heads, v_dim)])
    elif name.endswith("in_proj_z.weight"):
        w = tiled(w, 0, key_heads, v_dim)
    elif name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        w = tiled(w, 0, key_heads, 1)
    elif name.endswith("conv1d.weight"):
        w = w.squeeze(1)
        w = np.concatenate([w[:keys], tiled(w[keys:], 0, key_heads, v_dim)])
    elif name.endswith("out_proj.weight"):
        w = tiled(w, 1, key_heads, v_dim)
    if name.endswith("A_log"):
        w = -np.exp(w)
    if name.endswith("norm.weight") and "linear_attn.norm" not in name:
        w = w + 1
    return np.ascontiguousarray(w, dtype=np.float32)


def converted_tensors(model) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names, as the converter changes them; the experts' gate_up apart."""
    tensors = {}
    for name, p in model.state_dict().items():
        w = as_converted(name, p.detach().float().numpy(), model.config)
        if name.endswith("experts.gate_up_proj"):
            prefix, half = f"blk.{name.split('.')[2]}", w.shape[1] // 2
            tensors[f"{prefix}.ffn_gate_exps.weight"], tensors[f"{prefix}.ffn_up_exps.weight"] = (
                w[:, :half],
                w[:, half:],
            )
        else:
            tensors[gguf_name(name)] = w
    return tensors


MTP_NAMES = {
    "fc.weight": "nextn.eh_proj.weight",
    "pre_fc_norm_embedding.weight": "nextn.enorm.weight",
    "pre_fc_norm_hidden.weight": "nextn.hnorm.weight",
    "norm.weight": "nextn.shared_head_norm.weight",
}


def mtp_gguf_name(head_name: str, config) -> str:
    """Where convert_hf_to_gguf puts a head tensor (named as `mtp.*` without the prefix): the block after the
    model's, its layer's tensors under the model's names, its own under nextn names."""
    block = f"blk.{config.num_hidden_layers}"
    if head_name in MTP_NAMES:
        return f"{block}.{MTP_NAMES[head_name]}"
    return f"{block}.{NAMES[head_name.removeprefix('layers.0.')]}"


def mtp_block(tensors: dict[str, np.ndarray], config, head: dict[str, torch.Tensor] | None = None) -> dict:
    """A multi-token-prediction head as convert_hf_to_gguf appends it: one more block, a full-attention layer with
    its nextn tensors. `head`: its tensors (named as `mtp.*` without the prefix); else the last layer's tensors,
    perturbed, with ones for the rest."""
    if head is not None:  # converted under their GGUF names, as llama.cpp renames them first: enorm and hnorm + 1
        block = {mtp_gguf_name(n, config): w.float().numpy() for n, w in head.items()}
        return {n: as_converted(n, w, config) for n, w in block.items()}
    last, block_id = config.num_hidden_layers - 1, config.num_hidden_layers
    block = {
        n.replace(f"blk.{last}.", f"blk.{block_id}."): w + 0.5
        for n, w in tensors.items()
        if n.startswith(f"blk.{last}.")
    }
    size = config.hidden_size
    block[f"blk.{block_id}.nextn.eh_proj.weight"] = np.ones((size, 2 * size), np.float32)
    for norm in ("enorm", "hnorm", "shared_head_norm"):
        block[f"blk.{block_id}.nextn.{norm}.weight"] = np.ones(size, np.float32)
    return block


def write_qwen3_5_gguf(path: Path, model, tokenizer_dir: Path, mtp: bool = False, head: dict | None = None) -> Path:
    """Attention, MLP, experts, embedding and head matrices in Q8_0 (the head's fc too); the linear layers'
    tensors, the routers and the shared expert in F32. `mtp`: with a multi-token-prediction head's block after the
    model's (`head`'s tensors, see mtp_block)."""
    config = model.config
    moe = bool(getattr(config, "num_experts", 0))
    arch = "qwen35moe" if moe else "qwen35"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers + mtp)
    if mtp:
        writer.add_uint32(f"{arch}.nextn_predict_layers", 1)
    if moe:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    else:
        writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(int(config.head_dim * config.rope_parameters["partial_rotary_factor"]))
    writer.add_uint32(f"{arch}.ssm.conv_kernel", config.linear_conv_kernel_dim)
    writer.add_uint32(f"{arch}.ssm.state_size", config.linear_key_head_dim)
    writer.add_uint32(f"{arch}.ssm.group_count", config.linear_num_key_heads)
    writer.add_uint32(f"{arch}.ssm.time_step_rank", config.linear_num_value_heads)
    writer.add_uint32(f"{arch}.ssm.inner_size", config.linear_value_head_dim * config.linear_num_value_heads)
    recurrent = [t == "linear_attention" for t in config.layer_types] + [False] * mtp
    writer.add_array(f"{arch}.attention.recurrent_layers", recurrent)
    writer.add_uint32(f"{arch}.full_attention_interval", 4)
    writer.add_vocab_size(VOCAB)
    tokenizer_metadata(writer, tokenizer_dir)
    tensors = converted_tensors(model)
    tensors |= mtp_block(tensors, config, head) if mtp else {}
    write_tensors(writer, tensors, (*QUANTIZED, "nextn.eh_proj"))
    return path


def write_tensors(writer: gguf.GGUFWriter, tensors: dict[str, np.ndarray], quantized: tuple[str, ...]) -> None:
    """The tensors whose names (after the block) start with one of `quantized` in Q8_0, experts' stacks an expert's
    rows at a time, the others in F32; then the file is written and closed."""
    for i, (gname, w) in enumerate(tensors.items()):
        if not (gname.split(".", 2)[-1] if gname.startswith("blk.") else gname).startswith(quantized):
            writer.add_tensor(gname, w, raw_dtype=T.F32)
        elif w.ndim == 3:  # the experts' stacks, each expert's rows quantized
            data = gguf.quants.quantize(np.ascontiguousarray(w).reshape(-1, w.shape[-1]), T.Q8_0)
            writer.add_tensor(gname, data.reshape(*w.shape[:2], -1), raw_dtype=T.Q8_0)
        else:
            data, qtype = encode(w, "Q8_0", seed=i)
            writer.add_tensor(gname, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def with_file_weights(model, path: Path):
    """`model` with the quantized matrices as gguf-py dequantizes them (the F32 ones are its own)."""
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}

    def read(gname: str) -> torch.Tensor:
        t = stored[gname]
        return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))

    state = dict(model.state_dict())
    for name, value in state.items():
        if name.endswith("experts.gate_up_proj"):
            prefix = f"blk.{name.split('.')[2]}"
            gate_up = [
                read(f"{prefix}.ffn_{part}_exps.weight").reshape(value.shape[0], -1, value.shape[2])
                for part in ("gate", "up")
            ]
            state[name] = torch.cat(gate_up, dim=1)
        elif stored[gguf_name(name)].tensor_type != T.F32:
            state[name] = read(gguf_name(name)).reshape(value.shape)
    model.load_state_dict(state)
    return model


def tiny_qwen3_5(moe: bool):
    torch.manual_seed(50 + moe)
    model = qwen3_5_model(moe)
    widen_weights(model)
    return model.eval()


@pytest.mark.parametrize("moe,mtp", [(False, False), (True, False), (False, True)], ids=["dense", "moe", "with-mtp"])
def test_qwen3_5_file_gives_transformers_tokens(moe, mtp, tokenizer_folder, tmp_path, exact_kernels):  # noqa: F811
    """with-mtp: a file that keeps the multi-token-prediction head (as llama.cpp's converter does for Qwen3.5) loads
    the model alone."""
    path = write_qwen3_5_gguf(tmp_path / "qwen35.gguf", tiny_qwen3_5(moe), tokenizer_folder, mtp)
    reference = with_file_weights(tiny_qwen3_5(moe), path)
    llm = make_llm(path, max_num_batched_tokens=16)  # chunked prefill too
    config = llm.model_runner.hf_config
    assert config.layer_types == reference.config.layer_types and config.linear_v_heads_tiled
    assert config.rope_parameters["partial_rotary_factor"] == 0.25
    prompts = [prompt_ids(9, 5), prompt_ids(10, 70)]
    for prompt, result in zip(prompts, greedy(llm, prompts, max_tokens=24, k=1)):
        assert result["token_ids"] == hf_greedy(reference, prompt, 24)
