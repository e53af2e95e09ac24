"""Weight-only quantization (engine/quantization): the CPU kernels against the dequantized reference,
QuantizedLinear's shards of mixed layouts, and the load-time kernel choice. The quantizers and the
layout are tested in test_quantization_layout.py, the engine end to end in test_quantized_engine.py.

Tolerances: DequantMatmul runs in float32 and matches `x @ W^T` to float32 rounding. The int4pack
kernels (Int4PackMatmul, SplitInt4Matmul, Int8PackMatmul) round the activations, the scales and
the zeros to bf16 (relative error 2^-9 each) and return bf16, so their error per output is bounded
by a few 2^-9 times sum_k |x_k| * |w_nk|, with |w_nk| taken as the largest magnitude its group can
represent (the zero's rounding scales with that, not with w_nk itself). We allow 2^-7 times that
sum, about 3x the worst seen over many seeds (1.4 * 2^-9); a wrong nibble order, zero or scale errs
by the sum's order. (One code off by one step is below any bf16 tolerance: DequantMatmul's float32
bound, 2e-6, is the exact check of the layout.)
"""

import os

import pytest
import torch

from engine.quantization import chooser, kernels
from engine.quantization.chooser import choose_matmul
from engine.quantization.kernels import (
    DenseMatmul,
    DequantMatmul,
    HalvesSplitInt4Matmul,
    Int4PackMatmul,
    Int8PackMatmul,
    SplitInt4Matmul,
)
from engine.quantization.layout import QuantizedWeight, quantize_int4
from engine.quantization.modules import KernelTarget, QuantizedLinear
from engine.quantization.native import GroupedInt8Matmul
from tests.quantized_weights import only_dequant
from tests.quantized_weights import random_quantized_weight as make_weight

CPU = torch.device("cpu")
BF16_BOUND = 2.0**-7  # see the module docstring
ROWS = (1, 3, 17)  # decode, a small batch, a prefill chunk (int4pack pads M internally)


def group_magnitude(qw: QuantizedWeight) -> torch.Tensor:
    """[N, K]: the largest |w| each element's group can represent."""
    low, high = (0, 15) if qw.bits == 4 else (-128, 127)
    offset = torch.zeros_like(qw.scale) if qw.offset is None else qw.offset
    m = torch.maximum((offset + low * qw.scale).abs(), (offset + high * qw.scale).abs())
    return m.repeat_interleave(qw.group_size, dim=1)[:, : qw.shape[1]]


def check_kernel(kernel, qw: QuantizedWeight, rows: int, bound: float, seed: int = 1) -> None:
    x = torch.randn(rows, qw.shape[1], generator=torch.Generator().manual_seed(seed))
    reference = x @ qw.dequantize().T
    got = kernel(x)
    assert got.shape == reference.shape and got.dtype == torch.float32
    allowed = bound * (x.abs() @ group_magnitude(qw).T) + 1e-6
    excess = ((got - reference).abs() - allowed).max().item()
    assert excess <= 0, f"{type(kernel).__name__} {qw.shape} g{qw.group_size} M={rows}: off by {excess:.3g} too much"


# (N, K, group): N never a multiple of 16 (int4pack pads it), K not a multiple of the group, or smaller than it
GROUPED_SHAPES = [(40, 80, 32), (13, 80, 64), (24, 40, 64), (33, 256, 128)]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k,group", GROUPED_SHAPES)
@pytest.mark.parametrize("with_offset", [True, False], ids=["offset", "symmetric"])
def test_int4pack_matmul(rows, n, k, group, with_offset):
    qw = make_weight(4, n, k, group, with_offset)
    assert Int4PackMatmul.applies(qw, CPU)
    check_kernel(Int4PackMatmul(qw, torch.float32), qw, rows, BF16_BOUND)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k,group", GROUPED_SHAPES)
@pytest.mark.parametrize("with_offset", [True, False], ids=["offset", "symmetric"])
def test_split_int4_matmul(rows, n, k, group, with_offset):
    """8-bit grouped codes (GGUF Q8_0 is symmetric, Q5_1 has offsets) as two exact 4-bit products."""
    qw = make_weight(8, n, k, group, with_offset)
    assert SplitInt4Matmul.applies(qw, CPU)
    check_kernel(SplitInt4Matmul(qw, torch.float32), qw, rows, BF16_BOUND)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k", [(40, 80), (13, 64), (64, 256), (7, 24)])
def test_halves_split_int4_matmul(rows, n, k):
    """6-bit codes in groups of 16 (GGUF Q6_K) as four exact 4-bit products, each half of a 32-column
    group with its own scale; K need not fill the last group."""
    qw = make_weight(8, n, k, 16, with_offset=False)
    qw.q = qw.q.clamp(-32, 31)
    assert HalvesSplitInt4Matmul.applies(qw, CPU)
    check_kernel(HalvesSplitInt4Matmul(qw, torch.float32), qw, rows, BF16_BOUND)
    wide = make_weight(8, n, k, 16, with_offset=False)  # codes beyond 6 bits: not this kernel's
    assert not HalvesSplitInt4Matmul.applies(wide, CPU)


def _q6_k_like(n: int, k: int, seed: int = 0) -> QuantizedWeight:
    qw = make_weight(8, n, k, 16, with_offset=False, seed=seed)
    qw.q = qw.q.clamp(-32, 31)
    return qw


def _int4pack_of(kernel) -> Int4PackMatmul:
    return kernel if isinstance(kernel, Int4PackMatmul) else kernel.joined


@pytest.mark.parametrize("n", [200, 256])  # 200: the last slab of rows is shorter than the others
@pytest.mark.parametrize("cls", [Int4PackMatmul, SplitInt4Matmul, HalvesSplitInt4Matmul])
def test_packing_a_slab_of_rows_at_a_time_gives_the_bytes_of_packing_whole(cls, n, monkeypatch):
    """The int4 kernels pack their codes (SplitInt4Matmul and HalvesSplitInt4Matmul make their terms too) a slab
    of rows at a time, so that no int32 copy of a whole weight is ever made: the bytes are those of one step."""
    qw = {
        Int4PackMatmul: lambda: make_weight(4, n, 96, 32, True),
        SplitInt4Matmul: lambda: make_weight(8, n, 96, 32, True),
        HalvesSplitInt4Matmul: lambda: _q6_k_like(n, 96),
    }[cls]()
    whole = _int4pack_of(cls(qw, torch.float32))  # this small weight packs in one step by default
    monkeypatch.setattr(kernels, "PACK_SLAB_VALUES", 1)  # 64 rows a step
    sliced = cls(qw, torch.float32)
    packed = _int4pack_of(sliced)
    assert torch.equal(packed.packed, whole.packed) and torch.equal(packed.scales_and_zeros, whole.scales_and_zeros)
    assert packed.layout_block == whole.layout_block
    check_kernel(sliced, qw, 3, BF16_BOUND)


@pytest.mark.parametrize(
    "make",
    [
        lambda: (Int4PackMatmul, make_weight(4, 64, 80, 32, True)),
        lambda: (SplitInt4Matmul, make_weight(8, 64, 80, 32, True)),
        lambda: (HalvesSplitInt4Matmul, _q6_k_like(64, 80)),
        lambda: (Int8PackMatmul, make_weight(8, 64, 80, 80, False)),
        lambda: (DequantMatmul, make_weight(4, 40, 80, 32, True)),
        lambda: (DequantMatmul, _q6_k_like(40, 80)),
    ],
    ids=["int4pack", "split", "halves-split", "int8pack", "dequant-4bit", "dequant-8bit"],
)
def test_kernels_give_back_rows_of_their_weight(make):
    """A tied embedding reads its rows from the head's kernel instead of holding the table again: the rows must be
    the weight's, up to the bf16 rounding of scales and zeros where the kernel rounds them (exact in DequantMatmul)."""
    cls, qw = make()
    kernel = cls(qw, torch.float32)
    ids = torch.tensor([0, qw.shape[0] - 1, 5, 5, 17])
    rows = kernel.looked_up_rows(ids)
    assert rows is not None and rows.dtype == torch.float32 and rows.shape == (len(ids), qw.shape[1])
    exact = qw.dequantize()[ids]
    if cls is DequantMatmul:
        assert torch.equal(rows, exact)
    else:  # a wrong nibble, row or term errs by the group's whole magnitude
        assert ((rows - exact).abs() <= 2 * BF16_BOUND * group_magnitude(qw)[ids]).all()


@pytest.fixture(scope="module")
def native_kernels():
    """Pagoda's opt-in CPU kernel, built here (tens of seconds, once per machine); Linux CI has a compiler, so
    there it must build."""
    from engine.quantization import native

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGODA_NATIVE_KERNELS", "1")
        mp.setattr(native, "_BUILT", {})
        if native.grouped_int8_mm() is None and not os.environ.get("CI"):
            pytest.skip("Pagoda's CPU kernel cannot be built here (no C++ compiler or ninja)")
        assert native.grouped_int8_mm() is not None, "the kernel did not build on CI"
        yield
        native._BUILT.clear()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(
    "bits,n,k,group",
    [(8, 40, 80, 32), (8, 21, 48, 16), (8, 7, 24, 16), (4, 13, 80, 32), (4, 40, 90, 16), (8, 33, 256, 32)],
)
@pytest.mark.parametrize("with_offset", [True, False], ids=["offset", "symmetric"])
def test_grouped_int8_matmul(rows, bits, n, k, group, with_offset, native_kernels):
    """Pagoda's own kernel: codes of either width in groups of 16 or 32, K not filling the last 32 columns, with
    and without offsets. The row is rounded to 16 bits per group: far inside bf16's bound."""
    qw = make_weight(bits, n, k, group, with_offset)
    assert GroupedInt8Matmul.applies(qw, CPU)
    kernel = GroupedInt8Matmul(qw, torch.float32)
    check_kernel(kernel, qw, rows, BF16_BOUND / 16)
    assert torch.equal(kernel.dequantized_bf16(), qw.dequantize().bfloat16())  # prefill's weight: the exact one
    assert not GroupedInt8Matmul.applies(make_weight(bits, n, k, 64, with_offset), CPU)  # only 16 and 32


def test_prefill_rows_through_the_dequantized_weight_match():
    """From `dense_from_rows` rows a kernel multiplies its weight rebuilt in bf16 from its own packing."""
    for qw, cls in [
        (make_weight(4, 64, 128, 32, True), Int4PackMatmul),
        (make_weight(8, 64, 128, 32, True), SplitInt4Matmul),
        (make_weight(8, 64, 128, 128, False), Int8PackMatmul),
    ]:
        kernel = cls(qw, torch.float32)
        rebuilt = kernel.dequantized_bf16()
        assert rebuilt is not None, cls  # PyTorch's int4 packing of 64-row blocks is the one measured
        # bf16 scales and zeros, and bf16 arithmetic: off by a few bf16 steps of the group's largest value
        assert ((rebuilt.float() - qw.dequantize()).abs() <= 4 * BF16_BOUND * group_magnitude(qw)).all(), cls
        kernel.dense_from_rows = 8
        check_kernel(kernel, qw, 17, BF16_BOUND * 2)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k", [(40, 80), (13, 64), (50, 48)])
def test_int8pack_matmul(rows, n, k):
    qw = make_weight(8, n, k, k, with_offset=False)  # one scale per row: the int8 setting
    assert Int8PackMatmul.applies(qw, CPU)
    check_kernel(Int8PackMatmul(qw, torch.float32), qw, rows, BF16_BOUND)


@pytest.mark.parametrize("k", [33, 40, 8])
def test_int8pack_is_not_used_where_k_is_not_a_multiple_of_16(k):
    """torch's int8pack kernel returns garbage for such K, or segfaults (which no measurement survives)."""
    qw = make_weight(8, 24, k, k, with_offset=False)
    assert not Int8PackMatmul.applies(qw, CPU)
    check_kernel(choose_matmul(qw, CPU, torch.float32), qw, 3, 2e-6)  # the float32 fallback


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(
    "bits,n,k,group",
    [(4, 40, 80, 32), (4, 13, 80, 64), (8, 40, 80, 32), (8, 21, 48, 16), (8, 13, 80, 80), (4, 7, 90, 256)],
)
@pytest.mark.parametrize("with_offset", [True, False], ids=["offset", "symmetric"])
def test_dequant_matmul_is_float32_exact(rows, bits, n, k, group, with_offset, monkeypatch):
    qw = make_weight(bits, n, k, group, with_offset)
    check_kernel(DequantMatmul(qw, torch.float32), qw, rows, 2e-6)
    # and slab by slab, as a large weight runs (4-bit codes are unpacked per slab)
    monkeypatch.setattr(kernels, "DEQUANT_SLAB_BYTES", 3 * k * 4)
    sliced = DequantMatmul(qw, torch.float32)
    assert sliced.slab == 3
    check_kernel(sliced, qw, rows, 2e-6)


def test_kernels_apply_only_where_their_layout_fits():
    assert not Int4PackMatmul.applies(make_weight(4, 16, 80, 16, True), CPU)  # group 16: no int4pack variant
    assert not Int4PackMatmul.applies(make_weight(8, 16, 64, 32, True), CPU)
    assert not Int8PackMatmul.applies(make_weight(8, 16, 64, 64, True), CPU)  # an offset: not symmetric
    assert not Int8PackMatmul.applies(make_weight(8, 16, 64, 32, False), CPU)  # grouped, not per row
    assert not SplitInt4Matmul.applies(make_weight(8, 16, 96, 16, False), CPU)  # Q6_K's groups of 16
    assert not Int4PackMatmul.applies(make_weight(4, 16, 64, 32, True), torch.device("meta"))
    qw = make_weight(8, 16, 96, 16, False)
    builders = list(chooser.candidates(qw, CPU, torch.float32).values())
    assert isinstance(builders[-1](qw), DequantMatmul)  # the fallback, and otherwise only Pagoda's own kernel
    assert [type(build(qw)) for build in builders[:-1]] in ([], [GroupedInt8Matmul])


# ---- QuantizedLinear: shards of mixed layouts --------------------------------------------------------------------


def _mixed_shards(k: int) -> list:
    gen = torch.Generator().manual_seed(5)
    q4 = quantize_int4(torch.randn(24, k, generator=gen) * 0.2, 32)
    q4b = quantize_int4(torch.randn(8, k, generator=gen) * 0.2, 32)  # the same layout: joins q4's kernel
    q8_0 = make_weight(8, 16, k, 32, with_offset=False, seed=3)  # like GGUF Q8_0
    q8_0.scale = q8_0.scale * 0.01  # values of a weight's size, so no shard dominates the sum
    dense = torch.randn(12, k, generator=gen) * 0.2
    return [q4, q4b, q8_0, dense]


def _reference(shards, bias, x):
    w = torch.cat([s.dequantize() if isinstance(s, QuantizedWeight) else s for s in shards])
    return x @ w.T + bias


@pytest.mark.parametrize("onednn", [False, True])
def test_quantized_linear_with_mixed_shards_and_bias(onednn, monkeypatch):
    k = 96
    shards = _mixed_shards(k)
    bias = torch.nn.Parameter(torch.randn(sum(s.shape[0] for s in shards)), requires_grad=False)
    target = KernelTarget(CPU, torch.float32, onednn=onednn and torch.backends.mkldnn.is_available())
    linear = QuantizedLinear(k, [s.shape[0] for s in shards], bias, None, 64, target)
    for i in (2, 0, 3, 1):  # shards arrive in any order; the kernels are built when the last one lands
        assert not linear.loaded
        linear.load_quantizable(shards[i], i)
    assert linear.loaded
    assert linear.pending == {}
    # runs of one layout share a kernel: [int4, int4] [Q8_0-like] [dense]
    assert len(linear.parts) == 3 and [p.out_features for p in linear.parts] == [32, 16, 12]
    assert type(linear.parts[0]) in (Int4PackMatmul, GroupedInt8Matmul, DequantMatmul) and linear.parts[0].bits == 4
    assert type(linear.parts[1]) in (SplitInt4Matmul, GroupedInt8Matmul, DequantMatmul) and linear.parts[1].bits == 8
    assert type(linear.parts[2]) is DenseMatmul
    for rows in ROWS:
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        reference = _reference(shards, bias, x)
        got = linear(x)
        assert got.shape == reference.shape
        # the int4pack kernels' bf16 bound, taken loosely over the whole output
        torch.testing.assert_close(got, reference, atol=0.02 * reference.abs().max().item(), rtol=0)

    # with every quantized run forced onto the float32 kernel, it is float32-exact
    monkeypatch.setattr(chooser, "candidates", only_dequant)
    exact = QuantizedLinear(k, [s.shape[0] for s in shards], bias, None, 64, KernelTarget(CPU, torch.float32, False))
    for i, s in enumerate(shards):
        exact.load_quantizable(s, i)
    assert [type(p) for p in exact.parts] == [DequantMatmul, DequantMatmul, DenseMatmul]
    x = torch.randn(5, k)
    torch.testing.assert_close(exact(x), _reference(shards, bias, x), atol=1e-5, rtol=1e-5)


def test_quantized_linear_quantizes_full_precision_shards_and_refuses_quantized_ones():
    k, gen = 64, torch.Generator().manual_seed(0)
    q, v = torch.randn(32, k, generator=gen), torch.randn(16, k, generator=gen)
    linear = QuantizedLinear(k, [32, 16], None, "int4", 32, KernelTarget(CPU, torch.float32, False))
    linear.load_quantizable(q, 0)
    assert isinstance(linear.pending[0], QuantizedWeight) and linear.pending[0].source == "int4"
    assert torch.equal(linear.pending[0].q, quantize_int4(q, 32).q)
    linear.load_quantizable(v, 1)  # the last shard: the layer builds its kernel and drops the codes it held
    assert linear.pending == {} and [(p.bits, p.source, p.out_features) for p in linear.parts] == [(4, "int4", 48)]
    linear = QuantizedLinear(k, [32, 16], None, "int4", 32, KernelTarget(CPU, torch.float32, False))
    with pytest.raises(ValueError, match=r"already quantized \(Q8_0\).*quantization='int4'"):
        linear.load_quantizable(
            QuantizedWeight(8, torch.zeros(32, k, dtype=torch.int8), torch.ones(32, 2), None, 32, "Q8_0"), 0
        )
    with pytest.raises(ValueError, match=r"gives shape \(16, 64\), the model expects \(32, 64\)"):
        linear.load_quantizable(v, 0)


# ---- choose_matmul --------------------------------------------------------------------------------------------------


class _Wrong(torch.nn.Module):
    """A fast kernel with a bug: `kind` "scale" is 5% off everywhere (a scale rounded wrong);
    "tail" zeroes the last output (a padding bug, like int4pack's rows past N)."""

    def __init__(self, qw: QuantizedWeight, kind: str):
        super().__init__()
        self.w, self.kind = qw.dequantize(), kind

    def forward(self, x):
        y = x.float() @ self.w.T
        if self.kind == "scale":
            return y * 1.05
        y[..., -1] = 0
        return y


class _Raises(torch.nn.Module):
    def __init__(self, qw: QuantizedWeight):
        raise RuntimeError("this CPU lacks the instructions\nsecond line")


@pytest.fixture
def fresh_choices(monkeypatch):
    monkeypatch.setattr(chooser, "_CHOICES", {})  # each test measures afresh


@pytest.mark.parametrize("kind", ["scale", "tail"])
def test_choose_matmul_never_picks_a_kernel_that_disagrees(kind, monkeypatch, fresh_choices):
    """choose_matmul allows 2% of the output's largest magnitude (bf16 activations): a kernel wrong by
    less on a few outputs would pass, so the last row here carries the largest outputs."""
    w = torch.randn(48, 256) * 0.1
    w[-1] *= 4
    qw = quantize_int4(w, 64)
    wrong_made = []

    def candidates(qw, device, dtype):
        def wrong(w):
            wrong_made.append(1)
            return _Wrong(w, kind)

        return {"wrong": wrong, "DequantMatmul": lambda w: DequantMatmul(w, dtype)}

    monkeypatch.setattr(chooser, "candidates", candidates)
    torch.manual_seed(0)  # choose_matmul's probe row
    chosen = choose_matmul(qw, CPU, torch.float32)
    assert wrong_made, "the broken candidate was never tried"
    assert isinstance(chosen, DequantMatmul)
    # the choice is remembered for layers of this shape: a second layer gets the fallback without measuring
    assert isinstance(choose_matmul(qw, CPU, torch.float32), DequantMatmul) and len(wrong_made) == 1


def test_choose_matmul_falls_back_when_a_candidate_raises(monkeypatch, fresh_choices):
    qw = quantize_int4(torch.randn(48, 256) * 0.1, 64)
    real = chooser.candidates
    monkeypatch.setattr(chooser, "candidates", lambda qw, device, dtype: {"raises": _Raises, **real(qw, device, dtype)})
    chosen = choose_matmul(qw, CPU, torch.float32)
    assert type(chosen) in (Int4PackMatmul, DequantMatmul)
    check_kernel(chosen, qw, 3, BF16_BOUND)


def test_choose_matmul_without_any_working_kernel_names_the_weight(monkeypatch, fresh_choices):
    qw = quantize_int4(torch.randn(48, 256) * 0.1, 64)
    monkeypatch.setattr(
        chooser, "candidates", lambda qw, device, dtype: {"raises": _Raises, "wrong": lambda w: _Wrong(w, "scale")}
    )
    with pytest.raises(RuntimeError, match=r"no kernel multiplies a int4 weight of shape \(48, 256\)"):
        choose_matmul(qw, CPU, torch.float32)


def test_choose_matmul_picks_a_kernel_that_agrees_on_real_layouts(fresh_choices):
    for qw in (
        make_weight(4, 40, 80, 32, True),
        make_weight(8, 40, 80, 32, False),
        make_weight(8, 40, 80, 80, False),
        make_weight(8, 40, 96, 16, False),
    ):
        check_kernel(choose_matmul(qw, CPU, torch.float32), qw, 17, BF16_BOUND)
