"""Pagoda's quantized weight layout: the contract between what makes quantized weights (the
int8/int4 pass in this package, the GGUF reader in engine/loader/gguf.py) and the kernels that
multiply by them.

A `QuantizedWeight` holds an [N, K] matrix as integer codes in groups of `group_size` columns, each
group of each row with its own scale and offset:

    w[n, k] = q[n, k] * scale[n, k // group_size] + offset[n, k // group_size]

Every GGUF block type used by Llama/Qwen files is this layout with some group size, so a GGUF
tensor is repacked into it without loss: Q4_0, Q4_1 and Q4_K become 4-bit codes, Q5_0, Q5_1,
Q5_K, Q6_K and Q8_0 8-bit ones. Scales and offsets are float32, which holds every GGUF scale
(an fp16 times a 6-bit integer) exactly. A kernel may round them when it packs the codes into its
own layout; `dequantize` is the exact reference.
"""

from dataclasses import dataclass

import torch

BITS = (4, 8)


@dataclass
class QuantizedWeight:
    bits: int  # 4: codes 0..15, one per uint8 until a kernel packs them; 8: codes -128..127 as int8
    q: torch.Tensor  # [N, K] codes
    scale: torch.Tensor  # [N, ceil(K / group_size)] float32
    offset: torch.Tensor | None  # like scale; None means zero (symmetric codes)
    group_size: int  # columns per scale; K itself for one scale per row
    source: str  # what made it, for print(model) and stats: "int8", "int4", or a GGUF type name like "Q4_K"
    # The GGUF blocks the codes came from, [N, row bytes] uint8, for kernels that read them as stored (kquant.py)
    blocks: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"a quantized weight has 4 or 8 bits, not {self.bits}")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size must be a whole number >= 1, got {self.group_size!r}")
        if self.q.dim() != 2:
            raise ValueError(f"quantized codes must be a matrix, got shape {tuple(self.q.shape)}")
        expected_dtype = torch.uint8 if self.bits == 4 else torch.int8
        if self.q.dtype != expected_dtype:
            raise ValueError(f"{self.bits}-bit codes are {expected_dtype}, got {self.q.dtype}")
        groups = (self.q.shape[1] + self.group_size - 1) // self.group_size
        for name, t in (("scale", self.scale), ("offset", self.offset)):
            if t is not None and tuple(t.shape) != (self.q.shape[0], groups):
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}; {tuple(self.q.shape)} codes in groups of "
                    f"{self.group_size} need {(self.q.shape[0], groups)}"
                )

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def has_offset(self) -> bool:
        return self.offset is not None

    @property
    def nbytes(self) -> int:
        """Bytes at rest, with 4-bit codes counted as packed two to a byte (as kernels hold them)."""
        codes = self.q.numel() // 2 if self.bits == 4 else self.q.numel()
        return codes + sum(t.numel() * t.element_size() for t in (self.scale, self.offset) if t is not None)

    def to(self, device: torch.device) -> "QuantizedWeight":
        return QuantizedWeight(
            self.bits,
            self.q.to(device),
            self.scale.to(device),
            None if self.offset is None else self.offset.to(device),
            self.group_size,
            self.source,
            None if self.blocks is None else self.blocks.to(device),
        )

    def rows(self, start: int, count: int) -> "QuantizedWeight":
        """Rows [start, start + count): how tensor-parallel ranks and fused projections take their part."""
        cut = slice(start, start + count)
        return QuantizedWeight(
            self.bits,
            self.q[cut],
            self.scale[cut],
            None if self.offset is None else self.offset[cut],
            self.group_size,
            self.source,
            None if self.blocks is None else self.blocks[cut],
        )

    def take(self, index: torch.Tensor) -> "QuantizedWeight":
        """Rows `index`, in that order (a copy): codes, scales and offsets move together, losslessly."""
        return QuantizedWeight(
            self.bits,
            self.q[index].contiguous(),
            self.scale[index].contiguous(),
            None if self.offset is None else self.offset[index].contiguous(),
            self.group_size,
            self.source,
            None if self.blocks is None else self.blocks[index].contiguous(),
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The full-precision matrix, computed in float32: the reference every kernel is tested against."""
        k = self.q.shape[1]
        w = self.q.float() * self.scale.repeat_interleave(self.group_size, dim=1)[:, :k]
        if self.offset is not None:
            w += self.offset.repeat_interleave(self.group_size, dim=1)[:, :k]
        return w.to(dtype)


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 with one scale per output row (vLLM's and gpt-fast's weight-only int8); the
    scale is a bf16 value, which the int8 kernel takes as it is."""
    w = w.float()
    scale = _bf16_exact((w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12))
    q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return QuantizedWeight(8, q, scale, None, w.shape[1], "int8")


def quantize_int4(w: torch.Tensor, group_size: int) -> QuantizedWeight:
    """Asymmetric 4-bit codes per group of `group_size` columns, spanning the group's minimum to its
    maximum in 15 steps. The last group is shorter when group_size does not divide K."""
    if group_size < 1:
        raise ValueError(f"group_size must be positive, got {group_size}")
    n, k = w.shape
    groups = (k + group_size - 1) // group_size
    padded = torch.nn.functional.pad(w.float(), (0, groups * group_size - k)).view(n, groups, group_size)
    # The padding must not widen the last group's range: take it from the real columns only.
    real = torch.arange(groups * group_size, device=w.device).view(groups, group_size) < k
    lo = torch.where(real, padded, torch.inf).amin(dim=2)
    hi = torch.where(real, padded, -torch.inf).amax(dim=2)
    scale = _bf16_exact(((hi - lo) / 15).clamp(min=1e-12))
    # PyTorch's int4 kernels take w = (q - 8) * scale + zero with zero in bf16: choose zero first, so
    # that offset = zero - 8 * scale reaches them without rounding.
    offset = _bf16_exact(lo + 8 * scale) - 8 * scale
    q = torch.round((padded - offset[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return QuantizedWeight(4, q.view(n, -1)[:, :k].contiguous(), scale, offset, group_size, "int4")


def _bf16_exact(t: torch.Tensor) -> torch.Tensor:
    """`t` rounded to the nearest bf16, kept as float32: the kernels' bf16 copy of it is then exact."""
    return t.to(torch.bfloat16).float()
