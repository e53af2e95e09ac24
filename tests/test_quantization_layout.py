"""engine/quantization/layout.py: the quantizers' error bounds (int4 within half a step, its scales and zeros
exact in bf16 for the int4pack kernel, int8 round trips) and QuantizedWeight's rows, bytes and validation."""

import pytest
import torch

from engine.quantization.kernels import Int4PackMatmul
from engine.quantization.layout import QuantizedWeight, quantize_int4, quantize_int8
from tests.quantized_weights import random_quantized_weight as make_weight


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
