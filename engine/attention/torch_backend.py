"""The reference paged attention, in plain PyTorch. Runs on any torch device.

Every other backend is tested against this one, so it favours obviousness over speed; the one
concession is that all single-token (decode) rows of a batch go through one batched call.
"""
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


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` KV rows of one sequence: [length, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:length]


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    out = torch.zeros_like(query)
    decode_rows = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1 and meta.seq_lens_cpu[i] > 0]
    if decode_rows:
        _decode(query, k_cache, v_cache, meta, scale, decode_rows, out)
    starts = meta.query_start_loc.tolist()
    for i, (q_len, kv_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if q_len <= 1 or kv_len == 0:
            continue
        q = query[starts[i] : starts[i] + q_len].transpose(0, 1)  # [H, q_len, D]
        k = _gather_kv(k_cache, meta.block_tables[i], kv_len).transpose(0, 1).to(q.dtype)
        v = _gather_kv(v_cache, meta.block_tables[i], kv_len).transpose(0, 1).to(q.dtype)
        if q_len == kv_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Query j sits at KV position kv_len - q_len + j and sees everything up to it.
            q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
            mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[starts[i] : starts[i] + q_len] = o.transpose(0, 1)
    return out


def _decode(query, k_cache, v_cache, meta, scale, rows, out) -> None:
    # Under a CUDA graph the host lengths are upper bounds; the device tensors hold the truth.
    block_size = k_cache.shape[1]
    rows_t = torch.tensor(rows, device=query.device)
    seq_lens = meta.seq_lens[rows_t].long()
    num_blocks = min(-(-max(meta.seq_lens_cpu[i] for i in rows) // block_size), meta.block_tables.shape[1])
    max_len = num_blocks * block_size
    tables = meta.block_tables[rows_t, :num_blocks].clamp(min=0).long()
    k = k_cache[tables].flatten(1, 2).transpose(1, 2).to(query.dtype)  # [S, Hkv, L, D]
    v = v_cache[tables].flatten(1, 2).transpose(1, 2).to(query.dtype)
    valid = torch.arange(max_len, device=query.device)[None, :] < seq_lens[:, None]
    valid[:, 0] = True  # padding rows (seq_len 0) attend to something finite, then get zeroed
    token_idx = meta.query_start_loc[rows_t].long()
    q = query[token_idx].unsqueeze(2)  # [S, H, 1, D]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True)
    out[token_idx] = torch.where((seq_lens > 0)[:, None, None], o.squeeze(2), 0.0)
