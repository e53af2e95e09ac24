"""The reference paged attention, in plain PyTorch. Runs on any torch device.

Every other backend is tested against this one, so it favours obviousness over speed. Two
concessions: what a step's layers share (which cache slots each sequence reads, the masks) is
worked out once per step, and all single-token (decode) rows go through one batched call.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata


def store_kvcache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1 = padded token
) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key[valid].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value[valid].to(v_cache.dtype))


@dataclass
class _Prefill:
    start: int
    q_len: int
    slots: torch.Tensor  # [kv_len] cache slots of KV positions 0..kv_len-1
    mask: torch.Tensor | None  # [q_len, kv_len] for a prefix hit or a later chunk; None when plain causal


@dataclass
class _Decode:
    token_idx: torch.Tensor | None  # the rows' query tokens; None when every token is a decode row
    slots: torch.Tensor  # [S, L] cache slots to read
    mask: torch.Tensor  # [S, 1, 1, L]
    live: torch.Tensor  # [S, 1, 1]: False for padding rows (seq_len 0), whose output is zero


def _slots(block_tables: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """Cache slots of the first num_blocks blocks of each row: [rows, num_blocks * block_size]."""
    offsets = torch.arange(block_size, device=block_tables.device)
    tables = block_tables[..., :num_blocks].clamp(min=0).long()
    return (tables[..., None] * block_size + offsets).flatten(-2)


def _plan(meta: AttentionMetadata, block_size: int):
    if "torch" in meta.backend_cache:
        return meta.backend_cache["torch"]
    dev = meta.block_tables.device
    starts = meta.query_start_loc.tolist()
    rows = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1 and meta.seq_lens_cpu[i] > 0]
    decode = None
    if rows:
        # Under a CUDA graph the host lengths are upper bounds; the device tensors hold the truth.
        every_row = len(rows) == meta.num_seqs and starts[-1] == meta.num_seqs
        rows_t = None if every_row else torch.tensor(rows, device=dev)
        pick = (lambda t: t) if every_row else (lambda t: t[rows_t])
        seq_lens = pick(meta.seq_lens).long()
        num_blocks = min(-(-max(meta.seq_lens_cpu[i] for i in rows) // block_size), meta.block_tables.shape[1])
        slots = _slots(pick(meta.block_tables), num_blocks, block_size)
        valid = torch.arange(slots.shape[1], device=dev)[None, :] < seq_lens[:, None]
        valid[:, 0] = True  # padding rows (seq_len 0) attend to something finite, then get zeroed
        token_idx = None if every_row else meta.query_start_loc[rows_t].long()
        decode = _Decode(token_idx, slots, valid[:, None, None, :], (seq_lens > 0)[:, None, None])
    prefills = []
    for i, (q_len, kv_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if q_len <= 1 or kv_len == 0:
            continue
        slots = _slots(meta.block_tables[i], -(-kv_len // block_size), block_size)[:kv_len]
        mask = None
        if q_len != kv_len:  # query j sits at KV position kv_len - q_len + j and sees everything up to it
            q_pos = torch.arange(kv_len - q_len, kv_len, device=dev)
            mask = torch.arange(kv_len, device=dev)[None, :] <= q_pos[:, None]
        prefills.append(_Prefill(starts[i], q_len, slots, mask))
    meta.backend_cache["torch"] = plan = (decode, prefills)
    return plan


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    decode, prefills = _plan(meta, k_cache.shape[1])
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    if decode is not None and decode.token_idx is None and not prefills:
        return _decode(query, flat_k, flat_v, decode, scale)
    out = torch.zeros_like(query)
    if decode is not None:
        out[decode.token_idx] = _decode(query[decode.token_idx], flat_k, flat_v, decode, scale)
    for p in prefills:
        # 4-D inputs: with 3-D ones, SDPA on CPU falls back to its unfused path, 3-4x slower.
        q = query[p.start : p.start + p.q_len].transpose(0, 1)[None]  # [1, H, q_len, D]
        k = flat_k[p.slots].transpose(0, 1)[None].to(q.dtype)
        v = flat_v[p.slots].transpose(0, 1)[None].to(q.dtype)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True)
        out[p.start : p.start + p.q_len] = o[0].transpose(0, 1)
    return out


def _decode(query: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor, plan: _Decode, scale: float) -> torch.Tensor:
    k = flat_k[plan.slots].transpose(1, 2).to(query.dtype)  # [S, Hkv, L, D]
    v = flat_v[plan.slots].transpose(1, 2).to(query.dtype)
    o = F.scaled_dot_product_attention(query.unsqueeze(2), k, v, attn_mask=plan.mask, scale=scale, enable_gqa=True)
    return torch.where(plan.live, o.squeeze(2), 0.0)
