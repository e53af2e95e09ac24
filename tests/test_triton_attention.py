"""Triton attention kernels against the PyTorch reference, on CPU via Triton's interpreter.

The interpreter is slow (every tile op is a numpy call), so shapes are small; what matters is
that they cover the awkward cases: shuffled and holey block tables, padded slots, prefix hits,
chunked prefill, decode (with and without split-KV), mixed batches, padding rows, GQA groups,
odd head dims and block sizes, and fp32 / bf16 / fp16.
"""

import os

# Must be set before triton is imported anywhere, or kernels would try to compile for a GPU.
os.environ["TRITON_INTERPRET"] = "1"

import pytest

triton = pytest.importorskip("triton")
import torch  # noqa: E402
import triton.language as tl  # noqa: E402

from engine.attention import torch_backend as ref  # noqa: E402
from engine.attention import triton_kernels as tk  # noqa: E402
from tests.attention_batches import make_batch  # noqa: E402


def check_attention(query, k_cache, v_cache, meta, *, atol, rtol, **knobs):
    scale = query.shape[-1] ** -0.5
    expected = ref.paged_attention(query, k_cache, v_cache, meta, scale, knobs.get("window"), knobs.get("sinks"))
    got = tk.paged_attention_impl(query, k_cache, v_cache, meta, scale, **knobs)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)
    return got


FP32_TOL = dict(atol=1e-5, rtol=1e-4)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


# (q_lens, seq_lens, kwargs): each case names what it covers.
CASES = {
    "prefill_no_prefix": ([7, 20], [7, 20], dict(group=1, head_dim=64)),
    "prefix_hits_and_chunks": ([5, 17, 3, 9], [37, 17, 3, 41], dict(group=2, head_dim=128)),
    "mixed_decode_prefill_padding": (
        [1, 6, 1, 1, 12],
        [29, 6, 0, 45, 30],
        dict(group=4, head_dim=64, extra_tokens=2),
    ),
    "block_size_8_group_3_dim_48": ([4, 1, 13], [20, 9, 13], dict(group=3, head_dim=48, block_size=8)),
    "block_size_32_dim_96": ([3, 11], [70, 11], dict(group=2, head_dim=96, block_size=32)),
    "block_size_256_dim_16": ([2, 5], [40, 5], dict(group=1, head_dim=16, block_size=256, num_kv_heads=3)),
    "dim_32_group_8": ([6, 1], [25, 14], dict(group=8, head_dim=32, num_kv_heads=1)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_paged_attention_fp32(name):
    q_lens, seq_lens, kw = CASES[name]
    check_attention(*make_batch(q_lens, seq_lens, seed=list(CASES).index(name), **kw), **FP32_TOL)


def test_paged_attention_small_tiles_many_programs():
    # Force several query blocks per sequence and several KV tiles per program, so the causal
    # tile skipping and the per-block causal limit are exercised with BLOCK_M < query_len.
    batch = make_batch([19, 9], [40, 9], group=2, head_dim=32, block_size=8, seed=3)
    check_attention(*batch, block_rows=16, block_n=16, **FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_attention_half(dtype):
    batch = make_batch([1, 9, 4], [33, 9, 21], group=2, head_dim=64, dtype=dtype, seed=5)
    check_attention(*batch, **BF16_TOL)


def test_paged_attention_fp32_query_bf16_cache():
    # The reference casts cache rows to the query dtype before attending.
    batch = make_batch([3, 1], [19, 26], group=2, head_dim=64, cache_dtype=torch.bfloat16, seed=6)
    check_attention(*batch, **FP32_TOL)


@pytest.mark.parametrize("num_splits", [1, 3, 16])
@pytest.mark.parametrize(
    "group,head_dim,dtype",
    [(1, 64, torch.float32), (4, 128, torch.float32), (2, 64, torch.bfloat16)],
)
def test_decode(num_splits, group, head_dim, dtype):
    # seq_len 0 rows are CUDA-graph padding; seq_len 1 leaves all splits but one empty, and 16
    # splits outnumber the tiles of every sequence here (empty splits must get zero weight).
    seq_lens = [1, 70, 0, 33, 5]
    batch = make_batch([1] * len(seq_lens), seq_lens, group=group, head_dim=head_dim, dtype=dtype, seed=group)
    out = check_attention(*batch, num_splits=num_splits, **(FP32_TOL if dtype == torch.float32 else BF16_TOL))
    assert (out[2] == 0).all()


@pytest.mark.parametrize("window", [1, 7, 24])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_sliding_window(window, num_splits):
    """Prefills (fresh, after a prefix hit, a later chunk) and decodes, with the window starting inside, at and
    before a KV tile; decode split across programs as well."""
    batch = make_batch([19, 1, 5, 1, 9], [19, 70, 37, 5, 41], group=2, head_dim=32, block_size=8, seed=window)
    check_attention(*batch, block_rows=16, block_n=16, window=window, **FP32_TOL)
    decode = make_batch([1, 1, 1], [70, 3, 33], group=2, head_dim=32, block_size=8, seed=window + 1)
    check_attention(*decode, block_n=16, num_splits=num_splits, window=window, **FP32_TOL)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("window", [None, 7])
def test_attention_sinks(num_splits, window):
    """gpt-oss's sinks join each head's softmax denominator: in the kernel, or in the merge of a split decode.
    Sinks large enough to take most of the weight (a head attending to almost nothing), and padding rows."""
    sinks = torch.tensor([4.0, -1.0, 0.5, 9.0])
    batch = make_batch([1, 6, 1, 1, 12], [29, 6, 0, 45, 30], group=2, num_kv_heads=2, head_dim=32, seed=31)
    check_attention(*batch, block_rows=16, block_n=16, window=window, sinks=sinks, **FP32_TOL)
    decode = make_batch([1, 1, 1], [70, 0, 33], group=2, num_kv_heads=2, head_dim=32, block_size=8, seed=32)
    check_attention(*decode, block_n=16, num_splits=num_splits, window=window, sinks=sinks, **FP32_TOL)


def test_decode_default_path():
    batch = make_batch([1, 1, 1], [17, 0, 40], group=2, head_dim=64, seed=9)
    scale = 0.125
    expected = ref.paged_attention(*batch, scale)
    torch.testing.assert_close(tk.paged_attention(*batch, scale), expected, **FP32_TOL)


def test_all_padding_rows_are_zero():
    query, k_cache, v_cache, meta = make_batch([1, 1], [0, 0], seed=10)
    out = tk.paged_attention(query, k_cache, v_cache, meta, 0.125)
    assert (out == 0).all()
    out = tk.paged_attention_impl(query, k_cache, v_cache, meta, 0.125, num_splits=4)
    assert (out == 0).all()


@pytest.mark.parametrize(
    "kv_dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
)
def test_store_kvcache(kv_dtype, cache_dtype):
    torch.manual_seed(11)
    num_tokens, num_kv_heads, head_dim, num_blocks, block_size = 13, 3, 48, 6, 4
    # Key and value as strided slices of one fused projection, like a real qkv split.
    kv = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_dim).to(kv_dtype)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads : 2 * num_kv_heads]
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[0, 5, 12]] = -1  # padded tokens: must write nothing
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape).to(cache_dtype), torch.randn(shape).to(cache_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_before, v_before = k_cache.clone(), v_cache.clone()

    ref.store_kvcache(key, value, k_ref, v_ref, slots)
    tk.store_kvcache(key, value, k_cache, v_cache, slots)
    if kv_dtype == cache_dtype:
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    else:
        # The interpreter truncates fp32 -> bf16 where torch (and a GPU) round to nearest even.
        torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=2**-7)
        torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=2**-7)
    # Slots nobody wrote (including those the -1 tokens would have hit) are untouched.
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert torch.equal(k_cache.flatten(0, 1)[~written], k_before.flatten(0, 1)[~written])
    assert torch.equal(v_cache.flatten(0, 1)[~written], v_before.flatten(0, 1)[~written])


def test_store_then_attend_roundtrip():
    # Write the new tokens' K/V with the Triton kernel, then attend: same as doing both in torch.
    query, k_cache, v_cache, meta = make_batch([4, 1, 1], [10, 23, 0], group=2, head_dim=32, block_size=8, seed=12)
    new_k = torch.randn(query.shape[0], k_cache.shape[2], k_cache.shape[3])
    new_v = torch.randn_like(new_k)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref.store_kvcache(new_k, new_v, k_ref, v_ref, meta.slot_mapping)
    tk.store_kvcache(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    check_attention(query, k_cache, v_cache, meta, **FP32_TOL)


@triton.jit
def _row_offset_probe(rows_ptr, out_ptr, row_stride, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, tk.row_offset(tl.load(rows_ptr + i), row_stride))


@pytest.mark.parametrize("row_dtype", [torch.int32, torch.int64])
def test_row_offset_is_int64(row_dtype):
    # slot * row_stride past 2**31 must not wrap. (A real > 2**31-element cache is too big for
    # a unit test; both kernels compute every cache offset through this helper or the same cast.)
    rows = torch.tensor([0, 1, 2**21 + 7, 2**31 - 1], dtype=row_dtype)
    out = torch.empty(4, dtype=torch.int64)
    _row_offset_probe[(1,)](rows, out, 1024, N=4)
    assert out.tolist() == [r * 1024 for r in rows.tolist()]


def test_kernels_refuse_a_cache_they_cannot_index():
    query, k_cache, v_cache, meta = make_batch([3], [3], head_dim=32, seed=1)
    with pytest.raises(ValueError, match="contiguous"):
        tk.paged_attention(query, k_cache.transpose(1, 2), v_cache.transpose(1, 2), meta, 1.0)
    with pytest.raises(ValueError, match="must be equal"):
        tk.store_kvcache(query[:, :2], query[:, :2], k_cache, v_cache[..., :16].contiguous(), meta.slot_mapping)
    with pytest.raises(ValueError, match="same 3 tokens"):
        key = query[:, :2].contiguous()
        tk.store_kvcache(key, key[:2], k_cache, v_cache, meta.slot_mapping)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "int4"])
@pytest.mark.parametrize(
    "case,dtype",
    [("prefix_hits_and_chunks", torch.float32), ("block_size_8_group_3_dim_48", torch.float32), ("decode", None)],
)
def test_a_quantized_cache_is_read_as_the_reference_reads_it(kv_cache_dtype, case, dtype):
    """The kernel dequantizes the cache's rows in registers (`_load_kv`): the torch reference's output over the same
    bytes. Decode in bf16 with split KV, prefills with prefix hits in fp32, and head_dim 48 (int4: groups of 16)."""
    from engine.attention.kv_format import kv_format

    fmt = kv_format(kv_cache_dtype)
    if case == "decode":
        q_lens, seq_lens, kw, dtype = [1] * 5, [1, 70, 0, 33, 5], dict(group=2, head_dim=64), torch.bfloat16
    else:
        q_lens, seq_lens, kw = CASES[case]
    query, k_plain, v_plain, meta = make_batch(q_lens, seq_lens, dtype=dtype, seed=5, **kw)
    head_dim = query.shape[-1]
    k_cache, v_cache = (fmt.pack(c.flatten(0, 1)).view(*c.shape[:3], -1) for c in (k_plain, v_plain))
    scale = head_dim**-0.5
    expected = ref.paged_attention(query, k_cache, v_cache, meta, scale, kv_format=fmt)
    for splits in (1, 4) if case == "decode" else (None,):
        got = tk.paged_attention_impl(query, k_cache, v_cache, meta, scale, num_splits=splits, kv_format=fmt)
        tolerance = FP32_TOL if dtype == torch.float32 else BF16_TOL
        torch.testing.assert_close(got.float(), expected.float(), **tolerance)


def test_the_store_kernel_writes_a_quantized_caches_rows():
    from engine.attention.kv_format import kv_format

    fmt = kv_format("int4")
    keys, values = torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    k_cache = torch.zeros(3, 16, 2, fmt.row_width(64), dtype=torch.uint8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([0, 17, -1, 33, 47])
    tk.store_kvcache(fmt.pack(keys), fmt.pack(values), k_cache, v_cache, slots)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    ref.store_kvcache(fmt.pack(keys), fmt.pack(values), want_k, want_v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


CENTRED_CASES = {  # (q_lens, seq_lens, window)
    "mixed_decode_prefill_padding": ([1, 6, 1, 1, 12], [29, 6, 0, 45, 30], None),
    "decode_split": ([1] * 4, [70, 0, 33, 5], None),
    "window": ([1, 1, 9], [70, 5, 60], 24),
}


@pytest.mark.parametrize("rotary", ["full", "partial", "none"])
@pytest.mark.parametrize("case", list(CENTRED_CASES))
def test_centred_keys_scores_are_added_as_the_reference_adds_them(rotary, case):
    """A cache that centres keys (engine/attention/key_mean.py): the kernel adds each score's share of the mean in
    float32 with one more tl.dot a tile, as the torch reference adds it; rotary over the whole head, a quarter of it
    (a column of ones for the rest), or none (one row for every position)."""
    from engine.attention.key_mean import KeyMean
    from engine.attention.kv_format import kv_format
    from engine.layers.rotary_embedding import RotaryEmbedding

    fmt, (q_lens, seq_lens, window) = kv_format("int4"), CENTRED_CASES[case]
    query, k_plain, v_plain, meta = make_batch(q_lens, seq_lens, seed=11, group=3, head_dim=64)
    params = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25 if rotary == "partial" else 1.0}
    mean = KeyMean(k_plain.shape[2], 64, None if rotary == "none" else RotaryEmbedding(64, 128, params), query.device)
    mean.set_mean(torch.randn(mean.mean.shape, generator=torch.Generator().manual_seed(1)) * 2)
    k_cache, v_cache = (fmt.pack(c.flatten(0, 1)).view(*c.shape[:3], -1) for c in (k_plain, v_plain))
    scores = mean.scores(query)
    expected = ref.paged_attention(query, k_cache, v_cache, meta, 0.125, window, kv_format=fmt, mean_scores=scores)
    plain = ref.paged_attention(query, k_cache, v_cache, meta, 0.125, window, kv_format=fmt)
    for splits in (1, 4) if case == "decode_split" else (None,):
        got = tk.paged_attention_impl(
            query, k_cache, v_cache, meta, 0.125, num_splits=splits, window=window, kv_format=fmt, mean_scores=scores
        )
        torch.testing.assert_close(got, expected, **FP32_TOL)
    assert (rotary == "none") == torch.allclose(plain, expected, **FP32_TOL)
