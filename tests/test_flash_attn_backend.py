"""The flash-attn backend on the CPU: when it is chosen, and what it passes to flash-attn.

flash-attn's kernels run only on CUDA (tests/gpu runs them when the package is installed). Here a
stand-in `flash_attn` module computes what flash-attn's documentation specifies for the two
functions the backend calls: K/V read through `block_table` pages, GQA, and a causal mask
aligned to the end of each sequence. Against it, the backend's arguments (shapes, cumulative
key lengths, the scale) must reproduce the torch reference backend.
"""

import os
import sys
import types

# The backend imports the Triton kernels: in CPU tests, triton must come up in interpreter mode, or
# later test files that run kernels through the interpreter would find it compiled for a GPU.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")  # the backend writes K/V with the Triton kernel

from engine import attention  # noqa: E402
from engine.attention import select_backend  # noqa: E402
from engine.attention import torch_backend as ref  # noqa: E402
from tests.attention_batches import make_batch  # noqa: E402


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window_size=(-1, -1)) -> torch.Tensor:
    """Causal attention of q [Lq, H, D] over k, v [Lk, Hk, D], queries being the last Lq positions; flash-attn's
    window_size (left, right), left >= 0, lets a query see only the `left` keys before it."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    q_pos = torch.arange(q.shape[0])[:, None] + k.shape[0] - q.shape[0]
    kv_pos = torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill(kv_pos > q_pos, float("-inf"))
    if window_size[0] >= 0:
        scores = scores.masked_fill(kv_pos < q_pos - window_size[0], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)


def pages(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of one sequence, read through its block-table row."""
    block_size = cache.shape[1]
    used = table_row[: -(-length // block_size)].long()
    return cache[used].reshape(-1, *cache.shape[2:])[:length]


def fake_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    block_table=None,
    **unused,
):
    if not causal or block_table is None or unused:
        raise AssertionError(f"the backend should call the causal paged kernel, got causal={causal}, {sorted(unused)}")
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32 or block_table.dtype != torch.int32:
        raise AssertionError("flash-attn takes int32 cumulative lengths and block tables")
    out = torch.zeros_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        start, end = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        length = int(cu_seqlens_k[i + 1] - cu_seqlens_k[i])
        if end - start > max_seqlen_q or length > max_seqlen_k:
            raise AssertionError("max_seqlen_q / max_seqlen_k below a sequence's length")
        out[start:end] = attend(
            q[start:end], pages(k, block_table[i], length), pages(v, block_table[i], length), softmax_scale, window_size
        )
    return out


def fake_with_kvcache(
    q,
    k_cache,
    v_cache,
    cache_seqlens=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    **unused,
):
    if not causal or block_table is None or q.dim() != 4 or unused:
        raise AssertionError("the backend should pass q as [batch, 1, heads, dim] to the causal paged kernel")
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        length = int(cache_seqlens[b])
        out[b] = attend(
            q[b],
            pages(k_cache, block_table[b], length),
            pages(v_cache, block_table[b], length),
            softmax_scale,
            window_size,
        )
    return out


@pytest.fixture
def fake_flash_attn(monkeypatch):
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func, module.flash_attn_with_kvcache = fake_varlen, fake_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    monkeypatch.delitem(sys.modules, "engine.attention.flash_attn_backend", raising=False)
    attention.importable.cache_clear()
    yield
    attention.importable.cache_clear()


CASES = {
    "prefill": ([300, 40], [300, 40]),
    "prefix hit and chunked prefill": ([37, 5], [600, 261]),
    "mixed prefill and decode": ([1, 90, 1], [513, 90, 257]),
}


@pytest.mark.parametrize("name", CASES)
def test_prefill_calls_match_the_reference(fake_flash_attn, name):
    from engine.attention import flash_attn_backend

    q_lens, seq_lens = CASES[name]
    query, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, group=4, head_dim=32, block_size=256, seed=len(name))
    scale = 32**-0.5
    expected = ref.paged_attention(query, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(flash_attn_backend.paged_attention(query, k_cache, v_cache, meta, scale), expected)
    assert "cu_seqlens_k" in meta.backend_cache  # computed once per step, for every layer
    windowed = ref.paged_attention(query, k_cache, v_cache, meta, scale, 100)
    torch.testing.assert_close(flash_attn_backend.paged_attention(query, k_cache, v_cache, meta, scale, 100), windowed)


def test_decode_calls_match_the_reference(fake_flash_attn):
    from engine.attention import flash_attn_backend

    query, k_cache, v_cache, meta = make_batch([1, 1, 1], [1, 256, 700], group=2, head_dim=32, block_size=256, seed=9)
    scale = 0.1
    expected = ref.paged_attention(query, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(flash_attn_backend.paged_attention(query, k_cache, v_cache, meta, scale), expected)
    windowed = ref.paged_attention(query, k_cache, v_cache, meta, scale, 300)
    torch.testing.assert_close(flash_attn_backend.paged_attention(query, k_cache, v_cache, meta, scale, 300), windowed)


def test_auto_takes_flash_attn_only_where_its_kernels_apply(fake_flash_attn):
    cuda = torch.device("cuda")
    assert select_backend("auto", cuda, torch.bfloat16, 256).name == "flash-attn"
    assert select_backend("auto", cuda, torch.float16, 512).name == "flash-attn"
    assert select_backend("auto", cuda, torch.bfloat16, 16).name == "triton"  # the default block size
    assert select_backend("auto", cuda, torch.float32, 256).name == "triton"
    assert select_backend("auto", torch.device("cpu"), torch.bfloat16, 256).name == "torch"


@pytest.mark.parametrize(
    "device,dtype,block_size,fragment",
    [
        ("cuda", torch.bfloat16, 16, "multiple of 256, and it is 16"),
        ("cuda", torch.float32, 256, "not float32"),
        ("cpu", torch.bfloat16, 256, "runs on CUDA"),
    ],
)
def test_forcing_flash_attn_where_it_cannot_run_says_why(fake_flash_attn, device, dtype, block_size, fragment):
    with pytest.raises(ValueError, match=fragment):
        select_backend("flash-attn", torch.device(device), dtype, block_size)


def test_without_the_package_auto_keeps_triton_and_forcing_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes `import flash_attn` fail
    attention.importable.cache_clear()
    try:
        assert select_backend("auto", torch.device("cuda"), torch.bfloat16, 256).name == "triton"
        with pytest.raises(ValueError, match="pip install flash-attn"):
            select_backend("flash-attn", torch.device("cuda"), torch.bfloat16, 256)
    finally:
        attention.importable.cache_clear()
