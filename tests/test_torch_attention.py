"""The torch reference backend against attention written out one sequence at a time.

Mixed batches with many decode rows of very different lengths, so the rows are regrouped by
length; prefills with and without a cached prefix; padding rows; holey, shuffled block tables.
"""

import math

import pytest
import torch

from engine.attention import torch_backend
from engine.attention.metadata import AttentionMetadata

BLOCK = 16


def naive(query, k_cache, v_cache, q_lens, seq_lens, tables, scale, window=None):
    """softmax(q k^T) v per sequence, reading the cache one token at a time through its block table. With a
    sliding `window`, query position p sees positions p - window + 1 .. p."""
    out = torch.zeros_like(query)
    group = query.shape[1] // k_cache.shape[2]
    start = 0
    for q_len, kv_len, table in zip(q_lens, seq_lens, tables):
        if kv_len:
            slots = [(table[p // BLOCK], p % BLOCK) for p in range(kv_len)]
            k = torch.stack([k_cache[b, o] for b, o in slots]).repeat_interleave(group, 1)  # [kv, H, D]
            v = torch.stack([v_cache[b, o] for b, o in slots]).repeat_interleave(group, 1)
            for j in range(q_len):
                visible = kv_len - q_len + j + 1
                first = 0 if window is None else max(0, visible - window)
                scores = torch.einsum("hd,khd->hk", query[start + j], k[first:visible]) * scale
                out[start + j] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[first:visible])
        start += q_len
    return out


def batch(q_lens, seq_lens, num_kv_heads=3, group=3, head_dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(s / BLOCK) for s in seq_lens]
    num_blocks = sum(need) + 7
    pool = torch.randperm(num_blocks, generator=g).tolist()
    width = max(need) + 2
    tables = [[pool.pop() for _ in range(n)] + [-1] * (width - n) for n in need]
    k_cache = torch.randn(num_blocks, BLOCK, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, BLOCK, num_kv_heads, head_dim, generator=g)
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=g)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    slots = [
        tables[i][p // BLOCK] * BLOCK + p % BLOCK if s else -1
        for i, (q, s) in enumerate(zip(q_lens, seq_lens))
        for p in range(s - q, s)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(q_lens),
        seq_lens_cpu=list(seq_lens),
    )
    return query, k_cache, v_cache, meta, tables


@pytest.mark.parametrize(
    "case", ["decode only", "decode and prefills", "few decode rows", "one decode row", "equal lengths"]
)
def test_matches_attention_written_out_per_sequence(case):
    rng = torch.Generator().manual_seed(1)
    rows = {"few decode rows": 3, "one decode row": 1, "equal lengths": 5}.get(case, 27)
    decode_lens = torch.randint(1, 300, (rows,), generator=rng).tolist()
    if case == "equal lengths":
        decode_lens = [decode_lens[0]] * rows
    q_lens, seq_lens = [1] * len(decode_lens), decode_lens
    if case != "decode only":
        # a fresh prompt, a prompt after a 48-token prefix hit, a padding row, a chunk continuing at 100
        q_lens = [40, *q_lens[:10], 23, 1, *q_lens[10:], 30]
        seq_lens = [40, *seq_lens[:10], 71, 0, *seq_lens[10:], 130]
    query, k_cache, v_cache, meta, tables = batch(q_lens, seq_lens)
    scale = query.shape[-1] ** -0.5
    got = torch_backend.paged_attention(query, k_cache, v_cache, meta, scale)
    want = naive(query, k_cache, v_cache, q_lens, seq_lens, tables, scale)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    decodes, _ = torch_backend._plan(meta, BLOCK, None)
    if rows > 8:
        assert len(decodes) > 1  # the long batch really was split into length groups
    if case in ("one decode row", "equal lengths"):
        assert decodes[0].live is None  # the one-length path was the one checked: no padding rows
        assert (decodes[0].mask is None) == (decode_lens[0] % BLOCK == 0)  # whole blocks, masked to the length


@pytest.mark.parametrize("threads", [1, 2])
def test_a_decode_row_attends_the_same_alone_and_in_any_batch(threads, monkeypatch):
    """Bit for bit: a row's output does not depend on the rows beside it or on how far past its length the batch
    reads (whole blocks, masked). Speculative decoding checks drafts as decode rows of one request at successive
    lengths, and relies on this to give the tokens plain decoding gives. With two threads this holds only with
    MKL's code paths fixed (MKL_CBWR, set where the engine is imported): SDPA's CPU kernel multiplies in per-thread
    buffers, and MKL chose its path by their alignment."""
    monkeypatch.setattr(torch_backend, "DECODE_GROUP_ROWS", 64)  # one call for the whole batch
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_rows_alone_and_together()
    finally:
        torch.set_num_threads(previous)


def check_rows_alone_and_together():
    rng = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 300, (6,), generator=rng).tolist()
    query, k_cache, v_cache, meta, tables = batch([1] * len(lens), lens)
    scale = query.shape[-1] ** -0.5
    together = torch_backend.paged_attention(query, k_cache, v_cache, meta, scale)
    for i, length in enumerate(lens):
        q, k, v, alone_meta, _ = batch([1], [length])
        q[0] = query[i]
        # the same blocks as row i read in the batch
        alone_meta.block_tables = meta.block_tables[i : i + 1, : -(-length // BLOCK)].clone()
        alone = torch_backend.paged_attention(q, k_cache, v_cache, alone_meta, scale)
        assert torch.equal(alone[0], together[i]), (i, length)


@pytest.mark.parametrize("window", [1, 5, 16, 37, 300])
def test_sliding_window_matches_attention_written_out_per_sequence(window):
    """Decode rows of many lengths (grouped, masked, and each reading only its window's blocks), a fresh
    prompt, a prompt after a prefix hit and a later chunk, each query seeing only its last `window` positions."""
    rng = torch.Generator().manual_seed(2)
    decode_lens = torch.randint(1, 200, (20,), generator=rng).tolist()
    q_lens = [40, *[1] * 10, 23, *[1] * 10, 30]
    seq_lens = [40, *decode_lens[:10], 71, *decode_lens[10:], 130]
    query, k_cache, v_cache, meta, tables = batch(q_lens, seq_lens, seed=window)
    scale = query.shape[-1] ** -0.5
    got = torch_backend.paged_attention(query, k_cache, v_cache, meta, scale, window)
    want = naive(query, k_cache, v_cache, q_lens, seq_lens, tables, scale, window)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    one = batch([1], [150], seed=3)  # batch 1: the window's blocks alone
    got = torch_backend.paged_attention(*one[:4], scale, window)
    torch.testing.assert_close(got, naive(*one[:3], [1], [150], one[4], scale, window), rtol=1e-4, atol=1e-5)
    compiled_path = torch_backend.compiled_decode(
        one[0], one[1], one[2], one[3].block_tables, one[3].seq_lens, scale, window
    )
    torch.testing.assert_close(compiled_path, got, rtol=1e-4, atol=1e-5)


def test_store_kvcache_writes_each_token_to_its_slot_and_skips_padding():
    key, value = torch.randn(5, 2, 4), torch.randn(5, 2, 4)
    k_cache, v_cache = torch.zeros(3, BLOCK, 2, 4), torch.zeros(3, BLOCK, 2, 4)
    slots = torch.tensor([17, -1, 3, 47, -1])
    torch_backend.store_kvcache(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, 2, 4), v_cache.view(-1, 2, 4)
    for token, slot in [(0, 17), (2, 3), (3, 47)]:
        assert torch.equal(flat_k[slot], key[token]) and torch.equal(flat_v[slot], value[token])
    assert int((flat_k.abs().sum((1, 2)) > 0).sum()) == 3  # the padded tokens wrote nothing
    # A new step's slot_mapping (a new tensor) is never served the previous step's cached plan.
    torch_backend.store_kvcache(key[:1], value[:1], k_cache, v_cache, torch.tensor([5]))
    assert torch.equal(flat_k[5], key[0])
