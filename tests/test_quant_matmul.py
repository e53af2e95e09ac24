"""The quantized-weight Triton kernels against the float32 reference, on CPU via Triton's
interpreter; the load-time choice with a scripted timer; and every kernel variant compiled for
sm_86, sm_89 and sm_90 without a GPU.

The reference dequantizes with the scales and offsets as the kernels hold them (rounded to the
scale dtype), so the only differences left are the kernels' own roundings, and the tolerances
bound exactly those: the output's rounding to its dtype (a whole step: the interpreter
truncates), and for the GEMM also the weights' rounding to the activations' dtype before tl.dot."""

import os

# Must be set before engine.quantization.triton_matmul is imported, or its kernels would try to compile for a GPU.
os.environ["TRITON_INTERPRET"] = "1"

import pytest

triton = pytest.importorskip("triton")
import torch  # noqa: E402

from engine.quantization import triton_matmul as qm  # noqa: E402
from engine.quantization import triton_tiles as qt  # noqa: E402
from engine.quantization.layout import QuantizedWeight, quantize_int4  # noqa: E402
from engine.quantization.triton_matmul import pack_for_triton, quant_gemv, quant_matmul  # noqa: E402
from engine.quantization.triton_tiles import (  # noqa: E402
    ROW_BUCKETS,
    Tile,
    choose_quant_tiles,
    tile_candidates,
    tile_for,
)
from tests.gpu_compile import TARGETS, compile_in_subprocess, record_launches  # noqa: E402
from tests.quantized_weights import random_quantized_weight as make_weight  # noqa: E402

STEP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}  # one step of the significand
GROUPS = [16, 32, 64, 128, "channel"]


def as_held(qw: QuantizedWeight, dtype: torch.dtype) -> QuantizedWeight:
    """qw with its scales and offsets rounded as pack_for_triton rounds them."""
    return QuantizedWeight(
        qw.bits,
        qw.q,
        qw.scale.to(dtype).float(),
        None if qw.offset is None else qw.offset.to(dtype).float(),
        qw.group_size,
        qw.source,
    )


def check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, weight_rounded: bool):
    """got ≈ x @ w.T + bias (w float32), within the roundings the kernel is allowed."""
    dtype = x.dtype
    if weight_rounded:
        w = w.to(dtype).float()
    ref = x.float() @ w.T + (0 if bias is None else bias.float())
    magnitude = x.float().abs() @ w.abs().T
    tol = STEP[dtype] * ref.abs() + 2.0**-18 * magnitude + 1e-30
    if weight_rounded:  # the interpreter truncates where torch rounds: the kernel's weights may differ by a step
        tol += STEP[dtype] * magnitude
    assert got.dtype == dtype and got.shape == ref.shape
    bad = (got.float() - ref).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} off; worst {((got.float() - ref).abs() / tol).max()}x tol"


def k_for(group: int | str) -> int:
    """Odd, and not a multiple of the group: several chunks, a short last group and a partial chunk."""
    return 101 if group == "channel" else 3 * group + 5


def randn(*shape, dtype=torch.bfloat16, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("with_offset", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemv_matches_reference(bits, group, with_offset, dtype):
    qw = make_weight(bits, 19, k_for(group), group, with_offset)
    w = pack_for_triton(qw, dtype)
    ref_w = as_held(qw, dtype).dequantize()
    for rows in (1, 3, 8):
        x = randn(rows, qw.shape[1], dtype=dtype, seed=rows)
        for block_n, block_k in ((2, 32), (8, 128)):
            check(quant_gemv(x, w, None, block_n, block_k), x, ref_w, None, weight_rounded=False)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("with_offset", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matmul_matches_reference(bits, group, with_offset, dtype):
    qw = make_weight(bits, 37, k_for(group), group, with_offset)
    w = pack_for_triton(qw, dtype)
    ref_w = as_held(qw, dtype).dequantize()
    for rows in (1, 5, 16, 17, 40):
        x = randn(rows, qw.shape[1], dtype=dtype, seed=rows)
        check(quant_matmul(x, w, None, 16, 16, 32), x, ref_w, None, weight_rounded=True)
    check(quant_matmul(x, w, None, 32, 32, 64), x, ref_w, None, weight_rounded=True)


@pytest.mark.parametrize("bits", [4, 8])
def test_whole_chunks_bias_and_a_strided_x(bits):
    """K a multiple of BLOCK_K (no partial chunk), a bias, and x rows inside a wider tensor."""
    qw = make_weight(bits, 24, 256, 32, True, seed=3)
    w = pack_for_triton(qw, torch.bfloat16)
    ref_w = as_held(qw, torch.bfloat16).dequantize()
    bias = randn(24, seed=4)
    x = randn(5, 300, seed=5)[:, :256]
    assert x.stride(0) == 300
    check(quant_gemv(x, w, bias, 4, 256), x, ref_w, bias, weight_rounded=False)
    check(quant_gemv(x[:1], w, bias, 4, 128), x[:1], ref_w, bias, weight_rounded=False)
    check(quant_matmul(x, w, bias, 16, 16, 64), x, ref_w, bias, weight_rounded=True)


def test_int4_from_the_quantizer_and_float32_scales():
    """quantize_int4's weights (offsets = group minimum), with scales kept in float32."""
    qw = quantize_int4(torch.randn(20, 97, generator=torch.Generator().manual_seed(6)), 32)
    w = pack_for_triton(qw, torch.float16, scale_dtype=torch.float32)
    assert w.scale.dtype == w.offset.dtype == torch.float32
    x = randn(2, 97, dtype=torch.float16, seed=7)
    check(quant_gemv(x, w, None, 4, 64), x, qw.dequantize(), None, weight_rounded=False)
    check(quant_matmul(x, w, None, 16, 16, 32), x, qw.dequantize(), None, weight_rounded=True)


def test_layout():
    codes = torch.arange(35, dtype=torch.uint8).remainder(16).view(1, 35)
    qw = QuantizedWeight(4, codes, torch.ones(1, 2), None, 32, "test")
    w = pack_for_triton(qw, torch.bfloat16)
    # Rows padded to 16 bytes (32 codes), even k in the low nibble, zeros past K.
    assert w.q.shape == (1, 32) and w.q.dtype == torch.uint8 and w.k == 35
    assert w.q[0, 0] == 0x10 and w.q[0, 1] == 0x32 and w.q[0, 17] == 0x02 and not w.q[0, 18:].any()
    assert w.scale.dtype == torch.bfloat16 and w.offset is None
    eight = pack_for_triton(QuantizedWeight(8, codes.to(torch.int8), torch.ones(1, 1), None, 35, "t"), torch.float16)
    assert eight.q.shape == (1, 48) and eight.q.dtype == torch.int8
    assert torch.equal(eight.q[0, :35], codes[0].to(torch.int8)) and not eight.q[0, 35:].any()


def test_refuses_what_it_cannot_compute():
    w = pack_for_triton(make_weight(4, 8, 64, 32, True), torch.bfloat16)
    with pytest.raises(ValueError, match="1 to 8 rows"):
        quant_gemv(randn(9, 64), w, None, 4, 64)
    with pytest.raises(ValueError, match="fp16 or bf16 x"):
        quant_gemv(randn(1, 64).float(), w, None, 4, 64)
    with pytest.raises(ValueError, match="shape"):
        quant_matmul(randn(1, 63), w, None)
    with pytest.raises(ValueError, match="bias"):
        quant_gemv(randn(1, 64), w, randn(7), 4, 64)
    with pytest.raises(ValueError, match="BLOCK_K"):
        quant_gemv(randn(1, 96), pack_for_triton(make_weight(4, 8, 96, 48, True), torch.bfloat16), None, 4, 64)
    with pytest.raises(ValueError, match="at least 16"):
        quant_matmul(randn(1, 64), w, None, 8, 16, 32)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        pack_for_triton(make_weight(4, 8, 64, 32, True), torch.float32)
    assert quant_matmul(randn(0, 64), w).shape == (0, 8)


def test_tile_candidates():
    w = pack_for_triton(make_weight(4, 8, 512, 128, True), torch.bfloat16)
    for bucket in ROW_BUCKETS:
        tiles = tile_candidates(bucket, w)
        assert tiles and all(t.block_k >= 64 and qm.chunk_groups(w, t.block_k) for t in tiles)
        gemv = [t for t in tiles if t.kernel == "gemv"]
        assert all(t.block_m == bucket and bucket * t.block_n * t.block_k <= qt.MAX_GEMV_TILE for t in gemv)
        assert bool(gemv) == (bucket <= 8) and any(t.kernel == "matmul" for t in tiles) == (bucket >= 4)
    assert tile_for({1: "a", 2: "b", 256: "c"}, 2) == "b" and tile_for({256: "c"}, 1000) == "c"


class ScriptedTimer:
    """Times each tile by `ms(tile)` (the tile read from the timed closure), and counts timings."""

    def __init__(self, ms):
        self.ms, self.calls = ms, 0

    def __call__(self, fn) -> float:
        self.calls += 1
        cells = [c.cell_contents for c in fn.__closure__ or ()]
        return self.ms(next(c for c in cells if isinstance(c, Tile)))


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(qt, "_CHOICES", {})


def small_candidates(bucket, w):
    """Two tiles a bucket, so that the interpreter times few of them."""
    if bucket <= 8:
        return [Tile("gemv", bucket, 2, 64), Tile("gemv", bucket, 4, 32)]
    return [Tile("matmul", 16, 16, 32), Tile("matmul", 32, 16, 32)]


def test_choose_takes_the_fastest_agreeing_tile_per_bucket(monkeypatch):
    monkeypatch.setattr(qt, "tile_candidates", small_candidates)
    qw = make_weight(4, 16, 64, 32, True)
    w = pack_for_triton(qw, torch.bfloat16)
    timer = ScriptedTimer(lambda t: 1.0 / (t.block_n * t.block_m))  # wider is faster
    choice = choose_quant_tiles(qw, w, None, torch.bfloat16, timer, buckets=(1, 4, 16))
    assert choice.tiles == {1: Tile("gemv", 1, 4, 32), 4: Tile("gemv", 4, 4, 32), 16: Tile("matmul", 32, 16, 32)}
    assert not choice.tinygemm  # not on CPU
    assert timer.calls == 6
    assert choose_quant_tiles(qw, w, None, torch.bfloat16, timer, buckets=(1, 4, 16)) is choice
    assert timer.calls == 6  # one measurement per shape


def test_choose_never_takes_a_tile_that_disagrees(monkeypatch):
    monkeypatch.setattr(qt, "tile_candidates", small_candidates)
    real = qt.run_tile
    monkeypatch.setattr(qt, "run_tile", lambda x, w, b, tile: real(x, w, b, tile) + (tile.block_n == 4))
    qw = make_weight(8, 16, 64, "channel", False)
    choice = choose_quant_tiles(
        qw,
        pack_for_triton(qw, torch.float16),
        None,
        torch.float16,
        ScriptedTimer(lambda t: 1.0 / t.block_n),
        buckets=(1,),
    )
    assert choice.tiles == {1: Tile("gemv", 1, 2, 64)}


def test_the_engine_module_runs_the_chosen_tiles_for_any_row_count(monkeypatch):
    """TritonQuantMatmul, what a quantized layer holds on a GPU: float32 activations go in as bf16,
    each row count runs its bucket's tile, and the result matches the reference."""
    from engine.quantization.triton_tiles import TritonQuantMatmul

    monkeypatch.setattr(qt, "tile_candidates", small_candidates)
    real = qt.choose_quant_tiles
    monkeypatch.setattr(
        qt,
        "choose_quant_tiles",
        lambda qw, w, bias, dtype: real(
            qw, w, bias, dtype, ScriptedTimer(lambda t: 1.0 / t.block_n), buckets=(1, 4, 16)
        ),
    )
    qw = make_weight(4, 24, 64, 32, True)
    kernel = TritonQuantMatmul(qw, torch.float32)
    assert kernel.tinygemm is None and set(kernel.tiles) == {1, 4, 16}
    for rows in (1, 3, 20):
        x = randn(rows, 64, dtype=torch.float32, seed=rows)
        got = kernel(x)
        assert got.dtype == torch.float32
        check(
            got.to(torch.bfloat16),
            x.to(torch.bfloat16),
            as_held(qw, torch.bfloat16).dequantize(),
            None,
            weight_rounded=rows > 8,
        )


# --------------------------------------------------------------------------------------------
# Compiling for the GPUs Pagoda runs on


CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def launch_every_variant() -> None:
    """Each tile the chooser may try, on a Qwen3-like K (4-bit, groups of 32, offsets, bf16), and
    each other variant (8 bits, no offsets, a bias, a partial chunk, groups in a chunk or a chunk
    in a group, fp16) on one GEMV and one GEMM tile."""
    main = pack_for_triton(make_weight(4, 16, 1024, 32, True), torch.bfloat16)
    for tile in sorted({t for b in ROW_BUCKETS for t in tile_candidates(b, main)}):
        qt.run_tile(randn(min(tile.block_m, 8) if tile.kernel == "gemv" else 20, 1024), main, None, tile)
    for bits, k, group, offset, bias, dtype in [
        (8, 1024, "channel", False, False, torch.bfloat16),
        (4, 1000, 128, True, True, torch.float16),
        (4, 1024, 16, False, False, torch.bfloat16),
        (8, 1000, 64, True, True, torch.float16),
    ]:
        w = pack_for_triton(make_weight(bits, 16, k, group, offset), dtype)
        b = randn(16, dtype=dtype) if bias else None
        quant_gemv(randn(1, k, dtype=dtype), w, b, 4, 256)
        quant_matmul(randn(20, k, dtype=dtype), w, b, 32, 64, 64)


@pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="this Triton build has no NVIDIA backend tools")
def test_every_variant_compiles_for_sm86_sm89_sm90_without_spilling(tmp_path):
    specs = []
    with record_launches(specs):
        launch_every_variant()
    assert {s["kernel"] for s in specs} == {"_quant_gemv_kernel", "_quant_matmul_kernel"}
    results = compile_in_subprocess([s | {"target": t} for t in TARGETS.values() for s in specs], tmp_path)
    assert {r["target"] for r in results} == {86, 89, 90}
    failed = [f"sm_{r['target']} {r['kernel']} {r['constexprs']}: {r['error']}" for r in results if r["error"]]
    assert not failed, "\n".join(failed)
    spilled = [
        f"sm_{r['target']} {r['kernel']} {r['constexprs']}: {r['local_bytes']} bytes"
        for r in results
        if r.get("local_bytes")
    ]
    assert not spilled, "register spills to local memory:\n" + "\n".join(spilled)
    for r in sorted(results, key=lambda r: -r["registers"]):
        print(f"{r['registers']:>4} registers  sm_{r['target']} {r['kernel']} {r['constexprs']}")
