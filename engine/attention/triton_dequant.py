"""Reading a quantized KV cache's rows (engine/attention/kv_format.py) inside a Triton kernel: bytes to numbers, in
registers. The attention kernels (triton_kernels.py) call `load_kv` for every tile of keys and values."""

import triton
import triton.language as tl

from engine.attention.kv_format import SCALE_BYTES

KV_QUANT_CODES = {"auto": 0, "int8": 1, "fp8": 2, "int4": 3}  # the kernel's KV_QUANT for each kv_cache_dtype
_SCALE_BYTES = tl.constexpr(SCALE_BYTES)  # a global a kernel may read


@triton.jit
def _load_scale(at, mask):
    """float16 scales read a byte at a time: a row's scales need not be 2-byte aligned (an int4 row whose head_dim
    is 2 mod 4)."""
    low = tl.load(at, mask=mask, other=0).to(tl.uint16)
    high = tl.load(at + 1, mask=mask, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True)


@triton.jit
def load_kv(
    cache_ptr,
    kv_off,
    n_valid,
    d,
    kv_mask,
    OUT: tl.constexpr,  # the attention's dtype: a product in float32 rounded to it is the reference's product in it
    KV_QUANT: tl.constexpr,
    KV_GROUP: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """A tile of keys or values [BLOCK_N, BLOCK_D]: as stored (KV_QUANT 0), or dequantized from rows of bytes: int8
    (1), fp8 e4m3 (2) or two 4-bit values a byte, stored + 8 (3), times the float16 scale of each KV_GROUP values
    (a row's for int8 and fp8), which sit SCALE_OFF bytes into the row."""
    rows = cache_ptr + kv_off[:, None]
    if KV_QUANT == 0:
        tile = tl.load(rows + d[None, :], mask=kv_mask, other=0.0)
    elif KV_QUANT == 3:
        packed = tl.load(rows + (d // 2)[None, :], mask=kv_mask, other=0)
        values = (((packed >> ((d % 2) * 4).to(tl.uint8)[None, :]) & 15).to(tl.int8) - 8).to(tl.float32)
        GROUPS: tl.constexpr = BLOCK_D // KV_GROUP
        g = tl.arange(0, GROUPS)
        scale = _load_scale(
            rows + SCALE_OFF + _SCALE_BYTES * g[None, :], n_valid[:, None] & (g < HEAD_DIM // KV_GROUP)[None, :]
        )
        grouped = tl.reshape(values, (BLOCK_N, GROUPS, KV_GROUP)) * scale.to(tl.float32)[:, :, None]
        tile = tl.reshape(grouped, (BLOCK_N, BLOCK_D)).to(OUT)
    else:
        raw = tl.load(rows + d[None, :], mask=kv_mask, other=0)
        if KV_QUANT == 1:
            values = raw.to(tl.int8, bitcast=True).to(tl.float32)
        else:
            # e4m3 by hand (Triton converts float8e4nv only on sm_89 and later, and RTX 30 is sm_86): its exponent
            # and mantissa bits moved into a float16's, whose exponent bias is 8 more, then times 2^8; exact,
            # subnormals included
            sign = (raw & 0x80).to(tl.uint16) << 8
            half = (sign | ((raw & 0x7F).to(tl.uint16) << 7)).to(tl.float16, bitcast=True)
            values = half.to(tl.float32) * 256.0
        scale = _load_scale(cache_ptr + kv_off + SCALE_OFF, n_valid)
        tile = (values * scale.to(tl.float32)[:, None]).to(OUT)
    return tile
