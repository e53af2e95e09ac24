"""The reference paged attention, in plain PyTorch. Runs on any torch device.

Every other backend is tested against this one, so it favours obviousness over speed. Four
concessions: what a step's layers share (which blocks each sequence reads, the masks) is worked
out once per step; KV is gathered whole blocks at a time (one index per block, not per token);
decode rows go through a few batched calls, grouped by length so that short sequences do not
pay for the longest one's padding; and a group whose rows share one length (batch 1 always
does) runs without a mask.

It reads sequence lengths on the host. Under a CUDA graph those are upper bounds
(`host_lens_exact` is False), and only the masked path is taken. Inside a compiled CPU decode
step (engine/runner/compiled_decode.py) nothing is read on the host: `compiled_decode` attends from the
device tensors alone, so the compiler traces no Python values it would have to specialise on.
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from engine.attention.key_mean import MeanScores
from engine.attention.kv_format import PLAIN, KVFormat
from engine.attention.metadata import AttentionMetadata
from engine.runner.tracing import tracing_decode_step

DECODE_GROUP_ROWS = 8  # decode rows per length group (fewer calls vs. less padding)
MAX_DECODE_GROUPS = 4


def store_kvcache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1 = padded token
) -> None:
    if tracing_decode_step():  # compiled decode steps have no padded tokens, and no host state
        tokens, slots = None, slot_mapping
    else:
        tokens, slots = _valid_slots(slot_mapping)
    if tokens is not None:
        key, value = key[tokens], value[tokens]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))


_last_slots: tuple = (None, None, None)


def _valid_slots(slot_mapping: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the tokens to write, or None for all; their slots). Every layer of a step passes the same
    slot_mapping tensor, so this is worked out once per step, not once per layer. Each step builds
    a new slot_mapping; one changed in place would be served the stale answer."""
    global _last_slots
    last = _last_slots  # one read: another engine's thread may replace it meanwhile
    if last[0] is not slot_mapping:
        valid = slot_mapping >= 0
        tokens = None if bool(valid.all()) else valid.nonzero().squeeze(1)
        last = _last_slots = (slot_mapping, tokens, slot_mapping if tokens is None else slot_mapping[tokens])
    return last[1], last[2]


@dataclass
class _Prefill:
    start: int
    q_len: int
    kv_len: int
    blocks: torch.Tensor  # [ceil(kv_len / block_size)] the blocks holding KV positions 0..kv_len-1
    mask: torch.Tensor | None  # [q_len, kv_len] for a prefix hit or a later chunk; None when plain causal
    first_position: int = 0  # of the first key read (a sliding window skips whole blocks)


@dataclass
class _Decode:
    token_idx: torch.Tensor | None  # the rows' query tokens; None when every token is a decode row, in order
    blocks: torch.Tensor  # [S, num_blocks] blocks to read
    kv_len: int  # KV positions to read from those blocks
    mask: torch.Tensor | None  # [S, 1, 1, kv_len]; None when every row has kv_len positions
    live: torch.Tensor | None  # [S, 1, 1]: False for padding rows (seq_len 0), whose output is zero
    positions: torch.Tensor | None = None  # [S, kv_len] each key's position; None: 0..kv_len-1


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """KV of whole blocks: cache [num_blocks, block_size, Hkv, D], blocks [..., n] -> [..., n * block_size, Hkv, D]."""
    picked = cache.index_select(0, blocks.reshape(-1))
    return picked.view(*blocks.shape[:-1], blocks.shape[-1] * cache.shape[1], *cache.shape[2:])


def _numbers(rows: torch.Tensor, kv_format: KVFormat, like: torch.Tensor) -> torch.Tensor:
    """Keys or values read from the cache [..., Hkv, row] as numbers of the query's dtype and head size."""
    return kv_format.unpack(rows, like.dtype, like.shape[-1])


def _decode_plan(
    meta: AttentionMetadata, rows: list[int], block_size: int, every_row: bool, window: int | None
) -> _Decode:
    dev = meta.block_tables.device
    rows_t = None if every_row else torch.tensor(rows, device=dev)
    pick = (lambda t: t) if every_row else (lambda t: t[rows_t])
    lens = [meta.seq_lens_cpu[i] for i in rows]
    token_idx = None if every_row else meta.query_start_loc[rows_t].long()
    if window is not None and meta.host_lens_exact and max(lens) > window:
        return _window_decode_plan(meta, pick, lens, token_idx, block_size, window)
    num_blocks = min(-(-max(lens) // block_size), meta.block_tables.shape[1])
    blocks = pick(meta.block_tables)[:, :num_blocks].clamp(min=0).long()
    # One length (always so at batch 1): no padding rows. Whole blocks still, masked: SDPA's CPU kernel then gives a
    # row the same result in any batch (it rounds differently over an exact length; and with more than one thread
    # only with MKL_CBWR set, see engine/__init__.py), so the rows of a request checking drafts (speculative
    # decoding) compute what its plain decode steps would, bit for bit.
    if meta.host_lens_exact and min(lens) == max(lens) > 0:
        return _Decode(
            token_idx, blocks, num_blocks * block_size, _length_mask(lens[0], num_blocks * block_size, dev), None
        )
    seq_lens = pick(meta.seq_lens).long()
    positions = torch.arange(num_blocks * block_size, device=dev)[None, :]
    valid = positions < seq_lens[:, None]
    if window is not None:
        valid &= positions >= seq_lens[:, None] - window
    valid[:, 0] |= seq_lens == 0  # padding rows (seq_len 0) attend to something finite, then get zeroed
    return _Decode(token_idx, blocks, num_blocks * block_size, valid[:, None, None, :], (seq_lens > 0)[:, None, None])


def _length_mask(length: int, padded: int, device: torch.device) -> torch.Tensor | None:
    """[1, 1, 1, padded]: the first `length` keys; None when that is all of them."""
    return None if length == padded else (torch.arange(padded, device=device) < length)[None, None, None, :]


def _window_decode_plan(meta, pick, lens: list[int], token_idx, block_size: int, window: int) -> _Decode:
    """Decode rows of a sliding-window layer: each row reads only the blocks its last `window` positions lie in."""
    dev = meta.block_tables.device
    seq_lens = torch.tensor(lens, device=dev)
    first_block = (seq_lens - window).clamp(min=0) // block_size
    num_blocks = max(-(-n // block_size) - max(0, n - window) // block_size for n in lens)
    index = (first_block[:, None] + torch.arange(num_blocks, device=dev)[None, :]).clamp(
        max=meta.block_tables.shape[1] - 1
    )
    blocks = pick(meta.block_tables).gather(1, index).clamp(min=0).long()
    positions = first_block[:, None] * block_size + torch.arange(num_blocks * block_size, device=dev)[None, :]
    valid = (positions < seq_lens[:, None]) & (positions >= seq_lens[:, None] - window)
    return _Decode(token_idx, blocks, num_blocks * block_size, valid[:, None, None, :], None, positions)


def _plan(meta: AttentionMetadata, block_size: int, window: int | None):
    """The step's decode groups and prefills, worked out once per step for each window its layers use."""
    key = ("torch", window)
    if key in meta.backend_cache:
        return meta.backend_cache[key]
    dev = meta.block_tables.device
    starts = meta.query_start_loc.tolist()
    rows = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1 and meta.seq_lens_cpu[i] > 0]
    decodes = []
    if rows:
        groups = min(MAX_DECODE_GROUPS, -(-len(rows) // DECODE_GROUP_ROWS))
        if groups == 1:
            every_row = len(rows) == meta.num_seqs and starts[-1] == meta.num_seqs
            decodes.append(_decode_plan(meta, rows, block_size, every_row, window))
        else:
            rows.sort(key=lambda i: meta.seq_lens_cpu[i])
            size = -(-len(rows) // groups)
            decodes += [
                _decode_plan(meta, rows[g : g + size], block_size, False, window) for g in range(0, len(rows), size)
            ]
    prefills = []
    for i, (q_len, kv_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if q_len <= 1 or kv_len == 0:
            continue
        # A sliding window's first query sees nothing before kv_len - q_len - window + 1: skip those blocks.
        first = 0 if window is None else max(0, kv_len - q_len - window + 1) // block_size
        blocks = meta.block_tables[i, first : -(-kv_len // block_size)].long()
        mask = None
        if q_len != kv_len or window is not None:  # query j sits at KV position kv_len - q_len + j
            q_pos = torch.arange(kv_len - q_len, kv_len, device=dev)[:, None]
            kv_pos = torch.arange(first * block_size, kv_len, device=dev)[None, :]
            mask = kv_pos <= q_pos
            if window is not None:
                mask &= kv_pos > q_pos - window
        prefills.append(_Prefill(starts[i], q_len, kv_len - first * block_size, blocks, mask, first * block_size))
    meta.backend_cache[key] = plan = (decodes, prefills)
    return plan


def attend(
    q: torch.Tensor,  # [B, H, Lq, D]
    k: torch.Tensor,  # [B, Hkv, Lk, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # bool, broadcastable to [B, H, Lq, Lk]; None: causal (`causal`) or every key
    scale: float,
    sinks: torch.Tensor | None = None,
    causal: bool = False,
    bias: torch.Tensor | None = None,  # broadcastable to [B, H, Lq, Lk]: added to the scaled scores
) -> torch.Tensor:
    """SDPA. With `sinks` (a logit per head, gpt-oss), each head's softmax also counts exp(sink) in its
    denominator: an extra key of zeros takes the sink as its score, and its value (zeros) adds nothing."""
    if sinks is None and bias is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale, enable_gqa=True
        )
    (batch, heads, q_len, _), k_len = q.shape, k.shape[2]
    if mask is None and causal:
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
    bias = torch.zeros((), dtype=q.dtype, device=q.device) if bias is None else bias.to(q.dtype)
    if mask is not None:
        bias = bias.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)
    sink = sinks.to(q.dtype).view(1, heads, 1, 1).expand(batch, heads, q_len, 1)
    bias = torch.cat((bias.expand(batch, heads, q_len, k_len), sink), dim=-1)
    k, v = F.pad(k, (0, 0, 0, 1)), F.pad(v, (0, 0, 0, 1))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,  # a sliding-window layer's: each query sees its last `window` positions
    sinks: torch.Tensor | None = None,  # [num_heads] attention-sink logits (gpt-oss): see `attend`
    kv_format: KVFormat = PLAIN,  # how the cache stores keys and values (a quantized cache: kv_format.py)
    mean_scores: MeanScores | None = None,  # what centred keys took out of the scores (key_mean.py)
) -> torch.Tensor:
    if tracing_decode_step():
        blocks, lens = meta.block_tables, meta.seq_lens
        return compiled_decode(query, k_cache, v_cache, blocks, lens, scale, window, sinks, kv_format, mean_scores)
    decodes, prefills = _plan(meta, k_cache.shape[1], window)
    if len(decodes) == 1 and decodes[0].token_idx is None and not prefills:
        return _decode(query, k_cache, v_cache, decodes[0], scale, sinks, kv_format, mean_scores)
    out = torch.zeros_like(query)
    for d in decodes:
        rows = query[d.token_idx], None if mean_scores is None else _rows(mean_scores, d.token_idx)
        out.index_copy_(0, d.token_idx, _decode(rows[0], k_cache, v_cache, d, scale, sinks, kv_format, rows[1]))
    for p in prefills:
        # 4-D inputs: with 3-D ones, SDPA on CPU falls back to its unfused path, 3-4x slower.
        q = query[p.start : p.start + p.q_len].transpose(0, 1)[None]  # [1, H, q_len, D]
        k = _numbers(_gather(k_cache, p.blocks)[: p.kv_len].transpose(0, 1), kv_format, q)[None]
        v = _numbers(_gather(v_cache, p.blocks)[: p.kv_len].transpose(0, 1), kv_format, q)[None]
        if mean_scores is not None:  # the mean back into the keys: for many queries, cheaper than their scores
            positions = p.first_position + torch.arange(p.kv_len, device=q.device)
            k += mean_scores.mean_keys(positions).transpose(0, 1).to(k.dtype)
        o = attend(q, k, v, p.mask, scale, sinks, causal=True)
        out[p.start : p.start + p.q_len] = o[0].transpose(0, 1)
    return out


def _rows(mean_scores: MeanScores, token_idx: torch.Tensor) -> MeanScores:
    return replace(mean_scores, query_terms=mean_scores.query_terms[token_idx])


def _decode_bias(mean_scores: MeanScores, positions: torch.Tensor | int, scale: float) -> torch.Tensor:
    """Decode rows' share of centred keys' scores: query_terms [S, H, W], key positions [L] or [S, L] (or an int L:
    0..L-1) -> [S, H, 1, L], scaled as SDPA scales the scores it adds it to."""
    if isinstance(positions, int):
        key_rows = mean_scores.first_rows(positions)  # [L, W]
    else:
        key_rows = mean_scores.rows(positions)
        key_rows = key_rows[:, None] if key_rows.dim() == 3 else key_rows  # [S, 1, L, W] or [L, W]
    return (mean_scores.query_terms[:, :, None] @ key_rows.transpose(-1, -2)) * scale


def _decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: _Decode,
    scale: float,
    sinks: torch.Tensor | None = None,
    kv_format: KVFormat = PLAIN,
    mean_scores: MeanScores | None = None,
) -> torch.Tensor:
    # [S, Hkv, L, D]: a quantized cache dequantizes into that order, contiguous (SDPA reads it fastest)
    k = _numbers(_gather(k_cache, plan.blocks)[:, : plan.kv_len].transpose(1, 2), kv_format, query)
    v = _numbers(_gather(v_cache, plan.blocks)[:, : plan.kv_len].transpose(1, 2), kv_format, query)
    bias = None
    if mean_scores is not None:
        bias = _decode_bias(mean_scores, plan.kv_len if plan.positions is None else plan.positions, scale)
    o = attend(query.unsqueeze(2), k, v, plan.mask, scale, sinks, bias=bias).squeeze(2)
    return o if plan.live is None else torch.where(plan.live, o, 0.0)


def compiled_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    kv_format: KVFormat = PLAIN,
    mean_scores: MeanScores | None = None,
) -> torch.Tensor:
    """Decode rows (one query token per sequence) from device tensors only: every row reads all of
    `block_tables`' blocks (-1 entries read block 0), masked to its own length (and window)."""
    blocks = block_tables.clamp(min=0).long()
    rows, length = blocks.shape[0], blocks.shape[1] * k_cache.shape[1]
    # Indexing, not `_gather`'s index_select: after the in-place KV write of the same step, inductor
    # copied the whole cache around an index_select (60 copies of 18 MB a step on SmolLM2), not around this.
    k = _numbers(k_cache[blocks].view(rows, length, *k_cache.shape[2:]).transpose(1, 2), kv_format, query)
    v = _numbers(v_cache[blocks].view(rows, length, *v_cache.shape[2:]).transpose(1, 2), kv_format, query)
    positions = torch.arange(length, device=query.device)[None, :]
    valid = positions < seq_lens[:, None]
    if window is not None:
        valid &= positions >= seq_lens[:, None] - window
    # positions[0] indexed, not a slice of the table: a slice would make the trace assume a length
    bias = None if mean_scores is None else _decode_bias(mean_scores, positions[0], scale)
    return attend(query.unsqueeze(2), k, v, valid[:, None, None, :], scale, sinks, bias=bias).squeeze(2)
