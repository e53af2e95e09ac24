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
  and lo 4-bit, so the weight is the sum of two exact 4-bit weights, multiplied side by side in one
  int4 call (SideBySideInt4Matmul).
- HalvesSplitInt4Matmul: 6-bit codes in groups of 16 (GGUF Q6_K) as four exact 4-bit terms, likewise.
- GroupedInt8Matmul: Pagoda's own kernel (grouped_int8.cpp, compiled for this CPU on first use; opt-in with
  PAGODA_NATIVE_KERNELS=1, native.py says why): codes of any width in groups of 16 or 32 as bytes, times the
  row rounded to 16-bit integers per group, one exact integer dot product per group.
- DequantMatmul: any layout; dequantizes a slab of rows at a time into the activations' dtype and
  multiplies it, so no whole weight is ever expanded. The fallback, and the reference's speed.
- DenseMatmul: a full-precision weight (a GGUF F16 tensor, say), oneDNN-packed on the CPU.

On NVIDIA GPUs: TritonQuantMatmul, Pagoda's Triton dequant-GEMV and GEMM (or tinygemm where it
measures faster), any layout.
"""
import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import in_bucketed_rows, onednn_linear
from engine.quantization import native
from engine.quantization.layout import QuantizedWeight
from engine.tracing import tracing_decode_step

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

    def __init__(self, qw: QuantizedWeight):
        super().__init__()
        self.out_features, self.in_features = qw.shape
        self.bits, self.group_size, self.source = qw.bits, qw.group_size, qw.source

    def dequantized_bf16(self) -> torch.Tensor | None:
        """The weight in bf16, rebuilt from this kernel's own layout; None where that is not known."""
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Not inside a compiled decode step: its batch size is symbolic there, and the compiled graph
        # is called without re-checking the branch it took (decode batches keep the kernel).
        if (self.dense_from_rows is not None and not tracing_decode_step()
                and x.shape[0] >= self.dense_from_rows):
            weight = self.dequantized_bf16()  # bf16 F.linear is oneDNN's: a kernel cached per row count
            return in_bucketed_rows(lambda rows: F.linear(rows, weight), x.to(torch.bfloat16)).to(x.dtype)
        return super().__call__(x)

    def extra_repr(self) -> str:
        group = "per row" if self.group_size >= self.in_features else f"groups of {self.group_size}"
        prefill = f", bf16 from {self.dense_from_rows} rows" if self.dense_from_rows else ""
        return f"{self.in_features} -> {self.out_features}, {self.source}: {self.bits}-bit, {group}{prefill}"


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
        self.layout_block = _int4pack_block(self.packed, codes)

    def dequantized_bf16(self) -> torch.Tensor | None:
        if self.layout_block is None:
            return None
        n, k = self.packed.shape[0], self.padded_k
        codes = _unpack_int4pack(self.packed, n, k, self.layout_block).view(n, -1, self.group_size)
        scale, zero = self.scales_and_zeros.transpose(0, 1).unsqueeze(-1).unbind(2)
        w = (codes.to(torch.bfloat16) - 8) * scale + zero
        return w.view(n, k)[: self.out_features, : self.in_features]

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

    def dequantized_bf16(self) -> torch.Tensor:
        return self.codes.to(torch.bfloat16) * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.codes, self.scale).to(self.dtype)


class SideBySideInt4Matmul(QuantizedMatmul):
    """A weight that is a sum of 4-bit terms over the same columns, W = W_1 + ... + W_r, multiplied
    as one int4 product: x W^T = [x | ... | x] [W_1 | ... | W_r]^T. One kernel call reads the bytes r
    calls would, for less: at one row on 2 cores, 21 against 35 us at 576 x 576 (bench/RESULTS.md)."""

    def __init__(self, qw: QuantizedWeight, terms: list[QuantizedWeight], dtype: torch.dtype):
        super().__init__(qw)
        self.dtype = dtype
        # Each term's columns padded to whole groups, so that every group of the joined weight is one term's.
        self.term_k = _round_up(terms[0].shape[1], terms[0].group_size)
        self.count = len(terms)

        def padded(t: QuantizedWeight) -> QuantizedWeight:
            groups = self.term_k // t.group_size
            pad = lambda m: F.pad(m, (0, groups - m.shape[1]))
            return QuantizedWeight(4, F.pad(t.q, (0, self.term_k - t.shape[1])), pad(t.scale),
                                   None if t.offset is None else pad(t.offset), t.group_size, t.source)

        parts = [padded(t) for t in terms]
        offsets = [p.offset if p.offset is not None else torch.zeros_like(p.scale) for p in parts]
        joined = QuantizedWeight(4, torch.cat([p.q for p in parts], 1), torch.cat([p.scale for p in parts], 1),
                                 torch.cat(offsets, 1), terms[0].group_size, qw.source)
        self.joined = Int4PackMatmul(joined, dtype)

    def dequantized_bf16(self) -> torch.Tensor | None:
        w = self.joined.dequantized_bf16()
        if w is None:
            return None
        return w.view(w.shape[0], self.count, self.term_k).sum(1)[:, : self.in_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _pad_columns(x.to(torch.bfloat16), self.term_k)  # zero activations make the pad columns count nothing
        return self.joined(x.repeat(1, self.count)).to(self.dtype)


class SplitInt4Matmul(SideBySideInt4Matmul):
    """8-bit codes in groups the int4 kernel takes, as two exact 4-bit terms: a code c in -128..127 is
    16 * hi + lo - 128 with hi, lo in 0..15, so w = 16s * hi + s * lo + (offset - 128s)."""

    @staticmethod
    def applies(qw: QuantizedWeight, device: torch.device) -> bool:
        return device.type == "cpu" and qw.bits == 8 and qw.group_size in INT4PACK_GROUPS

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype):
        unsigned = (qw.q.to(torch.int16) + 128).to(torch.uint8)
        offset = -128 * qw.scale if qw.offset is None else qw.offset - 128 * qw.scale
        hi = QuantizedWeight(4, unsigned >> 4, 16 * qw.scale, offset, qw.group_size, qw.source)
        lo = QuantizedWeight(4, unsigned & 15, qw.scale, None, qw.group_size, qw.source)
        super().__init__(qw, [hi, lo], dtype)


class HalvesSplitInt4Matmul(SideBySideInt4Matmul):
    """6-bit signed codes (-32..31) in groups of 16, GGUF Q6_K's layout, as four exact 4-bit terms.

    The int4 kernel takes groups of 32 and computes (q - 8) * scale + zero. Each group of 32 columns
    counts twice, with the scale of its first 16 columns and then of its last 16, the other half masked
    to zero (code 8, zero 0). A code c is 8 * hi + lo - 32 with hi, lo in 0..7: lo stored as it is
    gives s * (lo - 8), hi stored as hi + 5 with scale 8s gives 8s * hi - 24s, and the two add up to
    s * c."""

    @staticmethod
    def applies(qw: QuantizedWeight, device: torch.device) -> bool:
        return (device.type == "cpu" and qw.bits == 8 and qw.group_size == 16 and qw.offset is None
                and int(qw.q.min()) >= -32 and int(qw.q.max()) <= 31)

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype):
        n, k = qw.shape
        padded = _round_up(k, 32)
        unsigned = F.pad(qw.q.to(torch.int16) + 32, (0, padded - k)).to(torch.uint8)
        scale = F.pad(qw.scale, (0, padded // 16 - qw.scale.shape[1]))
        half = (torch.arange(padded, device=qw.q.device) // 16) % 2  # which half of its group each column is
        terms = []
        for h in (0, 1):
            mask, s = half == h, scale[:, h::2]
            masked = unsigned.where(mask, 0)
            low = torch.where(mask, masked % 8, 8).to(torch.uint8)
            high = torch.where(mask, masked // 8 + 5, 8).to(torch.uint8)
            terms += [QuantizedWeight(4, low, s, -8 * s, 32, qw.source),
                      QuantizedWeight(4, high, 8 * s, -64 * s, 32, qw.source)]
        super().__init__(qw, terms, dtype)


class GroupedInt8Matmul(QuantizedMatmul):
    """Codes as bytes in groups of 16 or 32 columns, multiplied by Pagoda's native kernel (native.py): the row
    is rounded to 16-bit integers per group (a step of 1/32767 of the group's largest value, finer than bf16),
    and each group's product is exact in integers. 4-bit codes c become c - 8 with the offset made up."""

    GROUPS = (16, 32)

    @staticmethod
    def applies(qw: QuantizedWeight, device: torch.device) -> bool:
        return (device.type == "cpu" and qw.group_size in GroupedInt8Matmul.GROUPS
                and native.grouped_int8_mm() is not None)

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype):
        super().__init__(qw)
        self.dtype = dtype
        n, k = qw.shape
        self.padded_k = _round_up(k, 32)
        groups = self.padded_k // qw.group_size
        pad = lambda m: F.pad(m.float(), (0, groups - m.shape[1])).contiguous()
        codes, offset = qw.q, qw.offset
        if qw.bits == 4:  # q * s + o = (q - 8) * s + (o + 8 s)
            codes = (qw.q.to(torch.int16) - 8).to(torch.int8)
            offset = 8 * qw.scale + (0 if qw.offset is None else qw.offset)
        self.codes = F.pad(codes, (0, self.padded_k - k)).contiguous()
        self.scale = pad(qw.scale)
        self.offset = None if offset is None else pad(offset)
        self.op = native.grouped_int8_mm()

    def dequantized_bf16(self) -> torch.Tensor:
        g, k = self.group_size, self.in_features
        w = self.codes[:, :k].float() * self.scale.repeat_interleave(g, dim=1)[:, :k]
        if self.offset is not None:
            w += self.offset.repeat_interleave(g, dim=1)[:, :k]
        return w.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x.float().contiguous(), self.codes, self.scale, self.offset, self.group_size).to(self.dtype)


class TritonQuantMatmul(QuantizedMatmul):
    """NVIDIA GPUs: Pagoda's Triton dequant-GEMV (decode) and dequant-GEMM (prefill) over the packed
    codes (engine/layers/quant_matmul.py), with a tile per row count measured at load; or PyTorch's
    tinygemm int4 kernel for every row count where that measured faster at one row."""

    @staticmethod
    def applies(qw: QuantizedWeight, device: torch.device) -> bool:
        return device.type == "cuda"

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype):
        from engine.layers import quant_matmul  # Triton is imported only where a GPU runs it

        super().__init__(qw)
        self.dtype = dtype
        self.kernels = quant_matmul
        # The kernels multiply fp16/bf16 activations; a float32 model's are rounded to bf16 for them.
        self.kernel_dtype = dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        packed = quant_matmul.pack_for_triton(qw, self.kernel_dtype)
        choice = quant_matmul.choose_quant_tiles(qw, packed, None, self.kernel_dtype)
        self.tiles = choice.tiles
        self.tinygemm = quant_matmul.tinygemm_pack(qw) if choice.tinygemm else None
        self.weight = None if self.tinygemm is not None else packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.kernel_dtype)
        if self.tinygemm is not None:
            y = self.kernels.tinygemm_matmul(x, self.tinygemm, None)
        else:
            y = self.kernels.run_tile(x, self.weight, None, self.kernels.tile_for(self.tiles, x.shape[0]))
        return y.to(self.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", tinygemm" if self.tinygemm is not None else ", triton")


def candidates(qw: QuantizedWeight, device: torch.device, dtype: torch.dtype) -> list[Callable[[], nn.Module]]:
    """Constructors of every kernel that can multiply by `qw` here, the fallback last."""
    kinds = (Int4PackMatmul, Int8PackMatmul, SplitInt4Matmul, HalvesSplitInt4Matmul, GroupedInt8Matmul,
             TritonQuantMatmul)
    made = [lambda cls=cls: cls(qw, dtype) for cls in kinds if cls.applies(qw, device)]
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
    if device.type == "cuda":
        # The Triton kernel measures its own tiles with CUDA events; the slab fallback is far slower on a
        # GPU (it would need a timing that waits for the device to compare at all).
        try:
            return makers[0]()
        except RuntimeError as e:
            log.warning("the Triton quantized kernel cannot run a %s weight %s here (%s); using the slow "
                        "dequantizing fallback", qw.source, qw.shape, str(e).splitlines()[0])
            return makers[-1]()
    if key in _CHOICES:
        kernel = makers[_CHOICES[key]]()
        choose_prefill_rows(kernel, dtype)  # measured once per shape too; this sets the layer's copy
        return kernel
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
    choose_prefill_rows(best_kernel, dtype)
    return best_kernel


PREFILL_ROWS = (128, 512)  # where prefill's dequantized path is tried, fewest first
_PREFILL_CHOICES: dict[tuple, int | None] = {}


@torch.inference_mode()
def choose_prefill_rows(kernel: nn.Module, dtype: torch.dtype) -> None:
    """Set `kernel.dense_from_rows` to the fewest rows of PREFILL_ROWS at which multiplying by the
    dequantized bf16 weight beats the kernel, if any, where the kernel can rebuild its weight."""
    if not isinstance(kernel, QuantizedMatmul) or kernel.dequantized_bf16() is None:
        return
    key = (type(kernel), kernel.out_features, kernel.in_features, kernel.group_size, dtype)
    if key not in _PREFILL_CHOICES:
        _PREFILL_CHOICES[key] = None
        for rows in PREFILL_ROWS:
            x = torch.randn(rows, kernel.in_features, dtype=dtype)
            plain = _seconds_per_call(kernel, x, calls=3)
            kernel.dense_from_rows = rows
            dense = _seconds_per_call(kernel, x, calls=3)
            kernel.dense_from_rows = None
            if dense < plain:
                _PREFILL_CHOICES[key] = rows
                break
    kernel.dense_from_rows = _PREFILL_CHOICES[key]
