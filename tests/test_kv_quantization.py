"""A quantized KV cache (kv_cache_dtype int8, fp8, int4; engine/attention/kv_format.py): each format's rounding
stays within its bound, the torch backend attends over exactly the numbers the format stored, the engine holds more
tokens in the same bytes, its outputs stay close to the plain cache's and never depend on the prefix cache, chunking
or preemption, and settings that cannot work are refused at load."""

import importlib.util

import pytest
import torch

from engine import SamplingParams
from engine.attention import select_backend, torch_backend
from engine.attention.kv_format import FP8_MAX, KVFormat, kv_format, rotate_and_pack
from engine.config import EngineConfig
from engine.layers.attention import Attention
from engine.runner.kernel_passes import compiled_small_ops, quantizer_compiles
from tests.attention_batches import make_batch

QUANTIZED = ["int8", "fp8", "int4"]


def rounding_bound(name: str, x: torch.Tensor) -> torch.Tensor:
    """The most each value of x [N, H, D] may move: half a step of its group's scale (a whole step for int4's far
    side, which reaches +7 while the largest magnitude maps to -8), or for fp8 its 3 mantissa bits of the value
    itself; and float16's rounding of the scale."""
    fmt = kv_format(name)
    group = fmt.group(x.shape[-1])
    amax = x.abs().unflatten(-1, (-1, group)).amax(-1, keepdim=True)
    if name == "int8":
        step = amax / 127 * 0.5
    elif name == "int4":
        step = amax / 8
    else:
        step = x.abs().unflatten(-1, (-1, group)) * 2**-4 + amax / FP8_MAX * 2**-9
    # The values are scaled by the float32 scale, and come back through the float16 one stored (at most 2^-11 of
    # the group's largest value apart, and float16's subnormal spacing for tiny ones)
    stored = amax * 2**-11 + 2**-24 * 127
    return (step + stored + 1e-7).expand(*x.shape[:-1], -1, group).flatten(-2)


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
def test_each_value_comes_back_within_its_formats_rounding(name, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    x = torch.randn(7, 3, head_dim, generator=g) * torch.logspace(-3, 2, 7)[:, None, None]  # magnitudes per token
    fmt = kv_format(name)
    rows = fmt.pack(x)
    assert rows.dtype == torch.uint8
    assert rows.shape == (7, 3, fmt.row_width(head_dim))
    back = fmt.unpack(rows, torch.float32, head_dim)
    error = (back - x).abs()
    assert (error <= rounding_bound(name, x)).all()
    assert error.max() > 0  # it did quantize
    assert fmt.unpack(fmt.pack(torch.zeros(2, 3, head_dim)), torch.float32, head_dim).eq(0).all()


def test_rows_are_as_wide_as_the_docs_say():
    assert [kv_format(n).row_width(64) for n in ("auto", "int8", "fp8", "int4")] == [64, 66, 66, 36]
    assert kv_format("int4").row_width(128) == 64 + 2 * 4
    assert kv_format("int4").row_width(80) == 40 + 2 * 5  # groups of 16: 80 is no multiple of 32


def test_every_stored_byte_decodes_to_the_number_its_format_defines():
    """unpack widens bytes by integer arithmetic (several times faster on a CPU than torch's float8 conversion): every
    e4m3 byte but the NaNs comes back as torch converts it, every int4 byte as its two q4_0 numbers, low nibble
    first; a strided read (the backends' [.., Hkv, L, row] view) comes back contiguous and the same."""
    one = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)  # the rows' scale
    fp8_bytes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8).view(2, 127)
    rows = torch.cat((fp8_bytes, one.expand(2, 2)), dim=-1)[:, None]  # [2 tokens, 1 head, 127 values + scale]
    want = fp8_bytes.view(torch.float8_e4m3fn).float()[:, None]
    assert torch.equal(KVFormat("fp8").unpack(rows, torch.float32, 127), want)
    int4_bytes = torch.arange(256, dtype=torch.uint8).view(8, 32)
    rows = torch.cat((int4_bytes, one.repeat(8, 2)), dim=-1)[:, None]  # two groups of 32 values, scales of 1
    want = torch.stack((int4_bytes & 15, int4_bytes >> 4), dim=-1).flatten(-2).float()[:, None] - 8
    assert torch.equal(KVFormat("int4").unpack(rows, torch.float32, 64), want)
    for name in QUANTIZED:
        fmt = kv_format(name)
        rows = fmt.pack(torch.randn(4, 5, 3, 64)).view(4, 5, 3, -1)
        strided = fmt.unpack(rows.transpose(1, 2), torch.float32, 64)
        assert strided.is_contiguous()
        assert torch.equal(strided, fmt.unpack(rows, torch.float32, 64).transpose(1, 2))


@pytest.mark.parametrize("name", QUANTIZED)
def test_the_backend_attends_over_exactly_what_the_format_stored(name):
    """Decode rows of many lengths, a prefill over a cached prefix and a fresh one, in one batch: the quantized cache
    read by the backend gives the output of the plain backend over its unpacked numbers."""
    q_lens = [1] * 9 + [7, 40]
    seq_lens = [3, 17, 33, 64, 65, 100, 1, 16, 250, 55, 40]
    query, k_plain, v_plain, meta = make_batch(q_lens, seq_lens, head_dim=32, seed=3)
    fmt = kv_format(name)
    k_rows, v_rows = (fmt.pack(c.flatten(0, 1)).view(*c.shape[:3], -1) for c in (k_plain, v_plain))
    k_numbers, v_numbers = (fmt.unpack(r, torch.float32, 32) for r in (k_rows, v_rows))
    got = torch_backend.paged_attention(query, k_rows, v_rows, meta, 0.2, kv_format=fmt)
    want = torch_backend.paged_attention(query, k_numbers, v_numbers, meta, 0.2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    unquantized = torch_backend.paged_attention(query, k_plain, v_plain, meta, 0.2)
    assert not torch.allclose(got, unquantized, atol=1e-6)


def test_the_store_writes_packed_rows_at_their_slots():
    fmt = kv_format("int8")
    cache = torch.zeros(4, 16, 2, fmt.row_width(32), dtype=torch.uint8)
    keys = torch.randn(3, 2, 32)
    slots = torch.tensor([5, -1, 40])
    torch_backend.store_kvcache(fmt.pack(keys), fmt.pack(keys), cache, cache.clone(), slots)
    flat = cache.view(-1, 2, fmt.row_width(32))
    assert torch.equal(flat[5], fmt.pack(keys)[0]) and torch.equal(flat[40], fmt.pack(keys)[2])
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[[5, 40]] = False
    assert flat[untouched].eq(0).all()


@pytest.mark.parametrize("name", QUANTIZED)
def test_the_same_bytes_hold_more_tokens(name, tiny_llama, make_llm):
    budget = {"num_kvcache_blocks": None, "kv_cache_memory_bytes": 1 << 20}
    plain = make_llm(tiny_llama, **budget).stats()
    quantized = make_llm(tiny_llama, kv_cache_dtype=name, **budget).stats()
    assert (plain.kv_cache_dtype, quantized.kv_cache_dtype) == ("auto", name)
    head_dim = 16  # the tiny models' (float32: 64 bytes a head and token)
    assert quantized.bytes_per_block * 64 == plain.bytes_per_block * kv_format(name).row_width(head_dim)
    assert quantized.num_blocks == (1 << 20) // quantized.bytes_per_block
    assert quantized.num_blocks >= {"int4": 5, "int8": 3, "fp8": 3}[name] * plain.num_blocks


@pytest.mark.parametrize("name", QUANTIZED)
def test_graph_capture_quantizes_with_a_compiled_kernel_that_writes_the_same_bytes(name, tiny_llama, make_llm):
    """CUDA graphs capture the compiled small ops (kernel_passes.compiled_small_ops): a quantized cache's rotation and
    quantizer among them, one fused kernel for a dozen eager ones. Compiled for this CPU here, it must write the
    bytes the eager steps write, and the layer gets its eager function back afterwards."""
    model = make_llm(tiny_llama, kv_cache_dtype=name, enforce_eager=True).model_runner.model
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    layer = layers[0]
    keys = torch.randn(5, layer.num_kv_heads, layer.head_dim, generator=torch.Generator().manual_seed(1)) * 3
    eager = layer.pack_fn(keys, layer.kv_rotation, layer.kv_format)
    with compiled_small_ops(model):
        assert all(m.pack_fn is not rotate_and_pack for m in layers)
        compiled = layer.pack_fn(keys, layer.kv_rotation, layer.kv_format)
    assert all(m.pack_fn is rotate_and_pack for m in layers)
    assert torch.equal(compiled, eager)


def test_an_rtx_30_gpu_keeps_the_eager_fp8_quantizer(monkeypatch):
    """Inductor's Triton code cannot convert to float8 e4m3 below sm_89: compiled for an RTX 30 GPU (sm_86), the fp8
    quantizer would fail the graph capture and with it the load."""
    cuda = torch.device("cuda", 0)
    for capability, compiles in [((8, 6), False), ((8, 9), True), ((9, 0), True)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert quantizer_compiles(kv_format("fp8"), cuda) is compiles
        assert quantizer_compiles(kv_format("int8"), cuda) and quantizer_compiles(kv_format("int4"), cuda)
    assert quantizer_compiles(kv_format("fp8"), torch.device("cpu"))


@pytest.mark.parametrize("name", QUANTIZED)
def test_logprobs_stay_close_to_the_plain_caches(name, tiny_qwen2, make_llm, random_prompt):
    """Prefill and decode read the quantized cache: the logprobs the quantized engine gives its own greedy tokens are
    close to what the plain engine gives the same tokens (scored as a prompt), and not equal to them."""
    prompt = random_prompt(40, 5)
    quantized = make_llm(tiny_qwen2, kv_cache_dtype=name)
    out = quantized.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=0))[0]
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    plain = make_llm(tiny_qwen2).generate([prompt + out["token_ids"]], scoring)[0]["prompt_logprobs"]
    want = [plain[len(prompt) + i][t] for i, t in enumerate(out["token_ids"])]
    got = [lp[t] for lp, t in zip(out["logprobs"], out["token_ids"])]
    gaps = [abs(float(g) - float(w)) for g, w in zip(got, want)]
    # A random tiny model is touchier than a trained one (bench/quality.py has the bundled model's figures); a wrong
    # row read or a scale misapplied moves logprobs by whole nats
    mean = {"int8": 0.02, "fp8": 0.08, "int4": 0.25}[name]
    assert sum(gaps) / len(gaps) < mean and max(gaps) < 4 * mean
    assert max(gaps) > 0


@pytest.mark.parametrize("name", QUANTIZED)
def test_outputs_never_depend_on_prefix_hits_chunking_or_preemption(name, tiny_qwen2, make_llm, random_prompt):
    """A block's bytes depend only on its own tokens (per-token scales): prefix hits, chunked prefill and recomputing
    after preemption all read what a plain run wrote."""
    system = random_prompt(40, 100)
    prompts = [system + random_prompt(8, 200 + i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = make_llm(tiny_qwen2, kv_cache_dtype=name, enable_prefix_caching=False, num_kvcache_blocks=64)
    expected = [r["token_ids"] for r in roomy.generate(prompts, params, use_tqdm=False)]
    tight = make_llm(
        tiny_qwen2, kv_cache_dtype=name, num_kvcache_blocks=10, max_model_len=128, max_num_batched_tokens=24
    )
    results = tight.generate(prompts, params, use_tqdm=False)
    stats = tight.stats()
    assert [r["token_ids"] for r in results] == expected
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_settings_that_cannot_work_are_refused_at_load(tiny_llama, make_llm):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(model="m", kv_cache_dtype="q4_0")
    with pytest.raises(ValueError, match="cannot read a quantized KV cache.*attention_backend='torch' or 'triton'"):
        select_backend("flash-attn", torch.device("cuda"), torch.bfloat16, 256, kv_cache_dtype="int8")
    assert select_backend("auto", torch.device("cpu"), torch.float32, 16, kv_cache_dtype="int4").name == "torch"
    if importlib.util.find_spec("triton") is not None:  # on a GPU, the Triton kernels read it (not flash-attn's)
        assert select_backend("auto", torch.device("cuda"), torch.bfloat16, 256, kv_cache_dtype="fp8").name == "triton"
    with pytest.raises(ValueError, match="odd"):
        KVFormat("int4").check_head_dim(17)
    with pytest.raises(ValueError, match="cannot read a quantized KV cache"):
        make_llm(tiny_llama, kv_cache_dtype="fp8", attention_backend="flash-attn")


@pytest.mark.parametrize("name", ["int8", "int4"])  # int4: centred keys (key_mean.py) too
def test_compiled_cpu_decode_reads_the_quantized_cache_as_eager_steps_do(
    name, monkeypatch, tiny_llama, make_llm, random_prompt
):
    """Compiled decode steps write and read the same bytes as eager steps: the compiled engine's tokens, scored by the
    eager one, get the same logprobs to float32 noise. (A compiled step skips a float16 rounding of the scale that
    an eager one makes; had the format quantized with the rounded scale, they would differ by 1e-3 to 1e-2.)"""
    from engine.runner import compiled_decode

    prompt = random_prompt(21, 5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    monkeypatch.setenv(compiled_decode.ENV_SWITCH, "1")
    compiled = make_llm(tiny_llama, kv_cache_dtype=name, max_num_seqs=2)
    assert compiled.model_runner.wait_for_compiled_decode(timeout=600)
    assert compiled.stats().decode == "compiled (1 row, 2-2 rows)"
    out = compiled.generate([prompt], params, use_tqdm=False)[0]
    monkeypatch.setenv(compiled_decode.ENV_SWITCH, "0")
    eager = make_llm(tiny_llama, kv_cache_dtype=name, max_num_seqs=2)
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    scored = eager.generate([prompt + out["token_ids"]], scoring, use_tqdm=False)[0]["prompt_logprobs"]
    pairs = enumerate(zip(out["logprobs"], out["token_ids"], strict=True))
    assert max(abs(float(lp[t]) - float(scored[len(prompt) + i][t])) for i, (lp, t) in pairs) < 1e-4


def test_the_apps_command_line_takes_a_kv_cache_dtype():
    from app.server import parse_args

    assert parse_args(["--kv-cache-dtype", "int4"]).kv_cache_dtype == "int4"
    assert parse_args([]).kv_cache_dtype is None  # the model's last settings, else auto
