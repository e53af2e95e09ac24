"""Every Triton kernel, launched as the engine's wrappers launch it, compiled on this CPU-only machine for a
Hopper GPU (sm_90, the device machine's H200) and for the laptop GPUs Pagoda is for, RTX 30 (sm_86) and RTX 40
(sm_89): a kernel that Triton's compiler rejects, or that spills registers to local memory, fails here instead
of on the GPU.

The launches are recorded under the interpreter (tests/gpu_compile.py); the shapes are the 0.6B
model's where they select a variant (K of 1,024 and 3,072; head_dim 128, 16 heads over 8 KV heads)."""

import os

# Must be set before the kernels are imported: the launches below run in the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest

triton = pytest.importorskip("triton")
import torch  # noqa: E402

from engine.attention import triton_kernels  # noqa: E402
from engine.attention.key_mean import MeanScores  # noqa: E402
from engine.attention.kv_format import kv_format  # noqa: E402
from engine.layers.activation import silu_and_mul  # noqa: E402
from engine.layers.fused_moe_triton import fused_moe  # noqa: E402
from engine.layers.gated_deltanet_triton import CHUNK, DeltaRulePlan, delta_rule  # noqa: E402
from engine.layers.gemv import ROW_BUCKETS, gemv, tile_candidates  # noqa: E402
from engine.layers.normed_gemv import normed_gemv, normed_tile_candidates  # noqa: E402
from tests.attention_batches import make_batch  # noqa: E402
from tests.gpu_compile import TARGETS, compile_in_subprocess, record_launches  # noqa: E402

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
if not os.path.exists(CUOBJDUMP):
    pytest.skip("this Triton build has no NVIDIA backend tools", allow_module_level=True)


# What a block may use (the opt-in maximum): 99 KiB on RTX 30 and 40, 227 KiB on Hopper
SHARED_MEMORY_PER_BLOCK = {86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def bf16(*shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).bfloat16()


def launch_everything() -> None:
    """One launch of each variant the engine can select, on small N (N selects no variant)."""
    for k in (1024, 3072):  # whole chunks of every BLOCK_K
        for bucket in ROW_BUCKETS:
            for tile in tile_candidates(bucket):
                gemv(bf16(bucket, k), bf16(16, k), None, *tile)
    gemv(bf16(1, 1300), bf16(16, 1300), bf16(16), *tile_candidates(1)[0])  # a partial chunk, a bias
    for silu_mul in (False, True):
        for tile in normed_tile_candidates(silu_mul):
            normed_gemv(bf16(1, 1024), bf16(1, 1024), bf16(1024), 1e-6, bf16(16, 1024), None, *tile, silu_mul=silu_mul)
        normed_gemv(
            bf16(1, 1300),
            None,
            bf16(1300),
            1e-6,
            bf16(16, 1300),
            bf16(16),
            *normed_tile_candidates(silu_mul)[0],
            silu_mul=silu_mul,
        )  # the first layer (no residual), a partial chunk, a bias
    shape = dict(num_kv_heads=8, group=2, head_dim=128, dtype=torch.bfloat16)
    query, k_cache, v_cache, meta = make_batch([1, 1], [40, 17], **shape)
    triton_kernels.paged_attention_impl(query, k_cache, v_cache, meta, 0.1, num_splits=1)  # decode
    triton_kernels.paged_attention_impl(query, k_cache, v_cache, meta, 0.1, num_splits=16)  # split decode, merged
    sinks = torch.zeros(16)  # gpt-oss's: in the kernel, and in the merge
    triton_kernels.paged_attention_impl(query, k_cache, v_cache, meta, 0.1, num_splits=1, window=128, sinks=sinks)
    triton_kernels.paged_attention_impl(query, k_cache, v_cache, meta, 0.1, num_splits=16, sinks=sinks)
    query, k_cache, v_cache, meta = make_batch([5, 12], [40, 12], **shape)  # prefill, one with a cached prefix
    triton_kernels.paged_attention_impl(query, k_cache, v_cache, meta, 0.1)
    triton_kernels.paged_attention_impl(query, k_cache, v_cache, meta, 0.1, window=128, sinks=sinks)
    key, value = bf16(3, 8, 128), bf16(3, 8, 128)
    triton_kernels.store_kvcache(key, value, k_cache, v_cache, torch.tensor([0, -1, 37]))
    for name in ("int8", "fp8", "int4"):  # a quantized cache (kv_cache_dtype), in decode and prefill
        fmt = kv_format(name)
        for q_lens, seq_lens in (([1, 1], [40, 17]), ([5, 12], [40, 12])):
            query, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, **shape)
            k_rows, v_rows = (fmt.pack(c.flatten(0, 1)).view(*c.shape[:3], -1) for c in (k_cache, v_cache))
            triton_kernels.paged_attention_impl(query, k_rows, v_rows, meta, 0.1, num_splits=1, kv_format=fmt)
            if fmt.centres_keys:  # the mean's share of each score: one more float32 tl.dot a tile
                scores = MeanScores(torch.zeros(query.shape[0], 16, 128), torch.zeros(4096, 128))  # rotary on every dim
                triton_kernels.paged_attention_impl(
                    query, k_rows, v_rows, meta, 0.1, num_splits=16, kv_format=fmt, mean_scores=scores
                )
        triton_kernels.store_kvcache(fmt.pack(key), fmt.pack(value), k_rows, v_rows, torch.tensor([0, -1, 37]))
    experts, hidden, inter = 4, 256, 48  # the second matmul's K of 48 takes the narrow K tile
    for tokens, dtype in ((1, torch.bfloat16), (64, torch.bfloat16), (3, torch.float32)):  # decode, prefill, fp32
        ids = torch.arange(2 * tokens).view(tokens, 2) % experts
        gate_up, down = bf16(experts, 2 * inter, hidden).to(dtype), bf16(experts, hidden, inter).to(dtype)
        fused_moe(bf16(tokens, hidden).to(dtype), gate_up, down, torch.rand(tokens, 2), ids, silu_and_mul)
    # Qwen3.5's linear layers: 16 key heads and 32 value heads of 128, tiled as llama.cpp's GGUF files store them
    states = torch.zeros(4, 32, 128, 128)
    for chunked, tiled in ((False, False), (True, False), (True, True)):
        plan = DeltaRulePlan.build([1, 2], [0, 1], [False, True], [[(1, 2)], []], "cpu", CHUNK if chunked else None)
        qk = torch.nn.functional.normalize(torch.randn(3, 16, 128), dim=-1)
        delta_rule(
            qk,
            qk,
            torch.randn(3, 32, 128),
            -torch.rand(3, 32),
            torch.rand(3, 32),
            states,
            plan,
            chunked=chunked,
            tiled=tiled,
        )


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's masked exp2
def test_every_kernel_variant_compiles_for_sm86_sm89_and_sm90_without_spilling(tmp_path):
    specs = []
    with record_launches(specs):
        launch_everything()
    kernels = {s["kernel"] for s in specs}
    assert {
        "_gemv_kernel",
        "_normed_gemv_kernel",
        "_paged_attention_kernel",
        "_merge_splits_kernel",
        "_store_kvcache_kernel",
        "_grouped_matmul_kernel",
        "_recurrent_kernel",
        "_chunk_prepare_kernel",
        "_chunk_state_kernel",
    } <= kernels
    results = compile_in_subprocess([s | {"target": t} for t in TARGETS.values() for s in specs], tmp_path)
    assert {r["target"] for r in results} == {arch for _, arch, _ in TARGETS.values()}
    failed = [f"{r['kernel']} {r['target']} {r['constexprs']}: {r['error']}" for r in results if r["error"]]
    assert not failed, "\n".join(failed)
    spilled = [
        f"{r['kernel']} {r['target']} {r['constexprs']}: {r['local_bytes']} bytes"
        for r in results
        if r.get("local_bytes")
    ]
    assert not spilled, "register spills to local memory:\n" + "\n".join(spilled)
    assert all("registers" in r for r in results), "cuobjdump reported no resource usage"
    too_much = [
        f"{r['kernel']} {r['target']} {r['constexprs']}: {r['shared_bytes']} bytes"
        for r in results
        if r["shared_bytes"] > SHARED_MEMORY_PER_BLOCK[r["target"]]
    ]
    assert not too_much, "more shared memory than a block may have:\n" + "\n".join(too_much)
    # The fused norm kernel's tiles were chosen to stay near the plain GEMV's register use.
    assert max(r["registers"] for r in results if r["kernel"] == "_normed_gemv_kernel") <= 128
    for r in sorted(results, key=lambda r: -r["registers"]):
        print(f"{r['registers']:>4} registers  {r['kernel']} {r['target']} {r['constexprs']}")
