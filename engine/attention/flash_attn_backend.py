"""Paged attention through flash-attn's CUDA kernels (the optional `flash_attn` package).

Its paged path reads the cache in pages of a multiple of 256 tokens and computes in fp16/bf16, so
`select_backend` takes it only for such caches; at the default block size of 16 (which keeps short
system prompts shareable) the Triton kernels run instead. KV writes use the Triton store kernel
(int64 offsets, padded slots skipped). Semantics are those of ``AttentionMetadata``: flash-attn's
causal mask is aligned to the end of each sequence, which is where a step's query tokens sit.
"""

import torch
import torch.nn.functional as F
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from engine.attention.metadata import AttentionMetadata
from engine.attention.triton_store import store_kvcache

__all__ = ["paged_attention", "store_kvcache"]


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim]; caches [num_blocks, block_size, num_kv_heads, head_dim].
    A sliding `window` of W positions is flash-attn's window_size (W - 1 keys before the query, none after)."""
    window_size = (-1, -1) if window is None else (window - 1, 0)
    if meta.is_decode_only:
        # One token per sequence: the kv-cache kernel also splits long contexts across the SMs.
        out = flash_attn_with_kvcache(
            query.unsqueeze(1),
            k_cache,
            v_cache,
            cache_seqlens=meta.seq_lens,
            block_table=meta.block_tables,
            softmax_scale=scale,
            causal=True,
            window_size=window_size,
        )
        return out.squeeze(1)
    cu_seqlens_k = meta.backend_cache.get("cu_seqlens_k")
    if cu_seqlens_k is None:  # once per step, shared by every layer
        cu_seqlens_k = meta.backend_cache["cu_seqlens_k"] = F.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
    return flash_attn_varlen_func(
        query,
        k_cache,
        v_cache,
        meta.query_start_loc,
        cu_seqlens_k,
        meta.max_query_len,
        meta.max_seq_len,
        softmax_scale=scale,
        causal=True,
        window_size=window_size,
        block_table=meta.block_tables,
    )
