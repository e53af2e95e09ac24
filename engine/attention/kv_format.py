"""How keys and values are stored in the paged KV cache: in the model's dtype (`auto`), or quantized (`int8`, `fp8`,
`int4`) so that the same memory holds two to three and a half times the tokens.

A quantized cache holds bytes. Each token's keys (or values) of one KV head are one row of `row_width(head_dim)`
bytes, the quantized numbers first and their float16 scales after them:

    int8   head_dim int8 values      + 1 scale   (per token and head: absmax / 127)
    fp8    head_dim float8_e4m3 values + 1 scale (per token and head: absmax / 448)
    int4   head_dim / 2 bytes of two 4-bit values + a scale per group of INT4_GROUP values (llama.cpp's q4_0:
           the value of largest magnitude maps to -8)

so the cache tensors' shapes (`KVCacheLayout`), block ids, prefix caching and preemption do not change: a row is
just wider or narrower than head_dim. The scales are per token, worked out as each token is written, so nothing is
calibrated and a block's bytes depend only on its own tokens (a prefix-cache hit reads exactly what was written).

Before they are quantized, keys and values are rotated by a Hadamard matrix (`hadamard`, QuaRot's trick; the
Attention layer applies it): a few channels of a head carry most of its magnitude, and a scale sized for them
leaves the rest a handful of levels; rotated, every channel carries a share of them. The query is rotated the same
way, so its scores with the rotated keys are the scores it had, and the attention's output, a mix of rotated
values, is rotated back (the matrix is its own inverse). The backends attend as they would over any cache.

fp8 and int4 also store each key less its head's mean key (`centres_keys`; engine/attention/key_mean.py): the keys
of a head share a large common part, which a per-token scale would otherwise spend most of its levels on.

`pack` turns a step's new keys (or values) into rows, `unpack` turns rows read from the cache back into numbers of
the attention's dtype. Backends that read a quantized cache take the format as `kv_format=` (KV_FORMAT_BACKENDS).
"""

import functools
from dataclasses import dataclass

import torch

from engine.config import KV_CACHE_DTYPES

KV_FORMAT_BACKENDS = ("torch", "triton")  # the attention backends that read a quantized cache
INT4_GROUP = 32  # values sharing one int4 scale (fewer where head_dim is not a multiple of it)
SCALE_BYTES = 2  # a float16 scale
FP8_MAX = 448.0  # the largest float8_e4m3fn


@dataclass(frozen=True)
class KVFormat:
    name: str = "auto"  # one of KV_CACHE_DTYPES

    @property
    def quantized(self) -> bool:
        return self.name != "auto"

    @property
    def centres_keys(self) -> bool:
        """Whether keys are stored less their head's mean key (engine/attention/key_mean.py): the formats whose
        keys lose too much otherwise. int8 keeps them whole (within 0.02% perplexity already, and faster to read)."""
        return self.name in ("fp8", "int4")

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The cache tensors' element type."""
        return model_dtype if not self.quantized else torch.uint8

    def group(self, head_dim: int) -> int:
        """Values per scale: the whole head for int8 and fp8; for int4 at most INT4_GROUP, a divisor of head_dim."""
        if self.name != "int4":
            return head_dim
        group = INT4_GROUP
        while head_dim % group:
            group //= 2
        return group

    def row_width(self, head_dim: int) -> int:
        """Elements of storage_dtype per token and KV head."""
        if not self.quantized:
            return head_dim
        values = head_dim // 2 if self.name == "int4" else head_dim
        return values + SCALE_BYTES * (head_dim // self.group(head_dim))

    def check_head_dim(self, head_dim: int) -> None:
        if self.name == "int4" and head_dim % 2:
            raise ValueError(
                f"kv_cache_dtype='int4' packs two values a byte, and this model's heads have {head_dim} (odd) values; "
                "use kv_cache_dtype='int8' or 'fp8'"
            )

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[num_tokens, num_kv_heads, head_dim] keys or values -> their rows: as they are for `auto` (the store casts
        them), else uint8 [num_tokens, num_kv_heads, row_width]."""
        if not self.quantized:
            return x
        head_dim = x.shape[-1]
        group = self.group(head_dim)
        grouped = x.float().unflatten(-1, (head_dim // group, group))  # [N, H, groups, group]
        if self.name == "int4":
            # q4_0: the value of largest magnitude, whatever its sign, becomes -8; the other side reaches +7
            index = grouped.abs().argmax(-1, keepdim=True)
            scale = grouped.gather(-1, index) / -8.0
        else:
            scale = grouped.abs().amax(-1, keepdim=True) / (127.0 if self.name == "int8" else FP8_MAX)
        # Divided by the float32 scale, not by the float16 one stored: a compiled step skips the float16 rounding
        # in between (inductor does not emulate such casts), and eager and compiled steps must write the same bytes.
        # It costs at most 2^-11 of the group's largest value.
        scaled = grouped / torch.where(scale == 0, 1.0, scale)
        if self.name == "int8":
            values = scaled.round().clamp(-127, 127).to(torch.int8).view(torch.uint8).flatten(-2)
        elif self.name == "fp8":
            values = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8).flatten(-2)
        else:
            nibbles = (scaled.round().clamp(-8, 7) + 8).to(torch.uint8).flatten(-2)
            values = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
        return torch.cat((values, scale.squeeze(-1).half().view(torch.uint8)), dim=-1)

    def unpack(self, rows: torch.Tensor, dtype: torch.dtype, head_dim: int) -> torch.Tensor:
        """Rows read from the cache [..., num_kv_heads, row_width] -> keys or values [..., num_kv_heads, head_dim]
        in `dtype`."""
        if not self.quantized:
            return rows.to(dtype)
        group = self.group(head_dim)
        # Contiguous: a multiply broadcasting strided scales over the numbers ran 5x slower
        scales = _scales(rows, head_dim // group).to(dtype, memory_format=torch.contiguous_format)
        # Each format's numbers are widened by integer operations, which run several times faster on a CPU than
        # torch's own float8 conversion or an interleaving stack. A strided input (a backend's [.., L, Hkv, row] read
        # as [.., Hkv, L, row]) widens into a contiguous tensor in its own order: what attention reads fastest.
        if self.name == "int4":
            # byte hi:lo -> the int16 0x0h0l (hi:lo + hi0 * 15), whose two bytes in memory (little-endian, as on
            # every machine torch runs on) are lo, hi: the numbers in order
            packed = rows[..., : head_dim // 2].to(torch.int16, memory_format=torch.contiguous_format)
            nibbles = (packed & 0xF0).mul_(15).add_(packed)
            values = nibbles.view(torch.uint8).to(dtype).sub_(8)
        elif self.name == "fp8":
            # e4m3's sign, exponent and mantissa bits moved to float16's places: the same number times 2^-8 (float16's
            # exponent bias is 8 more), subnormals included; the scale takes the 2^8 back. Sign-extended and shifted,
            # the sign lands on bits 15 and 14, and bit 14 (float16's top exponent bit) is cleared.
            byte = rows[..., :head_dim].view(torch.int8).to(torch.int16, memory_format=torch.contiguous_format)
            values = ((byte << 7) & -0x4001).view(torch.float16).to(dtype)
            scales = scales * 256.0
        else:
            values = rows[..., :head_dim].view(torch.int8).to(dtype, memory_format=torch.contiguous_format)
        return values.unflatten(-1, (head_dim // group, group)).mul_(scales[..., None]).flatten(-2)


def _scales(rows: torch.Tensor, count: int) -> torch.Tensor:
    """The float16 scales at the end of each row: read in place where the rows' bytes are 2-byte aligned (so for an
    even row width: backends read rows whole, from a block's start), else copied out first. (The storage offset is
    not checked: a compiled step cannot read it.)"""
    aligned = rows.shape[-1] % 2 == 0 and rows.stride(-1) == 1
    aligned = aligned and all(stride % 2 == 0 for stride in rows.stride()[:-1])
    if aligned:
        return rows.view(torch.float16)[..., rows.shape[-1] // 2 - count :]
    return rows[..., rows.shape[-1] - SCALE_BYTES * count :].contiguous().view(torch.float16)


def rotate_and_pack(x: torch.Tensor, rotation: torch.Tensor | None, kv_format: KVFormat) -> torch.Tensor:
    """A step's new keys (or values) -> the rows the cache stores: rotated first where the format quantizes (see the
    module docstring), in float32 straight into the quantizer. One function so that a CUDA graph captures it
    compiled (engine/runner/kernel_passes.py): one fused kernel where the eager ops are a dozen small ones."""
    return kv_format.pack(x if rotation is None else x.float() @ rotation)


@functools.cache
def hadamard(size: int, device: torch.device) -> torch.Tensor:
    """A symmetric orthogonal float32 matrix of ±1/sqrt(n) entries: Sylvester's Hadamard matrix of size n, the largest
    power of two dividing `size`, repeated along the diagonal (a head_dim of 80 gets five of size 16)."""
    n = size & -size
    block = torch.ones(1, 1)
    while block.shape[0] < n:
        block = torch.cat((torch.cat((block, block), 1), torch.cat((block, -block), 1)), 0)
    return torch.block_diag(*[block / n**0.5] * (size // n)).to(device)


PLAIN = KVFormat()  # the model's dtype, as the cache stored keys and values before any format


def kv_format(name: str) -> KVFormat:
    """The format named by `kv_cache_dtype`, or an error that lists the ones there are."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    return KVFormat(name)
