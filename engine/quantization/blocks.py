"""A GGUF K-quant tensor held as the file stores it: `BlockWeight` is a QuantizedWeight whose codes, scales and
offsets are decoded from its blocks when asked for, not kept (issue 38).

Its blocks are read from the file when first needed (`UnreadBlocks`): the shards of a fused projection (gate and up,
q, k and v) are read straight into the fused weight's buffer (`concat`), where reading each and copying them
together took 2.8 s of a Llama-8B file's load and held each layer's gate and up twice for a moment.

The kernel chooser reads a weight a slab of rows at a time (`rows`, `take`), and the K-quant kernel (kquant.py)
keeps the blocks themselves, so a Q6_K head is never expanded whole: decoded beside its blocks, the loader's layout
(a byte a code, float32 scales) took 1.5x the blocks for Q6_K and 2.2x for Q4_K, and a 150k-token table's
expansion alone outweighed everything else a load holds beyond the kept weights. Small slices keep what they
decoded, so a slab's codes, scales and offsets come from one decoding.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.quantization.huge_pages import empty_bytes
from engine.quantization.layout import QuantizedWeight

CACHE_BYTES = 16 << 20  # slices of up to this many stored bytes keep their decoding

Decoder = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class UnreadBlocks:
    """Blocks [rows, row bytes] still in their file: `read_into(out)` fills a uint8 tensor of `shape` with them."""

    shape: tuple[int, int]
    read_into: Callable[[torch.Tensor], None]

    def read(self) -> torch.Tensor:
        out = empty_bytes(math.prod(self.shape)).view(self.shape)
        self.read_into(out)
        return out


class BlockWeight(QuantizedWeight):
    """`blocks` [N, row bytes] of GGUF type `source` (read when first asked for, if given as UnreadBlocks);
    `decoder(blocks, K)` gives (codes, scale, offset) in the layout QuantizedWeight describes."""

    def __init__(
        self,
        blocks: torch.Tensor | UnreadBlocks,
        source: str,
        shape: tuple[int, int],
        bits: int,
        group_size: int,
        decoder: Decoder,
    ):
        # Not the dataclass's __init__: q, scale and offset are decoded on access.
        if len(blocks.shape) != 2 or blocks.shape[0] != shape[0]:
            raise ValueError(f"{source} blocks of shape {tuple(blocks.shape)} do not hold a {shape} weight")
        self._blocks, self.source, self.bits, self.group_size = blocks, source, bits, group_size
        self._k, self._decoder, self._cache = shape[1], decoder, None

    @property
    def blocks(self) -> torch.Tensor:
        if isinstance(self._blocks, UnreadBlocks):
            self._blocks = self._blocks.read()
        return self._blocks

    def _decoded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if self._cache is not None:
            return self._cache
        decoded = self._decoder(self.blocks, self._k)
        if self.blocks.numel() <= CACHE_BYTES:
            self._cache = decoded
        return decoded

    @property
    def q(self) -> torch.Tensor:
        return self._decoded()[0]

    @property
    def scale(self) -> torch.Tensor:
        return self._decoded()[1]

    @property
    def offset(self) -> torch.Tensor | None:
        return self._decoded()[2]

    @property
    def has_offset(self) -> bool:
        # Q4_K and Q5_K: a min per sub-block; Q4_0 and Q4_1: an offset per block (Q4_0's is -8 times its scale);
        # Q6_K, Q8_0 and MXFP4 are codes times a scale
        return self.source in ("Q4_K", "Q5_K", "Q4_0", "Q4_1")

    @property
    def shape(self) -> tuple[int, int]:
        return (self._blocks.shape[0], self._k)

    @property
    def nbytes(self) -> int:
        return math.prod(self._blocks.shape)

    def _like(self, blocks: torch.Tensor) -> "BlockWeight":
        return BlockWeight(blocks, self.source, (blocks.shape[0], self._k), self.bits, self.group_size, self._decoder)

    def to(self, device: torch.device) -> "BlockWeight":
        device = torch.device(device)
        if device.type == "cpu" and isinstance(self._blocks, UnreadBlocks):
            return self  # read into host memory when needed
        return self if self.blocks.device == device else self._like(self.blocks.to(device))

    def rows(self, start: int, count: int) -> "BlockWeight":
        return self._like(self.blocks[start : start + count])

    def take(self, index: torch.Tensor) -> "BlockWeight":
        """Rows `index` (a copy of their blocks)."""
        return self._like(self.blocks[index])

    @staticmethod
    def concat(parts: list["BlockWeight"]) -> "BlockWeight":
        """The parts' rows one after another, in one buffer; parts still unread are read into it."""
        blocks = [p._blocks for p in parts]
        if any(isinstance(b, torch.Tensor) and b.device.type != "cpu" for b in blocks):
            return parts[0]._like(torch.cat([p.blocks for p in parts]))
        rows, row_bytes = sum(b.shape[0] for b in blocks), blocks[0].shape[1]
        out, start = empty_bytes(rows * row_bytes).view(rows, row_bytes), 0
        for b in blocks:
            part = out[start : start + b.shape[0]]
            if isinstance(b, UnreadBlocks):
                b.read_into(part)
            else:
                part.copy_(b)
            start += b.shape[0]
        return parts[0]._like(out)

    def __repr__(self) -> str:
        return f"BlockWeight({self.source}, {self.shape})"
