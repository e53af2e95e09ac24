"""GPU checks, run by bench/device_check.sh on a CUDA machine; skipped elsewhere.

Every CUDA backend is checked against the torch reference backend and against transformers."""

import dataclasses
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import AttentionMetadata, torch_backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[random.Random(i).randrange(3, 300) for _ in range(n)] for i, n in enumerate((5, 16, 33, 70))]


def hf_greedy(path, prompts, n, dtype=torch.float32):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    outs = []
    for p in prompts:
        ids = hf.generate(
            torch.tensor([p], device="cuda"), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        outs.append(ids[0, len(p) :].tolist())
    return outs


# gemma3: sliding-window layers; gpt_oss: a window, attention sinks and experts (Triton's sinks untried on a GPU yet);
# both with KV-cache groups where steps run eagerly (untried on a GPU yet). qwen3_moe and gemma4_moe: the fused
# Triton experts (engine/layers/fused_moe_triton.py); gemma4: global layers twice as wide as the sliding ones, and
# shared-KV layers; qwen3_5: Gated DeltaNet layers and their state slots (all untried on a GPU yet)
FAMILIES = ["llama", "qwen2", "qwen3", "gemma3", "gpt_oss", "qwen3_moe", "gemma4", "gemma4_moe", "qwen3_5"]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_on_every_backend(tiny_models, family):
    expected = hf_greedy(tiny_models[family], PROMPTS, 48)
    for backend in ("torch", "triton"):
        for eager in (True, False):
            llm = LLM(
                str(tiny_models[family]),
                device="cuda",
                dtype="float32",
                attention_backend=backend,
                enforce_eager=eager,
                num_kvcache_blocks=128,
                max_num_seqs=8,
            )
            outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
            got = [o["token_ids"] for o in outs]
            assert got == expected, f"{family} backend={backend} enforce_eager={eager}"
            # KV-cache groups where steps run eagerly (CUDA graphs keep one group for now): the windows' blocks
            # given back, and the Triton kernels reading a released block's entry as block 0
            captured = backend == "triton" and not eager
            split = {
                "gemma3": not captured,
                "gpt_oss": not captured,
                "gemma4": backend == "torch",  # Triton reads whole caches: its layers of two widths keep a tensor each
                "gemma4_moe": True,  # its experts keep steps eager, and its layers are of one width
            }.get(family, False)
            assert (len(llm.stats().kv_groups) > 1) == split
            del llm


def test_prefix_cache_and_chunked_prefill_on_triton(tiny_llama):
    system = list(range(10, 60))
    prompts = [system + [100 + i, 101 + i, 7] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for caching in (False, True):
        llm = LLM(
            str(tiny_llama),
            device="cuda",
            dtype="float32",
            num_kvcache_blocks=64,
            max_num_seqs=4,
            max_num_batched_tokens=23,
            enable_prefix_caching=caching,
        )
        outs[caching] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        if caching:  # requests admitted after the first one registered its 3 full system-prompt blocks hit them
            assert llm.stats().prefix_cache_hits >= 48
    assert outs[True] == outs[False]


ASYNC_MIX = [
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=3, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=0.7, repetition_penalty=1.3, seed=4, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=30),  # may stop at eos, one step late under async scheduling
]


def test_async_scheduling_gives_the_synchronous_outputs(tiny_qwen2):
    """Pinned read-back, staged sampling columns and inputs taken from the previous step's samples,
    under preemption (a small cache) and chunked prefill; decode on graphs, prefill eager."""
    prompts = [PROMPTS[i % 4] + [7 + i] * (i + 1) for i in range(8)]
    params = [ASYNC_MIX[i % 4] for i in range(8)]
    outs = {}
    for mode in (False, True):
        llm = LLM(
            str(tiny_qwen2),
            device="cuda",
            dtype="float32",
            num_kvcache_blocks=16,
            max_num_seqs=8,
            max_num_batched_tokens=40,
            async_scheduling=mode,
        )
        outs[mode] = [(o["token_ids"], o["finish_reason"]) for o in llm.generate(prompts, params, use_tqdm=False)]
        if mode:
            assert llm.stats().num_preemptions > 0 and llm.stats().async_scheduling
        del llm
    assert outs[True] == outs[False]


def test_async_steps_never_wait_for_the_device(tiny_qwen2):
    """No hidden synchronisation in a step (inputs, sampling columns, penalty masks, read-back):
    CUDA's sync debug mode turns any blocking copy or stream wait into an error, from the first
    prefill to the end, with requests added and aborted on the way. Then, with each forward
    preceded by a long GPU sleep, step() must return while the device is still busy."""
    llm = LLM(str(tiny_qwen2), device="cuda", dtype="float32", num_kvcache_blocks=64, max_num_seqs=8)
    assert llm.stats().async_scheduling  # the default on CUDA
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i, p in enumerate(ASYNC_MIX):
            llm.add_request(PROMPTS[i], p, request_id=f"r{i}")
        for step in range(40):
            llm.step()
            if step == 5:
                llm.add_request(PROMPTS[0] + [9, 9], ASYNC_MIX[1])
            if step == 8:
                llm.abort_request("r0")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    while llm.has_unfinished_requests():
        llm.step()

    for i, p in enumerate(ASYNC_MIX[:3]):  # none stops early
        llm.add_request(PROMPTS[i], p)
    for _ in range(4):
        llm.step()
    execute = llm.model_runner.execute

    def slow_execute(step):
        torch.cuda._sleep(2 * 10**8)  # ~0.1 s of GPU time ahead of the forward
        return execute(step)

    llm.model_runner.execute = slow_execute
    for _ in range(3):
        outs = llm.step()
        assert not torch.cuda.current_stream().query(), "step() waited for the step it launched"
        assert len(outs) == 3  # the previous step's tokens, one per request


def test_compiled_sampler_on_cuda_picks_the_eager_tokens():
    """Batches of 64 rows and more sample through torch.compile on the GPU: the same tokens as
    eager sampling from the same noise, for plain temperature (the throughput benchmark's) and a
    mix of min-p, penalties and greedy rows; top-k/top-p batches stay eager."""
    from engine.sample.sampler import Sampler, SamplingBatch

    rows, vocab = 96, 151936
    gen = torch.Generator("cuda").manual_seed(0)
    logits = torch.randn(rows, vocab, device="cuda", generator=gen) * 3  # float32: no ties for top-p to order

    def column(value, dtype):
        return torch.full((rows,), value, dtype=dtype, device="cuda")

    plain = SamplingBatch(column(0.6, torch.float32), None, None, None, None, None, [None] * rows, False)
    temps = column(0.8, torch.float32)
    temps[::3] = 0.0
    mixed = SamplingBatch(
        temps,
        None,
        None,
        column(0.02, torch.float32),
        column(1.3, torch.float32),
        torch.rand(rows, vocab, device="cuda", generator=gen) < 0.01,
        [None] * rows,
        False,
    )
    compiled = Sampler(compiled=True)
    filtered = SamplingBatch(
        temps, column(40, torch.int64), column(0.9, torch.float32), None, None, None, [None] * rows, False
    )
    for batch in (plain, mixed, filtered):
        torch.manual_seed(1)
        expected = Sampler()(logits, batch)
        torch.manual_seed(1)
        got = compiled(logits, batch)
        assert compiled.kind == "compiled", "torch.compile of the sampler failed on this GPU"
        assert (got == expected).float().mean() > 0.98  # a fused softmax may round a near-tie the other way


def random_case(num_seqs, q_lens, kv_lens, heads, kv_heads, dim, block_size, dtype):
    num_blocks = sum(-(-k // block_size) for k in kv_lens) + 7
    order = torch.randperm(num_blocks).tolist()
    tables, slots = [], []
    for q, k in zip(q_lens, kv_lens):
        n = -(-k // block_size)
        table = [order.pop() for _ in range(n)]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(k - q, k)]
    width = max(len(t) for t in tables)
    dev = "cuda"
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=dev),
        query_start_loc=qsl.to(dev),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32, device=dev),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
        max_query_len=max(q_lens),
        max_seq_len=max(kv_lens),
        query_lens_cpu=q_lens,
        seq_lens_cpu=kv_lens,
    )
    t = sum(q_lens)
    q = torch.randn(t, heads, dim, device=dev, dtype=dtype)
    k = torch.randn(t, kv_heads, dim, device=dev, dtype=dtype)
    v = torch.randn(t, kv_heads, dim, device=dev, dtype=dtype)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, device=dev, dtype=dtype)
    return q, k, v, cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16, 8, 128), (9, 3, 64), (4, 4, 64)])
def test_triton_kernels_match_reference_on_gpu(dtype, shape):
    from engine.attention import triton_kernels

    heads, kv_heads, dim = shape
    for q_lens, kv_lens in [
        ([1] * 7, [1, 17, 300, 2048, 16, 33, 900]),
        ([37, 1, 200, 5], [37, 50, 1000, 5]),
        ([64, 1], [64, 2]),
    ]:
        q, k, v, cache, meta = random_case(len(q_lens), q_lens, kv_lens, heads, kv_heads, dim, 16, dtype)
        ref_cache, tri_cache = cache.clone(), cache.clone()
        torch_backend.store_kvcache(k, v, ref_cache[0], ref_cache[1], meta.slot_mapping)
        triton_kernels.store_kvcache(k, v, tri_cache[0], tri_cache[1], meta.slot_mapping)
        assert torch.equal(ref_cache, tri_cache)
        ref = torch_backend.paged_attention(q, ref_cache[0], ref_cache[1], meta, dim**-0.5).float()
        out = triton_kernels.paged_attention(q, tri_cache[0], tri_cache[1], meta, dim**-0.5).float()
        err = ((out - ref).norm() / ref.norm()).item()
        assert err < (1e-4 if dtype == torch.float32 else 1e-2), (q_lens, kv_lens, err)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_attn_backend_matches_reference_on_gpu(dtype):
    """Runs only where the flash-attn package is installed (the project's device image has none)."""
    pytest.importorskip("flash_attn")
    from engine.attention import flash_attn_backend

    for q_lens, kv_lens in [([1] * 5, [1, 256, 300, 2048, 900]), ([37, 1, 200, 5], [37, 513, 1000, 5])]:
        q, _, _, cache, meta = random_case(len(q_lens), q_lens, kv_lens, 16, 8, 128, 256, dtype)
        ref = torch_backend.paged_attention(q, cache[0], cache[1], meta, 128**-0.5).float()
        out = flash_attn_backend.paged_attention(q, cache[0], cache[1], meta, 128**-0.5).float()
        assert ((out - ref).norm() / ref.norm()).item() < 1e-2, (q_lens, kv_lens)


def test_flash_attn_engine_follows_the_triton_engine(tiny_llama):
    pytest.importorskip("flash_attn")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for backend in ("flash-attn", "triton"):
        llm = LLM(
            str(tiny_llama),
            device="cuda",
            dtype="bfloat16",
            attention_backend=backend,
            kvcache_block_size=256,
            num_kvcache_blocks=16,
            max_num_seqs=8,
        )
        assert llm.stats().attention_backend == backend
        outs[backend] = [o["token_ids"] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        del llm
    assert outs["flash-attn"] == outs["triton"]


def test_bf16_logits_close_to_transformers_on_qwen3_06b_shape(tmp_path_factory):
    import tempfile
    from pathlib import Path

    import transformers

    from bench.common import qwen3_06b_config, save_random_model

    folder = save_random_model(
        qwen3_06b_config(), Path(tempfile.gettempdir()) / "pagoda-qwen3-0.6b", torch.bfloat16, "cuda"
    )
    prompt = [random.Random(0).randrange(100, 100000) for _ in range(100)]
    llm = LLM(str(folder), device="cuda", dtype="bfloat16", num_kvcache_blocks=64, max_num_seqs=4)
    captured = []
    original = llm.model_runner.model.compute_logits
    llm.model_runner.model.compute_logits = lambda h: captured.append(original(h).float()) or captured[-1]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    first = out[0]["token_ids"][0]
    with torch.no_grad():
        refs = hf(torch.tensor([prompt + [first]], device="cuda")).logits[0, -2:].float()
    # The prefill's logits, then the first decode step's (a CUDA graph, with whatever matmuls were chosen).
    for name, ours, ref in (("prefill", captured[0][0], refs[0]), ("decode", captured[1][0], refs[1])):
        rel = ((ours - ref).norm() / ref.norm()).item()
        cos = torch.nn.functional.cosine_similarity(ours, ref, dim=0).item()
        print(f"bf16 0.6B-shape {name} logits ({llm.stats().matmul}): relative error {rel:.4f}, cosine {cos:.5f}")
        assert rel < 0.05 and cos > 0.995, name


def test_staging_buffer_on_cuda():
    import numpy as np

    from engine.runner.staging import StagingBuffer

    staging = StagingBuffer(torch.device("cuda"), torch.int64, num_buffers=1)
    torch.cuda._sleep(10**8)  # keep the stream busy, so the first copy is still queued when the second upload comes
    first = staging.upload([np.arange(5), np.arange(6).reshape(2, 3)])
    second = staging.upload([np.full(5, 9), np.full((2, 3), 9)])  # must wait before reusing the pinned buffer
    assert all(h.is_pinned() for h in staging.hosts if h.numel()) and first[0].is_cuda
    assert first[0].tolist() == list(range(5)) and first[1].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert second[1].tolist() == [[9] * 3] * 2
    (grown,) = staging.upload([np.arange(5000)])  # a bigger step: a new, bigger pinned buffer
    assert grown.tolist() == list(range(5000)) and all(h.is_pinned() for h in staging.hosts if h.numel())


def test_staging_uploads_do_not_wait_for_a_busy_stream():
    """With buffers taking turns, the next step's uploads go out while the device still runs this one."""
    import numpy as np

    from engine.runner.staging import StagingBuffer

    staging = StagingBuffer(torch.device("cuda"), torch.int64)
    for i in range(len(staging.hosts)):  # every buffer allocated first: pinning new memory may itself wait
        staging.upload([np.full(3, i)])
    torch.cuda.synchronize()
    torch.cuda._sleep(10**9)  # a long "step" on the stream
    uploads = [staging.upload([np.full(3, i)]) for i in range(3)]
    assert not torch.cuda.current_stream().query(), "an upload waited for the busy stream"
    assert [u[0].tolist() for u in uploads] == [[0] * 3, [1] * 3, [2] * 3]


# Two shapes reach every compiled variant (with and without bias; K a multiple of BLOCK_K, and whole
# chunks then a partial one) while keeping first-run compiles few; the engine tests cover the 0.6B shapes.
@pytest.mark.parametrize("n,k,with_bias", [(4096, 1024, True), (896, 1536, False)])
def test_gemv_every_tile_matches_cublas_on_gpu(n, k, with_bias):
    from engine.layers.gemv import ROW_BUCKETS, gemv, tile_candidates

    gen = torch.Generator("cuda").manual_seed(0)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
    b = torch.randn(n, device="cuda", generator=gen).bfloat16() if with_bias else None
    for rows in (*ROW_BUCKETS, 3):
        x = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
        ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        for tile in tile_candidates(next(bucket for bucket in ROW_BUCKETS if rows <= bucket)):
            got = gemv(x, w, b, *tile).float()
            assert ((got - ref).norm() / ref.norm()).item() < 1e-2, (rows, tile)


def test_engine_with_gemv_forced_matches_cublas_logits(tiny_models, monkeypatch):
    """Every layer on the Triton kernel (graphs on) against every layer on cuBLAS, bf16."""
    from engine.layers import gemv as gemv_module
    from engine.layers import normed_gemv as normed_module

    monkeypatch.setattr(normed_module, "cuda_timer", lambda fn: 1.0)  # the norms stay unfused here

    def logits_of(force: bool):
        monkeypatch.setattr(gemv_module, "_CHOICES", {})
        monkeypatch.setattr(gemv_module, "TIMINGS", {})
        monkeypatch.setattr(normed_module, "_CHOICES", {})
        monkeypatch.setattr(
            gemv_module, "cuda_timer", lambda fn: 0.1 if force and "gemv" in fn.__code__.co_names else 1.0
        )
        llm = LLM(str(tiny_models["qwen3"]), device="cuda", dtype="bfloat16", num_kvcache_blocks=64, max_num_seqs=4)
        assert llm.stats().matmul == ("torch+triton-gemv" if force else "torch")
        captured = []
        original = llm.model_runner.model.compute_logits
        llm.model_runner.model.compute_logits = lambda h: captured.append(original(h).float()) or captured[-1]
        out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        return captured, [o["token_ids"] for o in out]

    forced, forced_tokens = logits_of(True)
    plain, plain_tokens = logits_of(False)
    # Step i's inputs are the tokens sampled before it: compare the prefill, then the decode steps
    # (through the graphs) while both runs had sampled the same tokens.
    same = next((i for i in range(6) if [t[i] for t in forced_tokens] != [t[i] for t in plain_tokens]), 6)
    for a, b in zip(forced[: same + 1], plain[: same + 1]):
        assert ((a - b).norm() / b.norm()).item() < 2e-2
    print(f"gemv forced vs cuBLAS: {same} of 6 greedy tokens equal")


@pytest.mark.parametrize("n,silu_mul", [(4096, False), (6144, True)])  # the 0.6B shape's qkv and gate_up
def test_normed_gemv_every_tile_matches_the_unfused_ops_on_gpu(n, silu_mul):
    from engine.layers.activation import SiluAndMul
    from engine.layers.layernorm import RMSNorm
    from engine.layers.linear import ColumnParallelLinear
    from engine.layers.normed_gemv import normed_gemv, normed_tile_candidates

    gen = torch.Generator("cuda").manual_seed(0)
    layer = ColumnParallelLinear.split(1024, [n]).cuda().bfloat16()
    norm = RMSNorm(1024).cuda().bfloat16()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, 1024, device="cuda", generator=gen) * 0.02)
        norm.weight.copy_(1 + 0.1 * torch.randn(1024, device="cuda", generator=gen))
        x, residual = (torch.randn(1, 1024, device="cuda", generator=gen).bfloat16() for _ in range(2))
        act = SiluAndMul() if silu_mul else None
        for given in (residual, None):  # a later layer, and the first (no residual yet)
            expected, expected_residual = layer.normed_unfused(x, given, norm, act)
            for tile in normed_tile_candidates(silu_mul):
                got, got_residual = normed_gemv(
                    x, given, norm.weight, norm.eps, layer.weight, None, *tile, silu_mul=silu_mul
                )
                assert ((got.float() - expected.float()).norm() / expected.float().norm()).item() < 1e-2, tile
                assert torch.equal(got_residual, expected_residual), tile


def test_engine_with_norms_fused_matches_unfused_logits(tiny_models, monkeypatch):
    """One prompt (its decode steps are one row, in the graphs): every q/k/v and gate/up running its
    norm inside the kernel, against none doing so, bf16. The first logits are the prefill's (several
    rows: never fused), so the decode steps after it are what this compares."""
    from engine.layers import normed_gemv as normed_module

    def logits_of(force: bool):
        monkeypatch.setattr(normed_module, "_CHOICES", {})
        monkeypatch.setattr(
            normed_module, "cuda_timer", lambda fn: 0.1 if force and "normed_gemv" in fn.__code__.co_names else 1.0
        )
        llm = LLM(str(tiny_models["qwen3"]), device="cuda", dtype="bfloat16", num_kvcache_blocks=64, max_num_seqs=4)
        assert llm.model_runner.normed_layers == (2 * len(llm.model_runner.model.model.layers) if force else 0)
        captured = []
        original = llm.model_runner.model.compute_logits
        llm.model_runner.model.compute_logits = lambda h: captured.append(original(h).float()) or captured[-1]
        out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        return captured, out[0]["token_ids"]

    fused, fused_tokens = logits_of(True)
    plain, plain_tokens = logits_of(False)
    same = next((i for i in range(6) if fused_tokens[i] != plain_tokens[i]), 6)
    for a, b in zip(fused[: same + 1], plain[: same + 1]):
        assert ((a - b).norm() / b.norm()).item() < 2e-2
    print(f"norms fused vs not: {same} of 6 greedy tokens equal")


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "int4"])
def test_a_quantized_kv_cache_on_the_gpu(tiny_models, kv_cache_dtype):
    """The Triton kernels read a quantized cache as the torch reference does (in registers, on the GPU, CUDA graphs
    included), and the tokens' logprobs stay close to the plain cache's."""
    from engine.attention import triton_kernels
    from engine.attention.kv_format import kv_format
    from tests.attention_batches import make_batch

    fmt = kv_format(kv_cache_dtype)
    query, k_plain, v_plain, meta = make_batch([1, 1, 9, 1], [300, 17, 40, 1], head_dim=128, dtype=torch.bfloat16)
    k_rows, v_rows = (fmt.pack(c.flatten(0, 1)).view(*c.shape[:3], -1).cuda() for c in (k_plain, v_plain))
    tensors = ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")
    meta = dataclasses.replace(meta, **{name: getattr(meta, name).cuda() for name in tensors})
    query = query.cuda()
    ref = torch_backend.paged_attention(query, k_rows, v_rows, meta, 128**-0.5, kv_format=fmt).float()
    out = triton_kernels.paged_attention(query, k_rows, v_rows, meta, 128**-0.5, kv_format=fmt).float()
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    plain = LLM(str(tiny_models["qwen3"]), num_kvcache_blocks=64).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(str(tiny_models["qwen3"]), num_kvcache_blocks=64, kv_cache_dtype=kv_cache_dtype)
    assert llm.stats().attention_backend == "triton" and llm.stats().decode == "cuda-graphs"
    quantized = llm.generate(PROMPTS, params, use_tqdm=False)
    first = [
        abs(q["logprobs"][0][q["token_ids"][0]] - p["logprobs"][0][p["token_ids"][0]]) for q, p in zip(quantized, plain)
    ]
    assert max(first) < {"int8": 0.05, "fp8": 0.15, "int4": 0.5}[kv_cache_dtype]
