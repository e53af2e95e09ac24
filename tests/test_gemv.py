"""The few-row Triton matmul against F.linear, on CPU via Triton's interpreter, and the choice
between it and cuBLAS with a scripted timer."""

import os

# Must be set before engine.layers.gemv is imported, or its kernel would try to compile for a GPU.
os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.layers import gemv as gemv_module  # noqa: E402
from engine.layers.gemv import ROW_BUCKETS, choose_gemv, gemv, row_bucket, tile_candidates  # noqa: E402
from engine.layers.linear import ColumnParallelLinear  # noqa: E402


def ternary(*shape, seed=0):
    """Values in {-1, 0, 1}: every product and every partial sum below 2048 is exact in fp16."""
    return torch.randint(-1, 2, shape, generator=torch.Generator().manual_seed(seed)).to(torch.float16)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
# N off the tile; K a multiple of BLOCK_K, whole chunks then a partial one, and only a partial one
@pytest.mark.parametrize("n,k", [(37, 1024), (21, 1300), (20, 300)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_exact_on_every_tile(rows, n, k, with_bias):
    x, w = ternary(rows, k, seed=1), ternary(n, k, seed=2)
    b = ternary(n, seed=3) if with_bias else None
    expected = F.linear(x.float(), w.float(), None if b is None else b.float()).half()
    for tile in tile_candidates(row_bucket(rows)):
        assert torch.equal(gemv(x, w, b, *tile), expected), tile


def test_bf16_close_to_float_reference():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 512, generator=gen).bfloat16()
    w = (torch.randn(48, 512, generator=gen) * 0.05).bfloat16()
    ref = x.float() @ w.float().T
    got = gemv(x, w, None, 8, 512)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 48)
    # Summed in fp32 and converted once: within one bf16 step of the exact result (the interpreter
    # truncates where a GPU rounds to nearest, so allow a whole step, not half).
    assert ((got.float() - ref).abs() <= ref.abs() * 2**-7 + 1e-6).all()


def test_row_stride_of_a_wider_tensor():
    wide = ternary(3, 600, seed=4)
    x, w = wide[:, :256], ternary(24, 256, seed=5)
    assert x.stride(0) == 600
    assert torch.equal(gemv(x, w, None, 4, 512), F.linear(x.float(), w.float()).half())


def test_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="1 to 4 rows"):
        gemv(ternary(5, 64), ternary(8, 64), None, 4, 512)
    with pytest.raises(ValueError, match="1 to 4 rows"):
        gemv(ternary(0, 64), ternary(8, 64), None, 4, 512)
    with pytest.raises(ValueError, match="same dtype"):
        gemv(ternary(1, 64).float(), ternary(8, 64), None, 4, 512)
    with pytest.raises(ValueError, match="bias"):
        gemv(ternary(1, 64), ternary(8, 64), ternary(7), 4, 512)


def test_tiles_per_row_bucket():
    """Wide K chunks (16-byte loads, many bytes in flight) and accumulators within 64 registers."""
    assert tile_candidates(1) == [(2, 1024), (2, 2048), (4, 512), (4, 1024), (4, 2048), (8, 512), (8, 1024)]
    assert tile_candidates(2) == [(2, 1024), (2, 2048), (4, 512), (4, 1024), (8, 512)]
    assert tile_candidates(4) == [(2, 1024), (4, 512)]


def test_layer_dispatches_by_row_count():
    layer = ColumnParallelLinear.split(256, [40, 24], bias=True).half()
    with torch.no_grad():
        layer.weight.copy_(ternary(64, 256, seed=6))
        layer.bias.copy_(ternary(64, seed=7))
    calls = []
    real = gemv_module.gemv

    def spy(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    layer.kernel = gemv_module.TritonGemv({1: (4, 256), 2: (8, 256)})
    gemv_module.gemv, saved = spy, gemv_module.gemv
    try:
        with torch.no_grad():
            for rows in (1, 2, 3):
                x = ternary(rows, 256, seed=rows)
                expected = F.linear(x.float(), layer.weight.float(), layer.bias.float()).half()
                assert torch.equal(layer(x), expected)
    finally:
        gemv_module.gemv = saved
    assert calls == [1, 2]  # 3 rows had no tile: cuBLAS (F.linear) served them


class ScriptedTimer:
    """Times F.linear as `cublas_ms` and the kernel as `kernel_ms`, and counts the timings."""

    def __init__(self, cublas_ms: float, kernel_ms: float):
        self.cublas_ms, self.kernel_ms, self.calls = cublas_ms, kernel_ms, 0

    def __call__(self, fn) -> float:
        self.calls += 1
        name = getattr(fn, "__code__", None)
        return self.kernel_ms if "gemv" in name.co_names else self.cublas_ms


def half_layers(*shapes, dtype=torch.float16):
    layers = []
    for i, (n, k) in enumerate(shapes):
        layer = ColumnParallelLinear.split(k, [n]).to(dtype)
        with torch.no_grad():
            layer.weight.copy_(ternary(n, k, seed=10 + i))
        layers.append(layer)
    return layers


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(gemv_module, "_CHOICES", {})


def test_choose_takes_the_kernel_only_where_clearly_faster():
    (layer,) = half_layers((24, 256))
    used = choose_gemv([layer], ScriptedTimer(cublas_ms=1.0, kernel_ms=0.5))
    assert used == {1: 1, 2: 1, 4: 1}
    assert set(layer.kernel.tiles) == {1, 2, 3, 4}
    assert layer.kernel.tiles[3] == layer.kernel.tiles[4] in tile_candidates(4)
    assert "(kernel): TritonGemv(1 row: " in repr(layer)  # print(model) shows the swap

    (slow,) = half_layers((24, 256))
    gemv_module._CHOICES.clear()
    assert choose_gemv([slow], ScriptedTimer(cublas_ms=1.0, kernel_ms=0.95)) == {1: 0, 2: 0, 4: 0}
    assert slow.kernel is None  # cuBLAS


def test_choose_measures_each_shape_once_and_skips_float32():
    layers = half_layers((24, 256), (24, 256), (16, 256))
    fp32 = half_layers((24, 256), dtype=torch.float32)
    timer = ScriptedTimer(cublas_ms=1.0, kernel_ms=0.5)
    choose_gemv(layers + fp32, timer)
    per_shape = sum(1 + len(tile_candidates(b)) for b in ROW_BUCKETS)
    assert timer.calls == 2 * per_shape  # two distinct half-precision shapes
    assert layers[0].kernel.tiles == layers[1].kernel.tiles != {}
    assert fp32[0].kernel is None


def test_choose_never_takes_a_tile_that_disagrees(monkeypatch):
    (layer,) = half_layers((24, 256))
    real = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda x, w, b, bn, bk: real(x, w, b, bn, bk) + 1)
    assert choose_gemv([layer], ScriptedTimer(cublas_ms=1.0, kernel_ms=0.1)) == {1: 0, 2: 0, 4: 0}
    assert layer.kernel is None


def test_choose_skips_tiles_that_would_leave_sms_idle(monkeypatch):
    """With 16 programs needed, a 24-row weight only fits BLOCK_N = 2 (12 programs: the narrowest,
    always kept); wider tiles are neither compiled nor timed."""
    monkeypatch.setattr(gemv_module, "min_programs", lambda device: 16)
    (layer,) = half_layers((24, 256))
    timer = ScriptedTimer(cublas_ms=1.0, kernel_ms=0.5)
    choose_gemv([layer], timer)
    narrow = sum(1 + sum(bn == 2 for bn, _ in tile_candidates(b)) for b in ROW_BUCKETS)
    assert timer.calls == narrow
    assert all(bn == 2 for bn, _ in layer.kernel.tiles.values())
