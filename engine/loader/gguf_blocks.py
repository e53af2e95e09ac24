"""GGUF's tensor types read into Pagoda's forms: float tensors as they are, and llama.cpp's quantized blocks as
`QuantizedWeight`s without loss (each block type is codes times a per-group scale plus a per-group offset), or,
for the K-quants that quantization/kquant.py multiplies as stored, as `BlockWeight`s that decode when asked.
Rows are decoded a slab at a time, so a tensor's decoding needs little beyond the tensor itself."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch

from engine.quantization.blocks import BlockWeight, UnreadBlocks
from engine.quantization.huge_pages import empty_bytes
from engine.quantization.layout import QuantizedWeight
from engine.quantization.mxfp4 import decode_ggml_mxfp4

FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# GGUF type -> (bytes per block, values per block, code bits, values per scale)
QUANT_TYPES = {
    "Q4_0": (18, 32, 4, 32),
    "Q4_1": (20, 32, 4, 32),
    "Q5_0": (22, 32, 8, 32),
    "Q5_1": (24, 32, 8, 32),
    "Q8_0": (34, 32, 8, 32),
    "Q4_K": (144, 256, 4, 32),
    "Q5_K": (176, 256, 8, 32),
    "Q6_K": (210, 256, 8, 16),
    "MXFP4": (17, 32, 8, 32),  # gpt-oss's experts: an E8M0 exponent and 32 E2M1 codes
}
SUPPORTED_TYPES = (*FLOAT_TYPES, *QUANT_TYPES)


class FileBytes:
    """One tensor's stored bytes in an open file, read a range at a time. A tensor read after the loader has closed
    the file (a weight whose blocks are read when first needed, blocks.py) opens it again."""

    def __init__(self, file: Any, offset: int, size: int) -> None:
        self.file, self.offset, self.size = file, offset, size

    def read(self, start: int, stop: int) -> torch.Tensor:
        """Bytes [start, stop) of the tensor as a uint8 tensor."""
        out = empty_bytes(stop - start)
        self.read_into(out, start)
        return out

    def read_into(self, out: torch.Tensor, start: int = 0) -> None:
        """Fill the contiguous uint8 tensor `out` with the tensor's bytes from `start` on."""
        if self.file.closed:
            with open(self.file.name, "rb") as file:
                self._read_into(file, out, start)
        else:
            self._read_into(self.file, out, start)

    def _read_into(self, file: Any, out: torch.Tensor, start: int) -> None:
        file.seek(self.offset + start)
        if file.readinto(out.view(-1).numpy()) != out.numel():
            raise RuntimeError(f"{file.name} ended inside a tensor; the file is incomplete: re-download it")


# block decoders: uint8 blocks [n_blocks, bytes] -> codes [n_blocks, values], scales (and offsets) [n_blocks, groups]


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()  # [n_blocks, 1]


def _nibbles(qs: torch.Tensor, run: int = 32) -> torch.Tensor:
    """The low nibbles of each `run` bytes, then their high nibbles, as ggml lays out 4-bit values (runs of 16
    bytes in the 32-value blocks, of 32 in the K-quants' sub-blocks): [n, runs, 2, run]."""
    qs = qs.reshape(qs.shape[0], -1, 1, run)
    return torch.cat((qs & 0xF, qs >> 4), dim=2)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """Each byte's 8 bits, least significant first: [n, bytes] -> [n, 8, bytes]."""
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    return (packed.unsqueeze(1) >> shifts) & 1


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight 6-bit scales and mins, packed in 12 bytes."""
    lo, mid, hi = packed.view(-1, 3, 4).unbind(1)
    scales = torch.cat((lo & 63, (hi & 0xF) | ((lo >> 2) & 0x30)), dim=1)
    mins = torch.cat((mid & 63, (hi >> 4) | ((mid >> 2) & 0x30)), dim=1)
    return scales.float(), mins.float()


def _q4_0(b):
    d = _half(b, 0)
    return _nibbles(b[:, 2:18], 16).reshape(len(b), 32), d, -8 * d


def _q4_1(b):
    return _nibbles(b[:, 4:20], 16).reshape(len(b), 32), _half(b, 0), _half(b, 2)


def _q5(b, qh_at: int):
    high = _bits(b[:, qh_at : qh_at + 4]).transpose(1, 2).reshape(len(b), 32)  # bit j of the 32-bit word: value j
    return _nibbles(b[:, qh_at + 4 : qh_at + 20], 16).reshape(len(b), 32) | (high << 4)


def _q5_0(b):
    return (_q5(b, 2).to(torch.int8) - 16), _half(b, 0), None


def _q5_1(b):
    return _q5(b, 4).to(torch.int8), _half(b, 0), _half(b, 2)


def _q8_0(b):
    return b[:, 2:34].contiguous().view(torch.int8), _half(b, 0), None


def _q4_k(b):
    scales, mins = _k_scales(b[:, 4:16])
    return _nibbles(b[:, 16:144]).reshape(len(b), 256), _half(b, 0) * scales, -(_half(b, 2) * mins)


def _q5_k(b):
    scales, mins = _k_scales(b[:, 4:16])
    high = _bits(b[:, 16:48])  # bit j of byte l: value l of sub-block j
    codes = _nibbles(b[:, 48:176]).reshape(len(b), 8, 32) | (high << 4)
    return codes.reshape(len(b), 256).to(torch.int8), _half(b, 0) * scales, -(_half(b, 2) * mins)


def _q6_k(b):
    n = len(b)
    low = b[:, :128].reshape(n, 2, 1, 64)
    low = torch.cat((low & 0xF, low >> 4), dim=2).reshape(n, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3
    codes = (low | (high << 4)).reshape(n, 256).to(torch.int8) - 32
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    return codes, _half(b, 208) * scales, None


_DECODERS = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "MXFP4": decode_ggml_mxfp4,
}


DECODE_SLAB_BYTES = 1 << 20  # stored bytes decoded per step: the decoders' temporaries stay a few times this
KEEP_BLOCKS = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "MXFP4", "Q4_0", "Q4_1")  # the types kquant.py reads as stored


def decode(data: FileBytes, type_name: str, shape: tuple[int, ...]) -> torch.Tensor | QuantizedWeight:
    """One tensor's stored bytes in Pagoda's form: a float tensor of `shape` in its own dtype, or a
    QuantizedWeight with `shape` [N, K] for a block type (a stack [E, N, K] of experts' matrices as [E * N, K]),
    decoded a slab of rows at a time. K-quants stay as stored (a BlockWeight, decoded when asked for), for the
    kernel that reads them so (quantization/kquant.py)."""
    if type_name in FLOAT_TYPES:
        return data.read(0, data.size).view(FLOAT_TYPES[type_name]).view(shape)
    if type_name not in _DECODERS:
        raise ValueError(f"GGUF type {type_name} is not supported; supported: {', '.join(SUPPORTED_TYPES)}")
    block_bytes, block_values, bits, group = QUANT_TYPES[type_name]
    if len(shape) not in (2, 3):
        raise ValueError(
            f"a {type_name} tensor of shape {shape} is neither a matrix nor a stack of them (a mixture of experts'); "
            "Pagoda cannot read it"
        )
    rows, cols = math.prod(shape[:-1]), shape[-1]  # a stack of experts' matrices: their rows one after another
    if cols % block_values:
        raise ValueError(
            f"a {type_name} tensor's rows hold whole {block_values}-value blocks, but it has {cols} "
            "columns; the file is corrupt"
        )
    row_bytes = cols // block_values * block_bytes
    if type_name in KEEP_BLOCKS:
        stored = UnreadBlocks((rows, row_bytes), data.read_into)
        return BlockWeight(stored, type_name, (rows, cols), bits, group, partial(decode_stored, type_name))
    codes, scale, offset = _decode_rows(
        lambda start, stop: data.read(start * row_bytes, stop * row_bytes), type_name, rows, cols
    )
    return QuantizedWeight(bits, codes, scale, offset, group, type_name)


def decode_stored(type_name: str, stored: torch.Tensor, cols: int):
    """BlockWeight's decoder: codes, scales and offsets of stored blocks [rows, row bytes]."""
    return _decode_rows(lambda start, stop: stored[start:stop].reshape(-1), type_name, stored.shape[0], cols)


def _decode_rows(read, type_name: str, rows: int, cols: int):
    """(codes, scale, offset) of `rows` rows whose bytes `read(start_row, stop_row)` gives, a slab at a time."""
    block_bytes, block_values, _, group = QUANT_TYPES[type_name]
    row_bytes, groups = cols // block_values * block_bytes, cols // group
    step = max(1, DECODE_SLAB_BYTES // row_bytes)
    codes = scale = offset = None
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        blocks = read(start, stop).view(-1, block_bytes)
        part_codes, part_scale, part_offset = _DECODERS[type_name](blocks)
        if codes is None:  # where the blocks are: a GPU's blocks decode there
            codes = torch.empty(rows, cols, dtype=part_codes.dtype, device=part_codes.device)
            scale = torch.empty(rows, groups, device=part_codes.device)
            offset = None if part_offset is None else torch.empty(rows, groups, device=part_codes.device)
        codes[start:stop] = part_codes.reshape(stop - start, cols)
        scale[start:stop] = part_scale.reshape(stop - start, groups)
        if offset is not None:
            offset[start:stop] = part_offset.reshape(stop - start, groups)
    return codes, scale, offset
