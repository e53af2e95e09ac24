"""A random-weight GGUF file with a real model's shapes and llama.cpp's Q4_K_M mix of types, for
measuring what loading a file of a given size costs (memory, time) without downloading one.

The mix is llama_tensor_get_type's for Q4_K_M: Q4_K everywhere but the tied token table (Q6_K, as it is
also the output) and attn_v and ffn_down in the "more bits" layers (Q6_K); or Q4_K throughout, as
`llama-quantize --pure` writes Q4_K. Block bytes are random with small finite fp16 scales: the loader and the
kernels do the same work on them as on trained weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

# where each K-quant keeps its fp16 scales (byte offsets in a block)
_FP16_FIELDS = {"Q4_K": (0, 2), "Q6_K": (208,)}


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int = 0  # a mixture of experts (qwen3moe) in every layer: this many, of expert_intermediate columns
    experts_per_tok: int = 0
    expert_intermediate: int = 0
    tied: bool = True  # the token table is also the output head


# Qwen3-4B's shapes (the file issue 38 was seen with: 2.5 GB), and smaller ones of the same form
QWEN3_4B = Shape(hidden=2560, intermediate=9728, layers=36, vocab=151936, heads=32, kv_heads=8, head_dim=128)
MEDIUM = Shape(hidden=2048, intermediate=6144, layers=12, vocab=65536, heads=16, kv_heads=8, head_dim=128)  # 470 MB
SMALL = Shape(hidden=1024, intermediate=3072, layers=8, vocab=32768, heads=16, kv_heads=8, head_dim=64)  # 88 MB
# Qwen3-30B-A3B's shapes (128 experts of 768, 8 a token; an 18.6 GB Q4_K_M file at its 48 layers)
QWEN3_30B_A3B = Shape(
    hidden=2048,
    intermediate=6144,
    layers=48,
    vocab=151936,
    heads=32,
    kv_heads=4,
    head_dim=128,
    experts=128,
    experts_per_tok=8,
    expert_intermediate=768,
    tied=False,
)


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[T[type_name]]
    n = rows * cols // block_values
    blocks = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
    for at in _FP16_FIELDS[type_name]:
        halves = (rng.uniform(1e-4, 1e-3, n) * rng.choice([-1, 1], n)).astype(np.float16)
        blocks[:, at : at + 2] = halves.view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


def _tensor_plan(s: Shape, pure: bool) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, [rows, cols], [experts, rows, cols] or [size], type) in the order convert_hf_to_gguf writes them."""
    table = "Q4_K" if pure or not s.tied else "Q6_K"
    plan = [("token_embd.weight", (s.vocab, s.hidden), table)]
    for i in range(s.layers):
        v_down = "Q6_K" if _more_bits(i, s.layers) and not pure else "Q4_K"
        plan += [
            (f"blk.{i}.attn_norm.weight", (s.hidden,), "F32"),
            (f"blk.{i}.attn_q.weight", (s.heads * s.head_dim, s.hidden), "Q4_K"),
            (f"blk.{i}.attn_k.weight", (s.kv_heads * s.head_dim, s.hidden), "Q4_K"),
            (f"blk.{i}.attn_v.weight", (s.kv_heads * s.head_dim, s.hidden), v_down),
            (f"blk.{i}.attn_q_norm.weight", (s.head_dim,), "F32"),
            (f"blk.{i}.attn_k_norm.weight", (s.head_dim,), "F32"),
            (f"blk.{i}.attn_output.weight", (s.hidden, s.heads * s.head_dim), "Q4_K"),
            (f"blk.{i}.ffn_norm.weight", (s.hidden,), "F32"),
        ]
        if s.experts:
            e, width = s.experts, s.expert_intermediate
            plan += [
                (f"blk.{i}.ffn_gate_inp.weight", (e, s.hidden), "F32"),
                (f"blk.{i}.ffn_gate_exps.weight", (e, width, s.hidden), "Q4_K"),
                (f"blk.{i}.ffn_up_exps.weight", (e, width, s.hidden), "Q4_K"),
                (f"blk.{i}.ffn_down_exps.weight", (e, s.hidden, width), v_down),
            ]
        else:
            plan += [
                (f"blk.{i}.ffn_gate.weight", (s.intermediate, s.hidden), "Q4_K"),
                (f"blk.{i}.ffn_up.weight", (s.intermediate, s.hidden), "Q4_K"),
                (f"blk.{i}.ffn_down.weight", (s.hidden, s.intermediate), v_down),
            ]
    plan.append(("output_norm.weight", (s.hidden,), "F32"))
    if not s.tied:
        plan.append(("output.weight", (s.vocab, s.hidden), "Q4_K" if pure else "Q6_K"))
    return plan


def _stored_bytes(dims: tuple[int, ...], type_name: str) -> tuple[int, ...]:
    if type_name == "F32":
        return dims
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[T[type_name]]
    return (*dims[:-1], dims[-1] // block_values * block_bytes)


def write_shaped_gguf(path: Path, shape: Shape, tokenizer_folder: Path, pure: bool = False, seed: int = 0) -> Path:
    """A Qwen3 GGUF of `shape` whose tokenizer is the tests' small BPE one (the table keeps `shape.vocab` rows):
    Q4_K_M's mix of types, or Q4_K alone where `pure`."""
    from tests.test_gguf_engine import tokenizer_metadata

    rng = np.random.default_rng(seed)
    arch = "qwen3moe" if shape.experts else "qwen3"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(4096)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(shape.vocab)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_per_tok)
        writer.add_expert_feed_forward_length(shape.expert_intermediate)
    tokenizer_metadata(writer, tokenizer_folder, pad_to=shape.vocab)
    # Tensors are generated and written one at a time: a Qwen3-30B-A3B-shaped file is never held whole
    plan = _tensor_plan(shape, pure)
    for name, dims, type_name in plan:
        stored = _stored_bytes(dims, type_name)
        nbytes = int(np.prod(stored)) * (4 if type_name == "F32" else 1)
        dtype = np.float32 if type_name == "F32" else np.uint8
        writer.add_tensor_info(
            name, stored, np.dtype(dtype), nbytes, raw_dtype=None if type_name == "F32" else T[type_name]
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims, type_name in plan:
        if type_name == "F32":
            scale = 0.02 if "ffn_gate_inp" in name else 1.0  # a router's logits small, norms near 1
            writer.write_tensor_data(rng.uniform(0.8, 1.2, dims).astype(np.float32) * np.float32(scale))
        else:
            rows = int(np.prod(dims[:-1]))
            writer.write_tensor_data(
                _random_blocks(type_name, rows, dims[-1], rng).reshape(_stored_bytes(dims, type_name))
            )
    writer.close()
    return path
