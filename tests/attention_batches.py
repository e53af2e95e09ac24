"""Random attention batches for comparing a backend with the torch reference."""

import torch

from engine.attention.metadata import AttentionMetadata


def make_batch(
    q_lens,
    seq_lens,
    *,
    num_kv_heads=2,
    group=2,
    head_dim=64,
    block_size=16,
    dtype=torch.float32,
    cache_dtype=None,
    extra_tokens=0,
    seed=0,
):
    """Random query, a randomly filled cache and metadata for the given per-sequence lengths.

    Blocks are drawn from a shuffled pool with spare blocks (so tables have holes and are not
    contiguous), each table has unused -1 entries past its end, and every cache slot holds random
    data, so reading a wrong slot cannot go unnoticed. A sequence with seq_len 0 is a padding row.
    ``extra_tokens`` appends query tokens no sequence owns (their output must be zeros).
    """
    g = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    num_heads = num_kv_heads * group
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5
    pool = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(blocks_per_seq + [0]) + 2
    block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    for i, nb in enumerate(blocks_per_seq):
        block_tables[i, :nb] = torch.tensor([pool.pop() for _ in range(nb)], dtype=torch.int32)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(cache_dtype)
    v_cache = torch.randn(shape, generator=g).to(cache_dtype)
    num_tokens = sum(q_lens) + extra_tokens
    query = torch.randn((num_tokens, num_heads, head_dim), generator=g).to(dtype)

    slots = []
    for i, (q, s) in enumerate(zip(q_lens, seq_lens)):
        for p in range(s - q, s):
            slots.append(-1 if s == 0 else int(block_tables[i, p // block_size]) * block_size + p % block_size)
    slots += [-1] * extra_tokens
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(q_lens),
        seq_lens_cpu=list(seq_lens),
    )
    return query, k_cache, v_cache, meta
