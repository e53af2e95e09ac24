"""The ways to multiply by one weight: each a module that holds the weight in the layout its kernel
reads, so `print(model)` shows what runs. `choose_matmul` builds the candidates that apply to a
weight, checks each against the dequantized reference and keeps the fastest at decode's one row.

CPU candidates (measured on a 2-core AVX-512 machine, one row, bf16 activations; bench/RESULTS.md):
PyTorch's own weight-only kernels read 4- and 8-bit codes at about twice the speed oneDNN reads
bf16 weights, and five times float32. They take bf16 activations: with float32 ones they fall
back to scalar code 20-40x slower, so they run in bf16 and cast back.
- Int4PackMatmul: `_weight_int4pack_mm_for_cpu`, 4-bit codes in groups of 32/64/128/256.
- Int8PackMatmul: `_weight_int8pack_mm`, 8-bit codes with one scale per row (the int8 setting).
- SplitInt4Matmul: 8-bit codes in groups of 32 (GGUF Q8_0, Q5_*): each code is 16*hi + lo with hi
  and lo 4-bit, so the product is two 4-bit products, each exact.
- DequantMatmul: any layout; dequantizes a slab of rows at a time into the activations' dtype and
  multiplies it, so no whole weight is ever expanded. The fallback, and the reference's speed.
- DenseMatmul: a full-precision weight (a GGUF F16 tensor, say), oneDNN-packed on the CPU.
"""
import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.quantization.layout import QuantizedWeight

log = logging.getLogger("engine")

INT4PACK_GROUPS = (32, 64, 128, 256)
DEQUANT_SLAB_BYTES = 8 << 20  # rows dequantized per step of DequantMatmul: a few MB stay in cache


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad_columns(x: torch.Tensor, k: int) -> torch.Tensor:
    return x if x.shape[-1] == k else F.pad(x, (0, k - x.shape[-1]))


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 as [N, ceil(K / 2)] bytes, column 2j in the low nibble."""
    if codes.shape[1] % 2:
        codes = F.pad(codes, (0, 1))
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor, k: int) -> torch.Tensor:
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(1)[:, :k]


class DenseMatmul(nn.Module):
    """x W^T with W in full precision: oneDNN's packed copy on the CPU where it takes the dtype."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, onednn: bool):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        weight = weight.to(dtype)
        self.onednn = onednn
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight) if onednn else weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.weight.dtype}{', onednn' if self.onednn else ''}"


class QuantizedMatmul(nn.Module):
    """A kernel over one QuantizedWeight; subclasses keep it in the layout their kernel reads."""

    def __init__(self, qw: QuantizedWeight):
        super().__init__()
        self.out_features, self.in_features = qw.shape
        self.bits, self.group_size, self.source = qw.bits, qw.group_size, qw.source

    def extra_repr(self) -> str:
        group = "per row" if self.group_size >= self.in_features else f"groups of {self.group_size}"
        return f"{self.in_features} -> {self.out_features}, {self.source}: {self.bits}-bit, {group}"


class DequantMatmul(QuantizedMatmul):
    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype):
        super().__init__(qw)
        self.codes = pack_nibbles(qw.q) if qw.bits == 4 else qw.q
        self.scale = qw.scale.clone()
        self.offset = None if qw.offset is None else qw.offset.clone()
        self.dtype = dtype
        self.slab = max(1, DEQUANT_SLAB_BYTES // (self.in_features * 4))

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        codes = self.codes[start:stop]
        if self.bits == 4:
            codes = unpack_nibbles(codes, self.in_features)
        k, g = self.in_features, self.group_size
        w = codes.float() * self.scale[start:stop].repeat_interleave(g, dim=1)[:, :k]
        if self.offset is not None:
            w += self.offset[start:stop].repeat_interleave(g, dim=1)[:, :k]
        return w.to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if self.out_features <= self.slab:
            return F.linear(x, self.dequantize_rows(0, self.out_features))
        return torch.cat([F.linear(x, self.dequantize_rows(start, start + self.slab))
                          for start in range(0, self.out_features, self.slab)], dim=-1)


def _int4pack_scales_and_zeros(scale: torch.Tensor, offset: torch.Tensor | None, n: int) -> torch.Tensor:
    """PyTorch's int4 kernels compute w = (q - 8) * scale + zero: zero = offset + 8 * scale,
    as [groups, N, 2] in bf16, padded with zero rows to `n`."""
    zero = 8 * scale if offset is None else offset + 8 * scale
    pairs = torch.stack((scale, zero), dim=-1).transpose(0, 1)  # [groups, N, 2]
    return F.pad(pairs, (0, 0, 0, n - scale.shape[0])).to(torch.bfloat16).contiguous()


class Int4PackMatmul(QuantizedMatmul):
    """4-bit codes in PyTorch's CPU int4 layout; scales and zeros are rounded to bf16."""

    @staticmethod
    def applies(qw: QuantizedWeight, device: torch.device) -> bool:
        return device.type == "cpu" and qw.bits == 4 and qw.group_size in INT4PACK_GROUPS

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype):
        super().__init__(qw)
        self.dtype = dtype
        n, k = _round_up(qw.shape[0], 16), _round_up(qw.shape[1], qw.group_size)
        self.padded_k = k
        codes = F.pad(qw.q.to(torch.int32), (0, k - qw.shape[1], 0, n - qw.shape[0]))
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        groups = k // qw.group_size
        scale = F.pad(qw.scale, (0, groups - qw.scale.shape[1]))
        offset = None if qw.offset is None else F.pad(qw.offset, (0, groups - qw.offset.shape[1]))
        self.scales_and_zeros = _int4pack_scales_and_zeros(scale, offset, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _pad_columns(x.to(torch.bfloat16), self.padded_k)  # zero activations make the pad columns count nothing
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)
        return y[:, : self.out_features].to(self.dtype)


class Int8PackMatmul(QuantizedMatmul):
    """8-bit symmetric codes with one scale per row: PyTorch's weight-only int8 kernel."""

    @staticmethod
    def applies(qw: QuantizedWeight, device: torch.device) -> bool:
        # The kernel reads K in steps of 16 with no tail: other K give garbage or a segfault (torch 2.13 CPU).
        return (device.type == "cpu" and qw.bits == 8 and qw.group_size >= qw.shape[1] and qw.offset is None
                and qw.shape[1] % 16 == 0)

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype):
        super().__init__(qw)
        self.dtype = dtype
        self.codes = qw.q.contiguous()
        self.scale = qw.scale[:, 0].to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.codes, self.scale).to(self.dtype)


class SplitInt4Matmul(QuantizedMatmul):
    """8-bit codes in groups the int4 kernel takes, as two exact 4-bit products: a code c in
    -128..127 is 16 * hi + lo - 128 with hi, lo in 0..15, so w = 16s * hi + s * lo + (offset - 128s)."""

    @staticmethod
    def applies(qw: QuantizedWeight, device: torch.device) -> bool:
        return device.type == "cpu" and qw.bits == 8 and qw.group_size in INT4PACK_GROUPS

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype):
        super().__init__(qw)
        unsigned = (qw.q.to(torch.int16) + 128).to(torch.uint8)
        offset = -128 * qw.scale if qw.offset is None else qw.offset - 128 * qw.scale
        hi = QuantizedWeight(4, unsigned >> 4, 16 * qw.scale, offset, qw.group_size, qw.source)
        lo = QuantizedWeight(4, unsigned & 15, qw.scale, None, qw.group_size, qw.source)
        self.high, self.low = Int4PackMatmul(hi, dtype), Int4PackMatmul(lo, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.high(x) + self.low(x)


def candidates(qw: QuantizedWeight, device: torch.device, dtype: torch.dtype) -> list[Callable[[], nn.Module]]:
    """Constructors of every kernel that can multiply by `qw` here, the fallback last."""
    made = [lambda cls=cls: cls(qw, dtype) for cls in (Int4PackMatmul, Int8PackMatmul, SplitInt4Matmul)
            if cls.applies(qw, device)]
    return [*made, lambda: DequantMatmul(qw, dtype)]


def _seconds_per_call(kernel: nn.Module, x: torch.Tensor, calls: int = 20) -> float:
    kernel(x)  # first-call costs (allocator, one-time dispatch) are not the kernel's speed
    start = time.perf_counter()
    for _ in range(calls):
        kernel(x)
    return (time.perf_counter() - start) / calls


_CHOICES: dict[tuple, int] = {}  # layers of one shape and layout measure once per process


@torch.inference_mode()
def choose_matmul(qw: QuantizedWeight, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The fastest kernel for `qw` at one row that agrees with the dequantized reference."""
    makers = candidates(qw, device, dtype)
    key = (qw.shape, qw.bits, qw.group_size, qw.offset is None, device.type, dtype)
    if len(makers) == 1:
        return makers[0]()
    if key in _CHOICES:
        return makers[_CHOICES[key]]()
    x = torch.randn(1, qw.shape[1], device=device, dtype=dtype)
    reference = F.linear(x.float(), qw.dequantize().to(device))
    tolerance = 0.02 * reference.abs().max().item() + 1e-3  # bf16 activations round each product at 2^-8
    best, best_time, best_kernel = None, float("inf"), None
    for i, make in enumerate(makers):
        try:
            kernel = make()
            error = (kernel(x).float() - reference).abs().max().item()
        except RuntimeError as e:  # a kernel this torch build or CPU lacks
            log.info("%s cannot run here: %s", make, str(e).splitlines()[0])
            continue
        if error > tolerance:
            log.warning("%s disagrees with the reference by %.3g on %s; not used", type(kernel).__name__, error,
                        qw.shape)
            continue
        seconds = _seconds_per_call(kernel, x)
        if seconds < best_time:
            best, best_time, best_kernel = i, seconds, kernel
    if best is None:
        raise RuntimeError(f"no kernel multiplies a {qw.source} weight of shape {qw.shape} correctly on {device}")
    _CHOICES[key] = best
    return best_kernel
