"""A GGUF file's header: its metadata and where each tensor's bytes lie, read in one pass over a memory map.

gguf-py's GGUFReader builds numpy views of every element of every metadata array. A 150k-token vocabulary and its
150k merges took it 5.7 s (and as long again when transformers' AutoTokenizer parsed the file a second time), most
of a Qwen3-4B file's time to first token (issue 38). The layout is small (llama.cpp's docs/gguf.md): this walks it
with `struct` and takes gguf-py's enums for the value and tensor types. 0.3 s for that header.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_DEFAULT_ALIGNMENT = 32  # where general.alignment is absent


@dataclass(frozen=True)
class TensorEntry:
    name: str
    type_name: str  # GGMLQuantizationType's name: Q4_K, F32, ...
    shape: tuple[int, ...]  # rows first, as torch has it
    offset: int  # of its first byte in the file
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, Any]  # arrays as lists, as gguf-py's ReaderField.contents() gives them
    tensors: list[TensorEntry]


def read_header(path: str | Path) -> GGUFHeader:
    """Parse `path`'s metadata and tensor table. Raises ValueError on a file that is not GGUF or is cut short."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        try:
            return _Parser(view).header()
        except (struct.error, IndexError) as e:
            raise ValueError(f"the header ends early ({e})") from e


class _Parser:
    def __init__(self, view: mmap.mmap):
        self.view, self.pos = view, 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.view, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        if self.pos + length > len(self.view):
            raise ValueError("the header ends early (a string runs past the end of the file)")
        text = self.view[self.pos : self.pos + length].decode("utf-8", errors="replace")
        self.pos += length
        return text

    def value(self, kind: int) -> Any:
        kind = GGUFValueType(kind)
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])[0]
        if kind == GGUFValueType.STRING:
            return self.string()
        element, count = self.unpack("<IQ")
        element = GGUFValueType(element)
        if element in _SCALARS:  # one read for the whole array: token types, scores
            dtype = np.dtype(_SCALARS[element])
            values = np.frombuffer(self.view, dtype, count, self.pos).tolist()
            self.pos += dtype.itemsize * count
            return values
        if element == GGUFValueType.STRING:
            return self.strings(count)
        return [self.value(element) for _ in range(count)]

    def strings(self, count: int) -> list[str]:
        """`count` strings, as `string` reads one, in a loop of locals: a vocabulary and its merges are 300k."""
        view, pos, size, unpack_from, out = self.view, self.pos, len(self.view), struct.unpack_from, []
        for _ in range(count):
            (length,) = unpack_from("<Q", view, pos)
            pos += 8
            if pos + length > size:
                raise ValueError("the header ends early (a string runs past the end of the file)")
            out.append(view[pos : pos + length].decode("utf-8", errors="replace"))
            pos += length
        self.pos = pos
        return out

    def header(self) -> GGUFHeader:
        if self.view[:4] != b"GGUF":
            raise ValueError("it does not start with GGUF's magic bytes")
        (version,) = self.unpack("<4xI")
        if version not in (2, 3):
            raise ValueError(
                f"it is GGUF version {version} (a big-endian file, or a newer format); Pagoda reads 2 and 3"
            )
        tensor_count, field_count = self.unpack("<QQ")
        metadata = {}
        for _ in range(field_count):
            key = self.string()
            (kind,) = self.unpack("<I")
            metadata[key] = self.value(kind)
        table = []
        for _ in range(tensor_count):
            name = self.string()
            (dims,) = self.unpack("<I")
            shape = self.unpack(f"<{dims}Q")
            kind, offset = self.unpack("<IQ")
            table.append((name, GGMLQuantizationType(kind), tuple(reversed(shape)), offset))
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-self.pos // alignment) * alignment
        tensors = []
        for name, kind, shape, offset in table:
            block_values, block_bytes = GGML_QUANT_SIZES[kind]
            tensors.append(
                TensorEntry(name, kind.name, shape, data_start + offset, prod(shape) // block_values * block_bytes)
            )
        return GGUFHeader(metadata, tensors)
