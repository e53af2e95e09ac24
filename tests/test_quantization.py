"""Weight-only quantization (engine/quantization): the CPU kernels against the dequantized reference,
the quantizers' error bounds and the layout's validation, the load-time kernel choice, and the
engine end to end against a float32 model whose checkpoint holds the dequantized weights.

Tolerances: DequantMatmul runs in float32 and matches `x @ W^T` to float32 rounding. The int4pack
kernels (Int4PackMatmul, SplitInt4Matmul, Int8PackMatmul) round the activations, the scales and
the zeros to bf16 (relative error 2^-9 each) and return bf16, so their error per output is bounded
by a few 2^-9 times sum_k |x_k| * |w_nk|, with |w_nk| taken as the largest magnitude its group can
represent (the zero's rounding scales with that, not with w_nk itself). We allow 2^-7 times that
sum, about 3x the worst seen over many seeds (1.4 * 2^-9); a wrong nibble order, zero or scale errs
by the sum's order. (One code off by one step is below any bf16 tolerance: DequantMatmul's float32
bound, 2e-6, is the exact check of the layout.)
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.quantization import chooser, kernels
from engine.quantization.chooser import choose_matmul
from engine.quantization.kernels import (
    DenseMatmul,
    DequantMatmul,
    GroupedInt8Matmul,
    HalvesSplitInt4Matmul,
    Int4PackMatmul,
    Int8PackMatmul,
    SplitInt4Matmul,
)
from engine.quantization.layout import QuantizedWeight, quantize_int4, quantize_int8
from engine.quantization.methods import head_method
from engine.quantization.modules import KernelTarget, QuantizedLinear
from tests.quantized_weights import logprob_differences, only_dequant
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


# ---- the quantizers and the layout ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n,k,group", [(64, 80, 32), (64, 80, 64), (32, 256, 128), (16, 40, 64)])
def test_quantize_int4_error_is_at_most_half_a_step(n, k, group):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(k + group)) * 0.15
    qw = quantize_int4(w, group)
    groups = -(-k // group)
    assert qw.shape == (n, k) and qw.scale.shape == qw.offset.shape == (n, groups) and qw.group_size == group
    assert qw.q.dtype == torch.uint8 and int(qw.q.max()) <= 15
    step = qw.scale.repeat_interleave(group, dim=1)[:, :k]
    error = (qw.dequantize() - w).abs()
    assert (error <= step / 2 * (1 + 1e-5)).all(), f"{(error / step).max():.4f} steps"
    # codes use the whole range: the step is the group's range / 15, up to bf16 rounding
    assert (qw.q.amin(dim=1) == 0).all() and (qw.q.amax(dim=1) == 15).all()


def test_quantize_int4_scales_and_zeros_are_bf16_exact():
    """The int4pack kernel takes (scale, zero = offset + 8 * scale) in bf16: both must survive that exactly,
    so the kernel computes the same weights as `dequantize`."""
    qw = quantize_int4(torch.randn(40, 80) * 0.3 + 0.05, 32)
    zero = qw.offset + 8 * qw.scale
    assert torch.equal(qw.scale.bfloat16().float(), qw.scale)
    assert torch.equal(zero.bfloat16().float(), zero)
    packed = Int4PackMatmul(qw, torch.float32).scales_and_zeros  # [groups, N padded to 48, 2]
    assert torch.equal(packed[:, :40, 0].float().T, qw.scale)
    assert torch.equal(packed[:, :40, 1].float().T, zero)


def test_quantize_int4_last_short_group_takes_its_range_from_real_columns():
    """K = 80 in groups of 32: the last group has 16 columns. Values far from zero there would show
    a range widened by the zero padding."""
    w = torch.randn(8, 80) * 0.1
    w[:, 64:] = 3.0 + torch.rand(8, 16)  # in [3, 4): the padding's zeros would widen it to [0, 4)
    qw = quantize_int4(w, 32)
    span = w[:, 64:].amax(1) - w[:, 64:].amin(1)
    torch.testing.assert_close(qw.scale[:, 2], span / 15, rtol=2**-8, atol=0)
    assert ((qw.dequantize() - w).abs()[:, 64:] <= qw.scale[:, 2:] / 2 + 2**-9 * 4).all()


def test_quantize_int4_group_far_from_zero_errs_by_at_most_bf16_rounding_of_the_values():
    """A group whose values sit far from zero in a narrow band: the zero point must be a bf16 value
    (for the kernels), so it can miss by more than a step. The error then stays below the bf16
    rounding of the values themselves: no worse than the model in bf16. (Real weights' groups
    straddle zero, where the half-step bound above holds.)"""
    w = 100 + torch.rand(4, 64) * 0.1
    qw = quantize_int4(w, 32)
    error = (qw.dequantize() - w).abs()
    assert error.max() <= 2**-9 * w.abs().max() + qw.scale.max() / 2


def test_quantize_int8_round_trip():
    w = torch.randn(40, 80) * 0.2
    w[3] = 0  # an all-zero row keeps a positive scale
    qw = quantize_int8(w)
    assert (qw.bits, qw.group_size, qw.offset, qw.source) == (8, 80, None, "int8")
    assert qw.q.dtype == torch.int8 and qw.scale.shape == (40, 1) and (qw.scale > 0).all()
    assert torch.equal(qw.scale.bfloat16().float(), qw.scale)  # the int8 kernel's bf16 scale is exact
    assert ((qw.dequantize() - w).abs() <= qw.scale / 2 * (1 + 1e-5)).all()
    assert (qw.q[torch.arange(40) != 3].abs().amax(1) == 127).all()
    assert torch.equal(qw.dequantize()[3], torch.zeros(80))
    again = quantize_int8(qw.dequantize())  # dequantized weights quantize back to the same codes and scales
    assert torch.equal(again.q, qw.q) and torch.equal(again.scale, qw.scale)


def test_quantized_weight_rows_and_bytes():
    qw = make_weight(4, 10, 80, 32, True)
    part = qw.rows(2, 5)
    assert part.shape == (5, 80) and torch.equal(part.dequantize(), qw.dequantize()[2:7])
    assert qw.nbytes == 10 * 80 // 2 + 2 * 10 * 3 * 4  # two codes a byte, float32 scale and offset per group
    assert make_weight(8, 10, 80, 80, False).nbytes == 10 * 80 + 10 * 4


def test_quantized_weight_validation():
    q4, q8 = torch.zeros(4, 80, dtype=torch.uint8), torch.zeros(4, 80, dtype=torch.int8)
    ones = torch.ones(4, 3)
    with pytest.raises(ValueError, match="4 or 8 bits, not 3"):
        QuantizedWeight(3, q4, ones, None, 32, "x")
    with pytest.raises(ValueError, match="must be a matrix"):
        QuantizedWeight(4, q4[0], ones, None, 32, "x")
    with pytest.raises(ValueError, match="4-bit codes are torch.uint8, got torch.int8"):
        QuantizedWeight(4, q8, ones, None, 32, "x")
    with pytest.raises(ValueError, match="8-bit codes are torch.int8"):
        QuantizedWeight(8, q4, ones, None, 32, "x")
    with pytest.raises(ValueError, match=r"scale has shape \(4, 2\).*need \(4, 3\)"):
        QuantizedWeight(4, q4, torch.ones(4, 2), None, 32, "x")
    with pytest.raises(ValueError, match=r"offset has shape \(3, 3\)"):
        QuantizedWeight(4, q4, ones, torch.ones(3, 3), 32, "x")
    with pytest.raises(ValueError, match="group_size"):
        QuantizedWeight(4, q4, ones, None, 0, "x")
    with pytest.raises(ValueError, match="group_size must be positive"):
        quantize_int4(torch.ones(4, 80), 0)


# ---- the engine ------------------------------------------------------------------------------------------------------

# what the pass swaps: the linear layers, the head and the table
QUANTIZED_TENSORS = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")


def dequantized_copy(src: Path, dst: Path, method: str, group_size: int) -> Path:
    """`src` with every tensor the engine quantizes replaced by its quantized-then-dequantized value,
    in float32: what a quantized engine computes, as a plain checkpoint."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tied = json.loads((src / "config.json").read_text()).get("tie_word_embeddings", False)
    for file in sorted(src.glob("*.safetensors")):
        tensors = load_file(file)
        for name, t in tensors.items():
            if name.endswith(QUANTIZED_TENSORS):
                # the engine's rule: under int4 the head (and a tied embedding, its table) is int8
                table = name.endswith("lm_head.weight") or (tied and name.endswith("embed_tokens.weight"))
                how = head_method(method) if table else method
                qw = quantize_int8(t) if how == "int8" else quantize_int4(t, group_size)
                tensors[name] = qw.dequantize()
            else:
                tensors[name] = t.float()
        save_file(tensors, dst / file.name, metadata={"format": "pt"})
    return dst


@pytest.fixture
def forced_dequant(monkeypatch):
    """Every quantized weight on the float32 DequantMatmul: the engine then computes with exactly the
    dequantized weights, so it must equal a float32 model holding them up to summation order."""
    monkeypatch.setattr(chooser, "_CHOICES", {})
    monkeypatch.setattr(chooser, "candidates", only_dequant)


@pytest.fixture(scope="module")
def references(tiny_models, tmp_path_factory):
    """`references(family, method, group_size)`: (dequantized folder, its float32 LLM), built once."""
    cache = {}

    def get(family: str, method: str, group_size: int):
        key = (family, method, group_size)
        if key not in cache:
            folder = dequantized_copy(tiny_models[family], tmp_path_factory.mktemp("deq") / family, method, group_size)
            cache[key] = folder, LLM(str(folder), dtype="float32", num_kvcache_blocks=64)
        return cache[key]

    return get


def run(llm, prompts, max_tokens=8, k=20):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=k, prompt_logprobs=k)
    return llm.generate(prompts, params, use_tqdm=False)


def logprob_rows(result) -> list[dict[int, float]]:
    """Every position's {token: logprob}: the prompt's (after the first token), then the output's."""
    return [*result["prompt_logprobs"][1:], *result["logprobs"]]


def compare_rows(got: list[dict], want: list[dict], atol: float, min_common: int, mean_atol: float | None = None):
    """Values agree within `atol` (and on average within `mean_atol`) on the tokens both rows list: a
    top-k can swap members that tie within the tolerance."""
    diffs = logprob_differences(got, want, min_common)
    worst, mean = max(diffs), sum(diffs) / len(diffs)
    assert worst <= atol, f"logprobs differ by up to {worst:.3g} (allowed {atol})"
    assert mean_atol is None or mean <= mean_atol, f"logprobs differ by {mean:.3g} on average (allowed {mean_atol})"


METHODS = [("int4", 32), ("int8", 64)]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("method,group_size", METHODS, ids=[m for m, _ in METHODS])
def test_quantized_engine_equals_float32_model_of_dequantized_weights(
    family, method, group_size, tiny_models, references, forced_dequant, random_prompt
):
    _, reference = references(family, method, group_size)
    llm = LLM(
        str(tiny_models[family]),
        dtype="float32",
        num_kvcache_blocks=64,
        quantization=method,
        quantization_group_size=group_size,
    )
    assert "DequantMatmul" in llm.stats().matmul and "DequantMatmul" in str(llm.model_runner.model)
    prompts = [random_prompt(21, 7), random_prompt(5, 8)]
    got, want = run(llm, prompts), run(reference, prompts)
    for g, w in zip(got, want):
        assert g["token_ids"] == w["token_ids"]
        # float32 both sides; only the order of the sums differs (oneDNN's packed matmul vs F.linear)
        compare_rows(logprob_rows(g), logprob_rows(w), atol=2e-5, min_common=20)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("method,group_size", METHODS, ids=[m for m, _ in METHODS])
def test_quantized_engine_with_chosen_kernels_agrees_within_bf16(
    family, method, group_size, tiny_models, references, random_prompt
):
    """The kernels chosen by measurement run bf16 activations: the same positions (teacher-forced on the
    reference's greedy reply, so a near-tie flipping a token cannot shift them) give logprobs within a
    bf16 tolerance. Measured: up to 0.09 apart, 0.019 on average, over logprobs spanning 0..-12. The
    original (unquantized) weights differ from the reference by 0.26 / 0.05 (int8) and 2.5 / 0.5
    (int4): the mean bound would catch even a kernel computing the unquantized weights."""
    _, reference = references(family, method, group_size)
    llm = LLM(
        str(tiny_models[family]),
        dtype="float32",
        num_kvcache_blocks=64,
        quantization=method,
        quantization_group_size=group_size,
    )
    # int4's groups of 32 may go to Pagoda's own kernel (8-bit rounded rows) where it measures faster here
    kernels_run = {"int4": ("Int4PackMatmul", "GroupedInt8Matmul"), "int8": ("Int8PackMatmul",)}[method]
    assert any(k in llm.stats().matmul and k in str(llm.model_runner.model) for k in kernels_run)
    prompt = random_prompt(21, 7)
    sequence = prompt + run(reference, [prompt])[0]["token_ids"]
    got, want = run(llm, [sequence], max_tokens=1), run(reference, [sequence], max_tokens=1)
    compare_rows(logprob_rows(got[0])[:-1], logprob_rows(want[0])[:-1], atol=0.2, min_common=15, mean_atol=0.035)


@pytest.mark.parametrize("method,ratio", [("int8", 0.30), ("int4", 0.22)])
def test_tied_model_bytes(method, ratio, tiny_llama, monkeypatch):
    """The tiny llama ties its head to a 320 x 64 table; its linear weights and table hold 94k values
    against 320 norm values, so norms are 0.3% of the float32 bytes and the ratio is the weights'.
    int8: 1 byte a weight plus a scale per row, the table counted once (shared with the head's codes),
    about 0.26x; a second copy of the table would push it past 0.30x. int4: half a byte plus a bf16
    scale and zero per group of 64 in the kernels, the table's own codes apart, about 0.18x.
    These are the packed kernels' layouts: a loaded CI machine once timed the dequantizing fallback
    faster at these tiny shapes (0.32x and 0.24x), so the timer ranks it last here."""
    monkeypatch.setattr(chooser, "_CHOICES", {})
    monkeypatch.setattr(
        chooser, "_seconds_per_call", lambda kernel, x, calls=20: 1.0 if isinstance(kernel, DequantMatmul) else 0.5
    )
    fp32_bytes = 4 * sum(t.numel() for f in tiny_llama.glob("*.safetensors") for t in load_file(f).values())
    llm = LLM(str(tiny_llama), dtype="float32", num_kvcache_blocks=64, quantization=method)
    held = llm.parameter_bytes()[0]
    assert held <= ratio * fp32_bytes, f"{held} bytes is {held / fp32_bytes:.3f}x float32"
    model = llm.model_runner.model
    head, embedding = model.lm_head.parts[0], model.model.embed_tokens
    assert isinstance(head, Int8PackMatmul)  # int8 under int4 too (head_method)
    # the table is the head's codes, not a copy: the embedding reads its rows there
    assert embedding.table is None and embedding.rows_from_head == head.looked_up_rows
    assert f"{method}:" in str(model)  # print(model) says what the weights are


def test_print_model_and_stats_name_the_kernels(tiny_qwen2, monkeypatch):
    # Kernels are chosen by timing, and a loaded machine once timed the slab fallback faster at these tiny
    # shapes: a timer that ranks it last (and no choices left from earlier tests) makes the names certain.
    monkeypatch.setattr(chooser, "_CHOICES", {})
    monkeypatch.setattr(
        chooser, "_seconds_per_call", lambda kernel, x, calls=20: 1.0 if isinstance(kernel, DequantMatmul) else 0.5
    )
    llm = LLM(str(tiny_qwen2), dtype="float32", num_kvcache_blocks=64, quantization="int4", quantization_group_size=32)
    text, matmul = str(llm.model_runner.model), llm.stats().matmul
    assert "Int4PackMatmul(" in text and "int4: 4-bit, groups of 32" in text and "QuantizedEmbedding(" in text
    # qkv, o, gate_up, down per layer (2 layers) at int4, and the head at int8: named with their counts
    assert matmul == "Int4PackMatmul x8, Int8PackMatmul x1", matmul
    assert llm.stats().quantization == "int4 (groups of 32; LM head int8)"


# ---- errors ----------------------------------------------------------------------------------------------------------


def test_unknown_quantization_names_the_choices(tiny_llama):
    with pytest.raises(ValueError, match=r"quantization must be one of \('int8', 'int4'\).*'fp4'"):
        LLM(str(tiny_llama), quantization="fp4")


def test_quantization_with_tensor_parallel_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(tiny_llama), quantization="int8", tensor_parallel_size=2, device="cpu")


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_checkpoint_quantized_by_another_tool_is_refused(quantization, tiny_llama, tmp_path):
    folder = tmp_path / "gptq"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"already quantized with gptq.*full-precision checkpoint"):
        LLM(str(folder), quantization=quantization)
