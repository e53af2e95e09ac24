"""KV-cache writes as a Triton kernel: the new tokens' K and V rows scattered to their cache slots.

``_store_kvcache_kernel`` runs one program per new token; it writes the token's K and V rows to
``slot_mapping[t]``, or nothing when the slot is negative (a padded token). The cache layout is
triton_kernels.py's: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def row_offset(row, row_stride):
    """Element offset of cache row ``row``. Computed in int64: a cache can hold more than 2**31
    elements, and ``slot * row_stride`` would silently wrap in int32."""
    return row.to(tl.int64) * row_stride


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    cache_row_stride,  # elements per slot: num_kv_heads * head_dim (cache is contiguous)
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # padded token: write nothing
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    # key/value may be strided views (e.g. slices of a fused qkv projection); head_dim is unit-stride.
    tok = token.to(tl.int64)
    k = tl.load(key_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    dst = row_offset(slot, cache_row_stride) + h[:, None] * HEAD_DIM + d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """The kernels index the cache as contiguous [num_blocks, block_size, num_kv_heads, head_dim]."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"K cache {tuple(k_cache.shape)} and V cache {tuple(v_cache.shape)} must be equal and end in "
            f"(num_kv_heads, head_dim) = ({num_kv_heads}, {head_dim})"
        )


def store_kvcache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1 = padded token
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    check_cache(k_cache, v_cache, num_kv_heads, head_dim)
    if value.shape != key.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"store_kvcache: key {tuple(key.shape)}, value {tuple(value.shape)} and slot_mapping "
            f"{tuple(slot_mapping.shape)} must describe the same {num_tokens} tokens"
        )
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        num_kv_heads * head_dim,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
