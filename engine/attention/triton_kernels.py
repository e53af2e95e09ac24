"""Paged attention as Triton kernels (the cache writes they read: triton_store.py).

Computes exactly what ``engine.attention.torch_backend`` computes (that module is the reference and
the tests compare against it); see ``AttentionMetadata`` for the contract. In short:

* The KV cache is ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous. Cache *slot*
  ``s`` is row ``s`` of the cache viewed as ``[num_blocks * block_size, num_kv_heads, head_dim]``.
* ``query`` is ``[num_tokens, num_heads, head_dim]``: the new tokens of all sequences, flattened.
  Sequence ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i+1]``, which are the *last*
  ``query_len`` positions of its ``seq_lens[i]`` KV positions, so query ``j`` sits at position
  ``seq_lens[i] - query_len + j`` and attends to KV positions ``0..that position``.
* KV position ``p`` of sequence ``i`` lives in slot
  ``block_tables[i, p // block_size] * block_size + p % block_size``.
* ``seq_lens[i] == 0`` marks a padding row (CUDA-graph batches): its output is zeros.
* A quantized cache (kv_format.py) holds bytes: each head's row has its quantized values, then their float16
  scales. ``load_kv`` (triton_dequant.py) turns a tile of rows back into numbers in registers (``KV_QUANT``).

Kernels:

``_paged_attention_kernel``
    Flash attention over paged KV. Grid ``(num_seqs, num_kv_heads, cdiv(max_query_len, BLOCK_M))``.
    One program takes ``BLOCK_M`` query tokens of one sequence and *all* ``GROUP`` query heads that
    share one KV head (GQA), flattened into ``BLOCK_M * GROUP_PAD`` rows of one tile. Sharing the
    KV head means each K/V tile is loaded once for the whole group, and flattening the heads into
    rows keeps ``tl.dot``'s M dimension >= 16 even for decode (one token). It walks the sequence's
    KV positions in tiles of ``BLOCK_N`` keys with an online softmax, looking up the page of every
    key through the block table (so ``BLOCK_N`` need not match ``block_size``), and stops at the
    last position any of its queries may see (causal skipping).

``_paged_attention_kernel`` with ``SPLIT_KV`` + ``_merge_splits_kernel`` (flash-decoding)
    For decode-only batches with few ``(sequence, kv head)`` pairs (batch 1 has only
    ``num_kv_heads`` of them: far fewer programs than the GPU has SMs), the KV range of each
    sequence is also split ``num_splits`` ways across the grid's third axis; each split writes a
    normalised partial output and its log-sum-exp, and a second kernel merges them.

Matmul inputs: fp32 queries use ``input_precision="ieee"`` (Triton's default would round them to
tf32, far from the fp32 reference); bf16/fp16 feed the tensor cores directly and accumulate in
fp32. Triton's CPU interpreter computes bf16 ``tl.dot`` wrongly (it multiplies the raw bits), so
there, and only there, bf16 operands are widened to fp32 first (exact; see ``UPCAST_DOT``).

Nothing here reads device data on the host: grids and tile sizes come from shapes and
``meta.max_query_len`` (host ints), so the decode call can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from engine.attention.key_mean import MeanScores
from engine.attention.kv_format import PLAIN, SCALE_BYTES, KVFormat
from engine.attention.metadata import AttentionMetadata
from engine.attention.triton_dequant import KV_QUANT_CODES, load_kv
from engine.attention.triton_store import check_cache, row_offset, store_kvcache

__all__ = ["paged_attention", "paged_attention_impl", "store_kvcache"]  # the backend: store, then attend

_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------
# Paged attention
# --------------------------------------------------------------------------------------------


@triton.jit
def _dot_operand(x, IN_DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """``x`` as a tl.dot operand: rounded to the query dtype (the reference casts the cache to
    the query dtype), then widened to fp32 when ``UPCAST`` (exact, so results do not change)."""
    x = x.to(IN_DTYPE)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,  # SPLIT_KV: fp32 [num_seqs, num_heads, NUM_SPLITS, BLOCK_D]; else like q
    lse_ptr,  # SPLIT_KV: fp32 [num_seqs, num_heads, NUM_SPLITS]; else unused
    sinks_ptr,  # HAS_SINKS: fp32 [num_heads], each head's sink logit in base 2; else unused
    mean_q_ptr,  # MEAN_W: fp32 [num_tokens, num_heads, MEAN_W], centred keys' query terms (key_mean.py); else unused
    mean_table_ptr,  # MEAN_W: fp32 [mean_rows, MEAN_W], their key positions' rows; else unused
    mean_rows,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2 (exp2 is the native op)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,  # cache strides: block, position in block, kv head (head_dim is unit-stride)
    stride_cs,
    stride_ch,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of 2
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of 2 (>= 16 for tl.dot)
    PAGE_SIZE: tl.constexpr,  # KV-cache block_size
    BLOCK_M: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,  # keys per KV tile
    SPLIT_KV: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # feed tl.dot fp32 (interpreter only: its bf16 dot is broken)
    WINDOW: tl.constexpr,  # a sliding-window layer's window (each query sees its last WINDOW positions); 0: none
    HAS_SINKS: tl.constexpr,  # attention sinks (gpt-oss): added to the softmax's denominator here, or in the merge
    KV_QUANT: tl.constexpr,  # how the cache stores keys and values: see _load_kv
    KV_GROUP: tl.constexpr,  # values per scale in a quantized cache
    SCALE_OFF: tl.constexpr,  # where a quantized row's scales start, in bytes
    MEAN_W: tl.constexpr,  # the width of centred keys' terms; 0: the keys are stored whole
    MEAN_PAD: tl.constexpr,  # MEAN_W rounded up to a power of 2 (>= 16 for tl.dot)
):
    ROWS: tl.constexpr = BLOCK_M * GROUP_PAD
    IN_DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    if SPLIT_KV:
        q_block = 0
        split = tl.program_id(2)
    else:
        q_block = tl.program_id(2)
        split = 0
    if q_block * BLOCK_M >= q_len:  # this sequence has fewer query tokens than the grid allows
        return

    # Row r of the tile is query token q_block*BLOCK_M + r // GROUP_PAD, head g = r % GROUP_PAD of
    # this kv head's group. Rows past the sequence's tokens or the group's heads are padding.
    r = tl.arange(0, ROWS)
    q_idx = q_block * BLOCK_M + r // GROUP_PAD
    g = r % GROUP_PAD
    row_valid = (q_idx < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    token = (q_start + q_idx).to(tl.int64)
    pos = seq_len - q_len + q_idx  # KV position of each row's query; it sees keys 0..pos
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    q = _dot_operand(q, IN_DTYPE, UPCAST_DOT)
    if MEAN_W > 0:  # what centring took out of each score: q_terms . table[key position], rounded as q and k are
        w = tl.arange(0, MEAN_PAD)
        w_valid = w < MEAN_W
        # read again each tile (from L1) rather than held in registers for the loop, which spilled them
        q_terms_at = mean_q_ptr + (token * NUM_HEADS + head)[:, None] * MEAN_W + w[None, :]

    # KV range of this program: causal limit of its last query (never past seq_len; 0 for a
    # padding row), and for split-KV the split's share of it, rounded to whole tiles.
    # A sliding window starts it at the first key its first query sees, rounded down to a whole tile.
    kv_end = tl.minimum(seq_len, seq_len - q_len + (q_block + 1) * BLOCK_M)
    kv_lo = 0
    if WINDOW > 0:
        kv_lo = tl.maximum(seq_len - q_len + q_block * BLOCK_M - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    kv_start = kv_lo
    if SPLIT_KV:
        per_split = tl.cdiv(tl.cdiv(kv_end - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_start = kv_lo + split * per_split
        kv_end = tl.minimum(kv_end, kv_start + per_split)

    # Online softmax state. m starts finite so that fully masked rows give exp2(-inf - m) = 0
    # rather than NaN (-inf - -inf); such rows keep l == 0 and are written as zeros.
    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch

    for n0 in range(kv_start, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_valid = n < kv_end
        # Gather: each key's page comes from the block table (int64 before scaling by the
        # block stride: the cache can exceed 2**31 elements).
        page = tl.load(table + n // PAGE_SIZE, mask=n_valid, other=0)
        kv_off = row_offset(page, stride_cb) + (n % PAGE_SIZE) * stride_cs + head_off
        kv_mask = n_valid[:, None] & d_valid[None, :]
        # fmt: off
        k = load_kv(k_cache_ptr, kv_off, n_valid, d, kv_mask, IN_DTYPE, KV_QUANT, KV_GROUP, SCALE_OFF, HEAD_DIM, BLOCK_N, BLOCK_D)  # noqa: E501
        v = load_kv(v_cache_ptr, kv_off, n_valid, d, kv_mask, IN_DTYPE, KV_QUANT, KV_GROUP, SCALE_OFF, HEAD_DIM, BLOCK_N, BLOCK_D)  # noqa: E501
        # fmt: on
        # The reference casts the cache to the query dtype before attending; so do we.
        k = _dot_operand(k, IN_DTYPE, UPCAST_DOT)
        v = _dot_operand(v, IN_DTYPE, UPCAST_DOT)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if MEAN_W > 0:  # a layer without rotary has one row for every position
            at = mean_table_ptr + tl.minimum(n, mean_rows - 1)[:, None] * MEAN_W + w[None, :]
            q_terms = tl.load(q_terms_at, mask=row_valid[:, None] & w_valid[None, :], other=0.0)
            q_terms = _dot_operand(q_terms, IN_DTYPE, UPCAST_DOT)
            key_terms = _dot_operand(
                tl.load(at, mask=n_valid[:, None] & w_valid[None, :], other=0.0), IN_DTYPE, UPCAST_DOT
            )
            s += tl.dot(q_terms, tl.trans(key_terms), input_precision=DOT_PRECISION) * qk_scale
        seen = (n[None, :] <= pos[:, None]) & n_valid[None, :]
        if WINDOW > 0:
            seen = seen & (n[None, :] > pos[:, None] - WINDOW)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # P enters the second matmul in the input dtype (usual flash-attention practice).
        p = _dot_operand(p, IN_DTYPE, UPCAST_DOT)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    if HAS_SINKS and not SPLIT_KV:  # the sink joins the denominator (a split's partial leaves it to the merge)
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0)
        m_all = tl.maximum(m_i, sink)
        keep = tl.exp2(m_i - m_all)
        acc = acc * keep[:, None]
        l_i = l_i * keep + tl.exp2(sink - m_all)
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if SPLIT_KV:
        # Partial result for the merge kernel: normalised output and base-2 log-sum-exp
        # (-inf for a split that saw no keys, so it gets zero weight).
        part = (seq.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + split
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + part, lse, mask=row_valid)
        tl.store(out_ptr + part[:, None] * BLOCK_D + d[None, :], out, mask=row_valid[:, None])
    else:
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_valid[None, :],
        )


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,  # fp32 [num_seqs, num_heads, NUM_SPLITS, BLOCK_D]
    part_lse_ptr,  # fp32 [num_seqs, num_heads, NUM_SPLITS]
    out_ptr,
    sinks_ptr,  # HAS_SINKS: fp32 [num_heads] in base 2; else unused
    query_start_loc_ptr,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == q_start:  # no query token: nothing was computed
        return
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    base = (seq.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + sp, mask=sp < NUM_SPLITS, other=float("-inf"))
    o = tl.load(part_out_ptr + (base + sp)[:, None] * BLOCK_D + d[None, :], mask=(sp < NUM_SPLITS)[:, None], other=0.0)
    # Floor the max so an all-empty row (seq_len 0) gives weights exp2(-inf) = 0, not NaN.
    m = tl.maximum(tl.max(lse, 0), -1.0e30)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head)
        m = tl.maximum(m, sink)
    w = tl.exp2(lse - m)
    total = tl.sum(w, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - m)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def _interpreting() -> bool:
    """Whether kernels run in Triton's CPU interpreter (TRITON_INTERPRET, as Triton parses it)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # interpreter / CPU: parallelism buys nothing, so never split by default


def _default_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """How many ways to split each decode sequence's KV range. Depends on shapes and the device
    only (never on sequence lengths, which change between replays of a captured CUDA graph):
    enough programs to cover the SMs about twice. The split length adapts to each sequence's
    length inside the kernel, so short sequences just leave trailing splits empty.

    Measured on an H200 (CUDA-graph replay, bf16, 8 kv heads, head_dim 128): batch 1 with 2000
    tokens 48 us unsplit -> 8 us with 16-64 splits; batch 1 with 32000 tokens 73.7 us with 16
    splits -> 40 us with 64; batch 64 (512 programs) is fastest unsplit, at about 4.2 TB/s."""
    programs = num_seqs * num_kv_heads
    target = 2 * _num_sms(device)
    if programs >= target:
        return 1
    return min(64, triton.next_power_of_2(triton.cdiv(target, programs)))


def _mean_inputs(mean_scores: MeanScores) -> tuple[torch.Tensor, torch.Tensor]:
    return mean_scores.query_terms.float().contiguous(), mean_scores.table.float().contiguous()


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] attention-sink logits (gpt-oss)
    kv_format: KVFormat = PLAIN,  # how the cache stores keys and values (kv_format.py)
    mean_scores: MeanScores | None = None,  # what centred keys took out of the scores (key_mean.py)
) -> torch.Tensor:
    return paged_attention_impl(
        query, k_cache, v_cache, meta, scale, window=window, sinks=sinks, kv_format=kv_format, mean_scores=mean_scores
    )


def paged_attention_impl(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
    block_rows: int | None = None,
    block_n: int | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    kv_format: KVFormat = PLAIN,
    mean_scores: MeanScores | None = None,
) -> torch.Tensor:
    """``paged_attention`` with its tuning knobs exposed (for tests and benchmarks).

    num_splits: KV splits for decode-only batches (None: by SM count; 1: no split).
    block_rows: query rows (tokens x group heads) per program; block_n: keys per KV tile.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_cache(k_cache, v_cache, num_kv_heads, kv_format.row_width(head_dim))
    if num_heads % num_kv_heads:
        raise ValueError(f"paged_attention: {num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    num_seqs = meta.num_seqs
    # Tokens no sequence owns (possible in padded batches) stay zero like the reference's; when
    # every token is owned the kernels write each output row, so skip the memset.
    out = torch.empty_like(query) if sum(meta.query_lens_cpu) == num_tokens else torch.zeros_like(query)
    if num_tokens == 0 or num_seqs == 0 or meta.max_query_len == 0:
        return out.zero_()
    if query.stride(-1) != 1:
        query = query.contiguous()
    block_tables = meta.block_tables
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    is_fp32 = query.dtype == torch.float32
    # fp32 tl.dot would round its inputs to tf32 by default; the reference is exact fp32.
    precision = "ieee" if is_fp32 else "tf32"
    decode = meta.max_query_len == 1

    # A program's tile has BLOCK_M query tokens x GROUP_PAD head rows, at least 16 rows in all
    # (tl.dot's minimum M). Prefill wants tall tiles (each K/V tile is reused by more rows), but
    # on an H200 (bf16, head_dim 128, 4096-token causal prefill) 64 rows x 64 keys beat 128 rows
    # (278 vs 248 TFLOP/s). Decode has one token per sequence, so its tile is the group's heads
    # alone, padded with masked head rows (g >= GROUP) up to 16.
    if decode:
        block_m, group_rows = 1, max(16, group_pad)
    else:
        if block_rows is None:
            block_rows = min(64, triton.next_power_of_2(meta.max_query_len) * group_pad)
        block_rows = triton.next_power_of_2(max(block_rows, group_pad, 16))
        block_m, group_rows = block_rows // group_pad, group_pad
    rows = block_m * group_rows
    if block_n is None:  # a quantized cache's tiles take more registers to dequantize: half as many keys
        block_n = 32 if (is_fp32 or block_d > 128 or kv_format.quantized) else 64
    # Dequantizing a tile spilled registers to local memory at 4 warps (tests/test_kernels_compile_for_gpu.py)
    num_warps = 8 if rows * block_d >= 128 * 128 or kv_format.quantized else 4

    if decode and num_splits is None:
        num_splits = _default_num_splits(num_seqs, num_kv_heads, query.device)
    split = decode and num_splits is not None and num_splits > 1

    common = dict(
        NUM_HEADS=num_heads,
        GROUP=group,
        GROUP_PAD=group_rows,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=precision,
        UPCAST_DOT=_interpreting() and query.dtype == torch.bfloat16,
        WINDOW=window or 0,
        HAS_SINKS=sinks is not None,
        KV_QUANT=KV_QUANT_CODES[kv_format.name],
        KV_GROUP=kv_format.group(head_dim),
        SCALE_OFF=kv_format.row_width(head_dim) - SCALE_BYTES * (head_dim // kv_format.group(head_dim)),
        MEAN_W=0 if mean_scores is None else mean_scores.table.shape[1],
        MEAN_PAD=16 if mean_scores is None else max(16, triton.next_power_of_2(mean_scores.table.shape[1])),
        num_warps=num_warps,
        num_stages=2,
    )
    args = (
        meta.query_start_loc,
        meta.seq_lens,
        block_tables,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
    )
    # The kernels' softmax runs in base 2: so do the sinks
    sinks2 = out if sinks is None else sinks.float() * _LOG2E
    mean = (out, out, 1) if mean_scores is None else (*_mean_inputs(mean_scores), mean_scores.table.shape[0])
    if not split:
        grid = (num_seqs, num_kv_heads, triton.cdiv(meta.max_query_len, block_m))
        _paged_attention_kernel[grid](
            query, k_cache, v_cache, out, out, sinks2, *mean, *args, SPLIT_KV=False, NUM_SPLITS=1, **common
        )
        return out

    part_out = torch.empty((num_seqs, num_heads, num_splits, block_d), dtype=torch.float32, device=query.device)
    part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    _paged_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        part_out,
        part_lse,
        sinks2,
        *mean,
        *args,
        SPLIT_KV=True,
        NUM_SPLITS=num_splits,
        **common,
    )
    _merge_splits_kernel[(num_seqs, num_heads)](
        part_out,
        part_lse,
        out,
        sinks2,
        meta.query_start_loc,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        HAS_SINKS=sinks is not None,
        num_warps=4,
    )
    return out
