"""The ways to multiply by one weight: each a module that holds the weight in the layout its kernel
reads, so `print(model)` shows what runs. chooser.py names those that apply to a weight (`candidates`),
measures them and keeps the fastest that agrees with the dequantized reference.

CPU candidates (measured on a 2-core AVX-512 machine, one row, bf16 activations; bench/RESULTS.md):
PyTorch's own weight-only kernels read 4- and 8-bit codes at about twice the speed oneDNN reads
bf16 weights, and five times float32. They take bf16 activations: with float32 ones they fall
back to scalar code 20-40x slower, so they run in bf16 and cast back.
- Int4PackMatmul: `_weight_int4pack_mm_for_cpu`, 4-bit codes in groups of 32/64/128/256.
- Int8PackMatmul: `_weight_int8pack_mm`, 8-bit codes with one scale per row (the int8 setting).
- SplitInt4Matmul: 8-bit codes in groups of 32 (GGUF Q8_0, Q5_*): each code is 16*hi + lo with hi
  and lo 4-bit, so the weight is the sum of two exact 4-bit weights, multiplied side by side in one
  int4 call (SideBySideInt4Matmul).
- HalvesSplitInt4Matmul: 6-bit codes in groups of 16 (GGUF Q6_K) as four exact 4-bit terms, likewise.
- GroupedInt8Matmul (native.py): Pagoda's own kernel (grouped_int8.cpp, compiled for this CPU on first use;
  opt-in with PAGODA_NATIVE_KERNELS=1, native.py says why): codes of any width in groups of 16 or 32 as bytes, times the
  row rounded to 16-bit integers per group, one exact integer dot product per group.
- KQuantMatmul (kquant.py): GGUF's Q4_K, Q5_K, Q6_K, Q8_0, MXFP4, Q4_0 and Q4_1 in the file's own blocks, Pagoda's
  C++ kernel (built on first use where a compiler is), the row rounded to int8 per 256 (or 32) columns as llama.cpp
  does.
- DequantMatmul: any layout; dequantizes a slab of rows at a time into the activations' dtype and
  multiplies it, so no whole weight is ever expanded. The fallback, and the reference's speed.
- DenseMatmul: a full-precision weight (a GGUF F16 tensor, say), oneDNN-packed on the CPU.

On NVIDIA GPUs: TritonQuantMatmul (triton_tiles.py), Pagoda's Triton dequant-GEMV and GEMM (triton_matmul.py; or
tinygemm, tinygemm.py, where it measures faster), any layout.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import in_bucketed_rows, onednn_linear
from engine.quantization.layout import QuantizedWeight
from engine.runner.tracing import tracing_decode_step

INT4PACK_GROUPS = (32, 64, 128, 256)
DEQUANT_SLAB_BYTES = 8 << 20  # rows dequantized per step of DequantMatmul: a few MB stay in cache
# Codes packed per step for PyTorch's int4 kernel, in whole 64-row blocks: its packing op wants int32 codes, so
# packing a whole weight at once took 4 bytes a weight (1.5 GB for a 150k-token table) on top of the weight.
PACK_SLAB_VALUES = 2 << 20


@dataclass(frozen=True)
class WeightOutline:
    """What a kernel module records of its weight, for a weight that is never whole in memory (SideBySideInt4Matmul's
    joined terms, made a slab of rows at a time)."""

    shape: tuple[int, int]
    bits: int
    group_size: int
    source: str

    def __post_init__(self) -> None:
        if self.bits != 4:
            raise ValueError(f"outlines describe the 4-bit weights of joined terms, not {self.bits}-bit ones")


def round_up(n: int, multiple: int) -> int:
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
            return onednn_linear(x, self.weight)
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.weight.dtype}{', onednn' if self.onednn else ''}"


class QuantizedMatmul(nn.Module):
    """A kernel over one QuantizedWeight; subclasses keep it in the layout their kernel reads."""

    # From this many rows up, dequantize the weight to bf16 and multiply that: PyTorch's weight-only
    # kernels are built for few rows, and at prefill's hundreds the one-off dequantization costs less
    # than they lose (measured per shape by `choose_prefill_rows`; None: never).
    dense_from_rows: int | None = None
    # Whether the kernel rounds x coarser than the model's dtype before multiplying (to bf16, to int8 per block):
    # a compiled decode step, which fuses the ops before the kernel and so rounds their results differently, is
    # then held to the looser bound of half precision (engine/runner/compiled_decode.py).
    rounds_activations: bool = False

    def __init__(self, qw: QuantizedWeight | WeightOutline):
        super().__init__()
        self.out_features, self.in_features = qw.shape
        self.bits, self.group_size, self.source = qw.bits, qw.group_size, qw.source

    def dequantized_bf16(self) -> torch.Tensor | None:
        """The weight in bf16, rebuilt from this kernel's own layout; None where that is not known."""
        return None

    def looked_up_rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Rows `ids` (a vector) of the weight in float32, read from this kernel's own layout, so that a tied
        embedding looks its rows up here instead of keeping a second copy of the table; None where the layout
        does not say."""
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Not inside a compiled decode step: its batch size is symbolic there, and the compiled graph
        # is called without re-checking the branch it took (decode batches keep the kernel).
        if self.dense_from_rows is not None and not tracing_decode_step() and x.shape[0] >= self.dense_from_rows:
            weight = self.dequantized_bf16()  # bf16 F.linear is oneDNN's: a kernel cached per row count
            return in_bucketed_rows(lambda rows: F.linear(rows, weight), x.to(torch.bfloat16)).to(x.dtype)
        return super().__call__(x)

    def extra_repr(self) -> str:
        group = "per row" if self.group_size >= self.in_features else f"groups of {self.group_size}"
        prefill = f", bf16 from {self.dense_from_rows} rows" if self.dense_from_rows else ""
        return f"{self.in_features} -> {self.out_features}, {self.source}: {self.bits}-bit, {group}{prefill}"


def dequantize_looked_up(
    codes: torch.Tensor, bits: int, scale: torch.Tensor, offset: torch.Tensor | None, group: int, k: int
) -> torch.Tensor:
    """Looked-up rows of codes (4-bit ones packed two to a byte) with their scales and offsets, in float32."""
    if bits == 4:
        codes = unpack_nibbles(codes, k)
    w = codes[:, :k].float() * scale.float().repeat_interleave(group, dim=1)[:, :k]
    if offset is not None:
        w += offset.float().repeat_interleave(group, dim=1)[:, :k]
    return w


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

    def looked_up_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_looked_up(
            self.codes[ids],
            self.bits,
            self.scale[ids],
            None if self.offset is None else self.offset[ids],
            self.group_size,
            self.in_features,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if self.out_features <= self.slab:
            return F.linear(x, self.dequantize_rows(0, self.out_features))
        return torch.cat(
            [
                F.linear(x, self.dequantize_rows(start, start + self.slab))
                for start in range(0, self.out_features, self.slab)
            ],
            dim=-1,
        )


def _write_int4pack_scales_and_zeros(out: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> None:
    """PyTorch's int4 kernels compute w = (q - 8) * scale + zero: zero = offset + 8 * scale, written into `out`
    ([groups, rows, 2] bf16) for the first `scale.shape[0]` rows and groups, zero elsewhere."""
    rows, groups = scale.shape
    if (groups, rows) != out.shape[:2]:
        out.zero_()
    zero = 8 * scale if offset is None else offset + 8 * scale
    out[:groups, :rows] = torch.stack((scale, zero), dim=-1).transpose(0, 1)


def _unpack_int4pack(packed: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    """Codes [n, k] from PyTorch's CPU int4 packing as measured on x86 (torch 2.13): rows in blocks of
    `block`; in a block, byte (kk, j) holds code kk of row j (low nibble) and of row j + block / 2."""
    b = packed.view(n // block, k, block // 2)
    return torch.cat((b & 15, b >> 4), dim=2).transpose(1, 2).reshape(n, k)


def _int4pack_block(packed: torch.Tensor, codes: torch.Tensor) -> int | None:
    """The row block of PyTorch's int4 packing of `codes`, found by unpacking it; None when none of the
    known layouts gives the codes back (another torch version or CPU), which turns prefill's
    dequantized path off rather than risk a wrong weight."""
    n, k = codes.shape
    for block in (64, 32, 16):
        if n % block == 0 and torch.equal(_unpack_int4pack(packed, n, k, block), codes.to(torch.uint8)):
            return block
    return None


def _pack_int4(
    rows: Callable[[int, int], QuantizedWeight], n: int, k: int, group: int
) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """PyTorch's int4 packing of an [n, k] weight (k a whole number of groups), its bf16 scales and zeros, and the
    layout's row block (None where it is not one known block throughout), a slab of rows at a time. The packing
    moves rows within blocks of at most 64, so slabs of whole 64-row blocks pack to the same bytes as the whole
    weight; where the first slab's layout is not a known one (another torch version or CPU), the weight is packed
    in one step instead, as that is then the only safe way."""
    padded_n = round_up(n, 16)
    step = max(64, PACK_SLAB_VALUES // k // 64 * 64)
    packed = torch.empty(padded_n, k // 2, dtype=torch.uint8)
    scales_and_zeros = torch.empty(k // group, padded_n, 2, dtype=torch.bfloat16)
    block = None
    start = 0
    while start < padded_n:
        stop = min(start + step, padded_n)
        part = rows(start, min(stop, n) - start)
        if part.shape == (stop - start, k):
            codes = part.q.to(torch.int32)
        else:  # zero codes in the pad rows and columns, which zero scales and activations make count nothing
            codes = torch.zeros(stop - start, k, dtype=torch.int32)
            codes[: part.shape[0], : part.shape[1]] = part.q
        packed[start:stop] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        _write_int4pack_scales_and_zeros(scales_and_zeros[:, start:stop], part.scale, part.offset)
        if start == 0:
            block = _int4pack_block(packed[:stop], codes)
            if block is None and stop < padded_n:
                step = padded_n
                continue  # pack it again, whole
        elif stop == padded_n and stop - start < step and block != _int4pack_block(packed[start:stop], codes):
            block = None  # a shorter last slab packed in other blocks: one block size does not read it all
        start = stop
    return packed, scales_and_zeros, block if block is not None and padded_n % block == 0 else None


class Int4PackMatmul(QuantizedMatmul):
    """4-bit codes in PyTorch's CPU int4 layout; scales and zeros are rounded to bf16."""

    rounds_activations = True  # x in bf16

    @staticmethod
    def applies(qw: QuantizedWeight, device: torch.device) -> bool:
        return device.type == "cpu" and qw.bits == 4 and qw.group_size in INT4PACK_GROUPS

    def __init__(
        self,
        qw: QuantizedWeight | WeightOutline,
        dtype: torch.dtype,
        rows: Callable[[int, int], QuantizedWeight] | None = None,
    ):
        """`rows(start, count)` gives the weight's rows in that range where `qw` only outlines it; it is not kept."""
        super().__init__(qw)
        self.dtype = dtype
        self.padded_k = round_up(qw.shape[1], qw.group_size)
        self.packed, self.scales_and_zeros, self.layout_block = _pack_int4(
            rows or qw.rows, qw.shape[0], self.padded_k, qw.group_size
        )

    def dequantized_bf16(self) -> torch.Tensor | None:
        if self.layout_block is None:
            return None
        n, k = self.packed.shape[0], self.padded_k
        codes = _unpack_int4pack(self.packed, n, k, self.layout_block).view(n, -1, self.group_size)
        scale, zero = self.scales_and_zeros.transpose(0, 1).unsqueeze(-1).unbind(2)
        w = (codes.to(torch.bfloat16) - 8) * scale + zero
        return w.view(n, k)[: self.out_features, : self.in_features]

    def looked_up_rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        if self.layout_block is None:
            return None
        block, k = self.layout_block, self.padded_k
        blocks = self.packed.view(-1, k, block // 2)
        within = ids % block  # rows of a block's first half sit in the low nibbles, of its second in the high ones
        packed = blocks[ids // block, :, within % (block // 2)]
        codes = torch.where((within >= block // 2)[:, None], packed >> 4, packed & 15)
        scale, zero = self.scales_and_zeros[:, ids].float().unbind(-1)  # [groups, rows] each
        w = (codes.float() - 8).view(len(ids), -1, self.group_size) * scale.T[..., None] + zero.T[..., None]
        return w.view(len(ids), k)[:, : self.in_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _pad_columns(x.to(torch.bfloat16), self.padded_k)  # zero activations make the pad columns count nothing
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)
        return y[:, : self.out_features].to(self.dtype)


class Int8PackMatmul(QuantizedMatmul):
    """8-bit symmetric codes with one scale per row: PyTorch's weight-only int8 kernel."""

    rounds_activations = True  # x in bf16

    @staticmethod
    def applies(qw: QuantizedWeight, device: torch.device) -> bool:
        # The kernel reads K in steps of 16 with no tail: other K give garbage or a segfault (torch 2.13 CPU).
        return (
            device.type == "cpu"
            and qw.bits == 8
            and qw.group_size >= qw.shape[1]
            and qw.offset is None
            and qw.shape[1] % 16 == 0
        )

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype):
        super().__init__(qw)
        self.dtype = dtype
        self.codes = qw.q.contiguous()
        self.scale = qw.scale[:, 0].to(torch.bfloat16)

    def dequantized_bf16(self) -> torch.Tensor:
        return self.codes.to(torch.bfloat16) * self.scale[:, None]

    def looked_up_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.codes[ids].float() * self.scale[ids, None].float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.codes, self.scale).to(self.dtype)


class SideBySideInt4Matmul(QuantizedMatmul):
    """A weight that is a sum of 4-bit terms over the same columns, W = W_1 + ... + W_r, multiplied
    as one int4 product: x W^T = [x | ... | x] [W_1 | ... | W_r]^T. One kernel call reads the bytes r
    calls would, for less: at one row on 2 cores, 21 against 35 us at 576 x 576 (bench/RESULTS.md).
    Subclasses say how a weight splits into its `count` terms (`terms`, or `joined_terms` directly); the joined
    terms are made and packed a slab of rows at a time, so they are never whole in memory beside the packed copy."""

    rounds_activations = True  # x in bf16

    count: int

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype):
        super().__init__(qw)
        self.dtype = dtype
        first = self.joined_terms(qw.rows(0, 1))
        # Each term's columns padded to whole groups, so that every group of the joined weight is one term's.
        self.term_k = first.shape[1] // self.count
        outline = WeightOutline((qw.shape[0], first.shape[1]), 4, first.group_size, qw.source)
        self.joined = Int4PackMatmul(outline, dtype, rows=lambda start, count: self.joined_terms(qw.rows(start, count)))

    def terms(self, qw: QuantizedWeight) -> list[QuantizedWeight]:
        """4-bit weights over `qw`'s columns, in groups the int4 kernel takes, that sum to `qw`."""
        raise NotImplementedError

    def joined_terms(self, qw: QuantizedWeight) -> QuantizedWeight:
        """[W_1 | ... | W_r] for `qw`'s rows, each term's columns padded with zero codes, scales and offsets to
        whole groups."""
        terms = self.terms(qw)
        rows, group = qw.shape[0], terms[0].group_size
        k = round_up(terms[0].shape[1], group)
        codes = torch.zeros(rows, self.count, k, dtype=torch.uint8)
        scale = torch.zeros(rows, self.count, k // group)
        offset = torch.zeros(rows, self.count, k // group)
        for i, t in enumerate(terms):
            codes[:, i, : t.shape[1]] = t.q
            scale[:, i, : t.scale.shape[1]] = t.scale
            if t.offset is not None:
                offset[:, i, : t.offset.shape[1]] = t.offset
        return QuantizedWeight(4, codes.view(rows, -1), scale.view(rows, -1), offset.view(rows, -1), group, self.source)

    def dequantized_bf16(self) -> torch.Tensor | None:
        w = self.joined.dequantized_bf16()
        if w is None:
            return None
        return w.view(w.shape[0], self.count, self.term_k).sum(1)[:, : self.in_features]

    def looked_up_rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        w = self.joined.looked_up_rows(ids)
        if w is None:
            return None
        return w.view(len(ids), self.count, self.term_k).sum(1)[:, : self.in_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _pad_columns(x.to(torch.bfloat16), self.term_k)  # zero activations make the pad columns count nothing
        return self.joined(x.repeat(1, self.count)).to(self.dtype)


class SplitInt4Matmul(SideBySideInt4Matmul):
    """8-bit codes in groups the int4 kernel takes, as two exact 4-bit terms: a code c in -128..127 is
    16 * hi + lo - 128 with hi, lo in 0..15, so w = 16s * hi + s * lo + (offset - 128s)."""

    count = 2

    @staticmethod
    def applies(qw: QuantizedWeight, device: torch.device) -> bool:
        return device.type == "cpu" and qw.bits == 8 and qw.group_size in INT4PACK_GROUPS

    def terms(self, qw: QuantizedWeight) -> list[QuantizedWeight]:
        unsigned = (qw.q.to(torch.int16) + 128).to(torch.uint8)
        offset = -128 * qw.scale if qw.offset is None else qw.offset - 128 * qw.scale
        hi = QuantizedWeight(4, unsigned >> 4, 16 * qw.scale, offset, qw.group_size, qw.source)
        lo = QuantizedWeight(4, unsigned & 15, qw.scale, None, qw.group_size, qw.source)
        return [hi, lo]


class HalvesSplitInt4Matmul(SideBySideInt4Matmul):
    """6-bit signed codes (-32..31) in groups of 16, GGUF Q6_K's layout, as four exact 4-bit terms.

    The int4 kernel takes groups of 32 and computes (q - 8) * scale + zero. Each group of 32 columns
    counts twice, with the scale of its first 16 columns and then of its last 16, the other half masked
    to zero (code 8, zero 0). A code c is 8 * hi + lo - 32 with hi, lo in 0..7: lo stored as it is
    gives s * (lo - 8), hi stored as hi + 5 with scale 8s gives 8s * hi - 24s, and the two add up to
    s * c."""

    count = 4

    @staticmethod
    def applies(qw: QuantizedWeight, device: torch.device) -> bool:
        return (
            device.type == "cpu"
            and qw.bits == 8
            and qw.group_size == 16
            and not qw.has_offset
            and (qw.source == "Q6_K" or (int(qw.q.min()) >= -32 and int(qw.q.max()) <= 31))
        )

    def joined_terms(self, qw: QuantizedWeight) -> QuantizedWeight:
        # Made side by side directly: Q6_K's terms are the largest part of a Q4_K_M file's load time.
        rows, k = qw.shape
        padded = round_up(k, 32)
        unsigned = torch.zeros(rows, padded, dtype=torch.uint8)
        unsigned[:, :k] = qw.q + 32  # 0..63, in int8 without overflow
        codes = torch.full((rows, 2, 2, padded), 8, dtype=torch.uint8)  # [half, low/high]; code 8, zero 0: nothing
        halves = lambda t: t.view(rows, padded // 32, 2, 16)  # [rows, groups of 32, half, column]
        scale = F.pad(qw.scale, (0, padded // 16 - qw.scale.shape[1])).view(rows, -1, 2)  # [rows, groups, half]
        scales, offsets = torch.empty(rows, 2, 2, padded // 32), torch.empty(rows, 2, 2, padded // 32)
        for h in (0, 1):
            halves(codes[:, h, 0])[:, :, h] = halves(unsigned)[:, :, h] & 7
            halves(codes[:, h, 1])[:, :, h] = (halves(unsigned)[:, :, h] >> 3) + 5
            s = scale[:, :, h]
            scales[:, h, 0], offsets[:, h, 0] = s, -8 * s
            scales[:, h, 1], offsets[:, h, 1] = 8 * s, -64 * s
        return QuantizedWeight(4, codes.view(rows, -1), scales.view(rows, -1), offsets.view(rows, -1), 32, qw.source)
