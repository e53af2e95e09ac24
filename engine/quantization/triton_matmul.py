"""Matmuls by Pagoda's quantized weights (engine/quantization/layout.py) as Triton kernels for NVIDIA GPUs.

The weight never exists in full precision: each program loads the integer codes of its tile and
their group scales and offsets, dequantizes them in registers (w = q * scale + offset, in fp32)
and multiplies. Two kernels share that dequantization (`_dequantize`):

- `quant_gemv`, for decode (1 to 8 rows): like engine/layers/gemv.py, each program owns BLOCK_N
  weight rows and streams their codes once along K, wide loads, multiplying in fp32 on the CUDA
  cores. Every row of x reuses the dequantized tile, so the codes are read once per step: at 4
  bits that is a quarter of bf16's bytes, which is what makes batch-1 decode fast.
- `quant_matmul`, for prefill (any rows): a tiled GEMM that dequantizes a [BLOCK_N, BLOCK_K]
  weight tile, rounds it to the activations' dtype and feeds it to `tl.dot` (tensor cores),
  accumulating in fp32. Each M tile dequantizes the weights again; prefill is compute-bound and
  that costs CUDA-core work beside the tensor cores, not memory traffic.

The device layout (`pack_for_triton`) packs 4-bit codes two to a byte along K (code k in byte
k // 2, even k in the low nibble) and pads each row to a multiple of 16 bytes, so that every row
starts aligned and the compiler may vectorise its loads. A thread takes runs of 8 codes (4 bytes
at 4 bits), the 8 fp16/bf16 values of x that one 16-byte load brings: the codes then land in the
registers of the x values they meet, and the sm_90 code has no layout change of the weight tile
(only of the small [BLOCK_N, groups] scale tile). Scales and offsets are stored in the
activations' dtype by default: at 4 bits in groups of 32, fp32 scales plus offsets would add half
again to the bytes a decode step reads, fp16/bf16 a quarter. That rounding is the kernels' (a QuantizedWeight
keeps exact float32 values): bf16 keeps 8 significant bits of a scale, fp16 11 bits but fewer
below 6e-5 (subnormals), so fp16 models with tiny scales should pass `scale_dtype=torch.float32`.

Which kernel and tile serve each row count is measured when a layer loads (`choose_quant_tiles`),
against tinygemm (`torch.ops.aten._weight_int4pack_mm`) where that applies (4 bits, bf16, groups
of 32 to 256); elsewhere there is nothing else that multiplies by the codes in place, so a
Triton kernel is used and only its tile is chosen.
"""

import itertools
import logging
import os
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl

from engine.layers.gemv import MIN_SPEEDUP, cuda_timer, min_programs, try_tile
from engine.quantization.kernels import QuantizedMatmul
from engine.quantization.layout import QuantizedWeight

log = logging.getLogger("engine")

ROW_ALIGN_BYTES = 16  # packed rows padded to this: aligned rows let every load be 16 bytes wide
GEMV_ROW_BUCKETS = (1, 2, 4, 8)  # rows the GEMV takes, padded up to the next bucket
# A call with r rows uses the choice of the smallest bucket >= r, and the last one beyond it.
ROW_BUCKETS = (*GEMV_ROW_BUCKETS, 16, 64, 256)
MAX_GEMV_TILE = 8192  # rows x BLOCK_N x BLOCK_K fp32 products live at once: 64 registers a thread at 4 warps
TINYGEMM_GROUPS = (32, 64, 128, 256)


@dataclass
class TritonQuantWeight:
    """A QuantizedWeight in the layout the kernels read (see the module docstring)."""

    bits: int
    q: torch.Tensor  # 4 bits: [N, Kp // 2] uint8, two codes a byte; 8 bits: [N, Kp] int8; Kp = K padded to 32
    scale: torch.Tensor  # [N, ceil(K / group_size)], contiguous, in the scale dtype
    offset: torch.Tensor | None  # like scale; None means zero
    group_size: int  # as in QuantizedWeight; >= K means one scale per row
    k: int  # the real K: codes past it are zero padding

    @property
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.offset) if t is not None)

    def clone(self) -> "TritonQuantWeight":
        return TritonQuantWeight(
            self.bits,
            self.q.clone(),
            self.scale.clone(),
            None if self.offset is None else self.offset.clone(),
            self.group_size,
            self.k,
        )


def pack_for_triton(
    qw: QuantizedWeight, dtype: torch.dtype, scale_dtype: torch.dtype | None = None
) -> TritonQuantWeight:
    """`qw` in the kernels' layout for activations of `dtype` (fp16 or bf16), on qw's device. Scales
    and offsets are rounded to `scale_dtype` (default: `dtype`); that rounding is the only change."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the quantized kernels take fp16 or bf16 activations, not {dtype}")
    n, k = qw.shape
    codes_per_row = -(-k // 32) * 32 if qw.bits == 4 else -(-k // ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES
    codes = torch.nn.functional.pad(qw.q, (0, codes_per_row - k))
    if qw.bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)  # two codes a byte, even k in the low nibble
    scale_dtype = scale_dtype or dtype
    offset = None if qw.offset is None else qw.offset.to(scale_dtype).contiguous()
    return TritonQuantWeight(
        qw.bits, codes.contiguous(), qw.scale.to(scale_dtype).contiguous(), offset, qw.group_size, k
    )


@triton.jit
def _runs_of(SIZE: tl.constexpr, RUN: tl.constexpr):
    """tl.arange(0, SIZE), known to the compiler only as contiguous in runs of RUN."""
    i = tl.arange(0, SIZE)
    return i // RUN * RUN + i % RUN


@triton.jit
def _dequantize(
    q_ptr,
    s_ptr,
    o_ptr,
    q_rows,
    s_rows,
    k0,
    K_CODES,
    group_size,
    num_groups,
    MASKED: tl.constexpr,
    BITS: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The fp32 weights of columns [k0, k0 + BLOCK_K) of the rows whose code and scale rows start
    at offsets `q_rows` and `s_rows` ([BLOCK_N] each): a [BLOCK_N, BLOCK_K] tile. The chunk holds
    GROUPS whole groups, or lies inside one (GROUPS = 1). A MASKED chunk reads nothing at or past
    K_CODES (the padded row length), nor scales past num_groups: those weights come out 0."""
    # Runs of 8 codes a thread (4 bytes at 4 bits, 8 at 8), as the compiler would split a
    # contiguous range into 16-byte loads: 8 codes then meet the 8 fp16/bf16 values of x that one
    # 16-byte load brings, in the same registers, and the product needs no layout change.
    if BITS == 4:
        j = k0 // 2 + _runs_of(BLOCK_K // 2, 4)
        ptrs = q_ptr + q_rows[:, None] + j[None, :]
        if MASKED:
            packed = tl.load(ptrs, mask=j[None, :] < K_CODES // 2, other=0)
        else:
            packed = tl.load(ptrs)
        # Interleaving puts both codes of a byte side by side in one thread's registers: k order.
        codes = tl.interleave(packed & 15, packed >> 4).to(tl.float32)
    else:
        kk = k0 + _runs_of(BLOCK_K, 8)
        ptrs = q_ptr + q_rows[:, None] + kk[None, :]
        if MASKED:
            codes = tl.load(ptrs, mask=kk[None, :] < K_CODES, other=0).to(tl.float32)
        else:
            codes = tl.load(ptrs).to(tl.float32)
    g = k0 // group_size + tl.arange(0, GROUPS)
    s_ptrs = s_rows[:, None] + g[None, :]
    if MASKED:
        scale = tl.load(s_ptr + s_ptrs, mask=g[None, :] < num_groups, other=0.0).to(tl.float32)
    else:
        scale = tl.load(s_ptr + s_ptrs).to(tl.float32)
    if HAS_OFFSET:
        if MASKED:
            offset = tl.load(o_ptr + s_ptrs, mask=g[None, :] < num_groups, other=0.0).to(tl.float32)
        else:
            offset = tl.load(o_ptr + s_ptrs).to(tl.float32)
    # One scale (and offset) per group of BLOCK_K // GROUPS columns: split K into (group, column in
    # group), which only relabels registers, and broadcast along the columns.
    w = tl.reshape(codes, (BLOCK_N, GROUPS, BLOCK_K // GROUPS)) * scale[:, :, None]
    if HAS_OFFSET:
        w += offset[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _quant_gemv_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    o_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    K_CODES,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    group_size,
    num_groups,
    BITS: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K is a multiple of BLOCK_K: no partial last chunk
    GROUPS: tl.constexpr,  # scale groups in a chunk of BLOCK_K columns (1: the chunk lies in one)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]) for BLOCK_N weight rows and the M <= BLOCK_M rows of x.

    Each chunk's dequantized tile meets all rows of x at once as a [BLOCK_M, BLOCK_N, BLOCK_K]
    product, summed along K at once (as in _normed_gemv_kernel: a model's K spans a few chunks,
    and full-tile accumulators for 8 rows would not fit in registers). x is loaded broadcast
    into that layout, so the product needs no layout change."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Weight rows past N and x rows past M re-read the last real row (in bounds), so only a
    # partial last chunk needs masks; the stores drop those rows. int64: an LM head can pass 2**31 codes.
    rows = tl.minimum(n, N - 1).to(tl.int64)
    q_rows, s_rows = rows * stride_qn, rows * stride_sn
    m = tl.arange(0, BLOCK_M)
    k = tl.zeros((BLOCK_M, BLOCK_N, 1), dtype=tl.int32) + tl.arange(0, BLOCK_K)[None, None, :]
    x_ptrs = x_ptr + (tl.minimum(m, M - 1) * stride_xm)[:, None, None] + k
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    whole = K if EVEN_K else K - K % BLOCK_K
    for k0 in range(0, whole, BLOCK_K):
        w = _dequantize(
            q_ptr,
            s_ptr,
            o_ptr,
            q_rows,
            s_rows,
            k0,
            K_CODES,
            group_size,
            num_groups,
            False,
            BITS,
            HAS_OFFSET,
            GROUPS,
            BLOCK_N,
            BLOCK_K,
        )
        acc += w[None, :, :] * tl.load(x_ptrs + k0).to(tl.float32)
    if not EVEN_K:
        w = _dequantize(
            q_ptr,
            s_ptr,
            o_ptr,
            q_rows,
            s_rows,
            whole,
            K_CODES,
            group_size,
            num_groups,
            True,
            BITS,
            HAS_OFFSET,
            GROUPS,
            BLOCK_N,
            BLOCK_K,
        )
        acc += w[None, :, :] * tl.load(x_ptrs + whole, mask=k < K - whole, other=0.0).to(tl.float32)
    out = tl.sum(acc, axis=2)
    if HAS_BIAS:
        out += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + m[:, None] * stride_om + n[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=(m[:, None] < M) & (n[None, :] < N))


@triton.jit
def _quant_matmul_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    o_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    K_CODES,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    group_size,
    num_groups,
    BITS: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    GROUPS: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # feed tl.dot fp32 (interpreter only: its bf16 dot is broken)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out = x @ w.T (+ b) for one [BLOCK_M, BLOCK_N] tile. Program ids run along M first, so the
    programs that dequantize the same weight tile run together and its codes come from L2."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(n, N - 1).to(tl.int64)
    q_rows, s_rows = rows * stride_qn, rows * stride_sn
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (tl.minimum(m, M - 1).to(tl.int64) * stride_xm)[:, None] + k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    whole = K if EVEN_K else K - K % BLOCK_K
    for k0 in range(0, whole, BLOCK_K):
        x = tl.load(x_ptrs + k0)
        w = _dequantize(
            q_ptr,
            s_ptr,
            o_ptr,
            q_rows,
            s_rows,
            k0,
            K_CODES,
            group_size,
            num_groups,
            False,
            BITS,
            HAS_OFFSET,
            GROUPS,
            BLOCK_N,
            BLOCK_K,
        )
        acc = _dot(x, w, acc, UPCAST_DOT)
    if not EVEN_K:
        x = tl.load(x_ptrs + whole, mask=k[None, :] < K - whole, other=0.0)
        w = _dequantize(
            q_ptr,
            s_ptr,
            o_ptr,
            q_rows,
            s_rows,
            whole,
            K_CODES,
            group_size,
            num_groups,
            True,
            BITS,
            HAS_OFFSET,
            GROUPS,
            BLOCK_N,
            BLOCK_K,
        )
        acc = _dot(x, w, acc, UPCAST_DOT)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(m[:, None] < M) & (n[None, :] < N))


@triton.jit
def _dot(x, w, acc, UPCAST: tl.constexpr):
    """acc + x @ w.T, with w rounded to x's dtype first: the tensor cores take fp16/bf16 operands."""
    w = w.to(x.dtype)
    if UPCAST:  # exact: both operands are already rounded
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w), acc)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")


def chunk_groups(w: TritonQuantWeight, block_k: int) -> int | None:
    """Scale groups in a chunk of `block_k` columns (1 where the chunk lies inside one group), or
    None when groups straddle chunks, a layout these kernels do not read."""
    g = w.group_size
    if g >= w.k or g % block_k == 0:
        return 1
    return block_k // g if block_k % g == 0 else None


def _check(x: torch.Tensor, w: TritonQuantWeight, bias: torch.Tensor | None, block_k: int, kernel: str) -> int:
    if x.dim() != 2 or x.shape[1] != w.k or x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{kernel} takes fp16 or bf16 x of shape [M, {w.k}]; got {tuple(x.shape)} {x.dtype}")
    if bias is not None and bias.shape != (w.n,):
        raise ValueError(f"{kernel}'s bias must have shape ({w.n},), got {tuple(bias.shape)}")
    groups = chunk_groups(w, block_k)
    if groups is None or block_k & (block_k - 1):
        raise ValueError(
            f"BLOCK_K={block_k} must be a power of two that groups of {w.group_size} divide, or that divides them"
        )
    return groups


def _args(x: torch.Tensor, w: TritonQuantWeight, bias: torch.Tensor | None, out: torch.Tensor) -> tuple:
    k_codes = w.q.shape[1] * (2 if w.bits == 4 else 1)
    return (
        x,
        w.q,
        w.scale,
        w.offset if w.offset is not None else w.scale,
        bias if bias is not None else w.scale,
        out,
        x.shape[0],
        w.n,
        w.k,
        k_codes,
        x.stride(0),
        w.q.stride(0),
        w.scale.stride(0),
        out.stride(0),
        w.group_size,
        w.scale.shape[1],
    )


def gemv_row_bucket(rows: int) -> int | None:
    """The GEMV's BLOCK_M for `rows` rows, or None past its last bucket."""
    return next((b for b in GEMV_ROW_BUCKETS if rows <= b), None) if rows >= 1 else None


def quant_gemv(
    x: torch.Tensor, w: TritonQuantWeight, bias: torch.Tensor | None, block_n: int, block_k: int
) -> torch.Tensor:
    """x @ dequantized(w).T (+ bias) for 1 to 8 rows of x, in x's dtype: dequantized and summed in fp32."""
    groups = _check(x, w, bias, block_k, "quant_gemv")
    block_m = gemv_row_bucket(x.shape[0])
    if block_m is None:
        raise ValueError(f"quant_gemv takes 1 to {GEMV_ROW_BUCKETS[-1]} rows, got {x.shape[0]}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((x.shape[0], w.n), dtype=x.dtype, device=x.device)
    _quant_gemv_kernel[(triton.cdiv(w.n, block_n),)](
        *_args(x, w, bias, out),
        BITS=w.bits,
        HAS_OFFSET=w.offset is not None,
        HAS_BIAS=bias is not None,
        EVEN_K=w.k % block_k == 0,
        GROUPS=groups,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out


def quant_matmul(
    x: torch.Tensor,
    w: TritonQuantWeight,
    bias: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """x @ dequantized(w).T (+ bias) for any rows of x, in x's dtype: the weights are rounded to x's
    dtype after dequantizing (tensor-core operands) and the products summed in fp32."""
    groups = _check(x, w, bias, block_k, "quant_matmul")
    if min(block_m, block_n, block_k) < 16:
        raise ValueError(f"tl.dot needs tiles of at least 16, got {block_m}x{block_n}x{block_k}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((x.shape[0], w.n), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    _quant_matmul_kernel[(triton.cdiv(x.shape[0], block_m), triton.cdiv(w.n, block_n))](
        *_args(x, w, bias, out),
        BITS=w.bits,
        HAS_OFFSET=w.offset is not None,
        HAS_BIAS=bias is not None,
        EVEN_K=w.k % block_k == 0,
        GROUPS=groups,
        UPCAST_DOT=_interpreting(),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


# --------------------------------------------------------------------------------------------
# Choosing a kernel and tile per row bucket, at load


class Tile(NamedTuple):
    kernel: str  # "gemv" or "matmul"
    block_m: int  # the GEMV's row bucket, or the GEMM's BLOCK_M
    block_n: int
    block_k: int


def tile_candidates(bucket: int, w: TritonQuantWeight) -> list[Tile]:
    """Tiles to try for `bucket` rows on `w`: the GEMV's (accumulators within the register
    budget, at least 1,024 codes a step) up to 8 rows, and the GEMM's, whose tensor cores may
    already win at a few rows where the GEMV's fp32 multiply-adds grow with the rows."""
    tiles = []
    if bucket <= GEMV_ROW_BUCKETS[-1]:
        # At least 1,024 codes a step: 8 for each of the 128 threads, or some would hold copies.
        # Chunks wider than K would only be masked.
        tiles += [
            Tile("gemv", bucket, bn, bk)
            for bn in (2, 4, 8, 16)
            for bk in (256, 512, 1024, 2048)
            if bucket * bn * bk <= MAX_GEMV_TILE and bn * bk >= 1024 and bk <= max(256, w.k)
        ]
    if bucket >= 4:
        # The dequantized tile sits in registers as fp32: at most 64 of them a thread (4 warps); a
        # 128 x 128 x 128 tile reached the 255-register limit in the sm_86 and sm_90 code.
        tiles += [
            Tile("matmul", bm, bn, bk)
            for bm in (16, 32, 64, 128)
            if bm <= max(16, bucket)
            for bn in (64, 128)
            for bk in (64, 128)
            if bn * bk <= 8192
        ]
    return [t for t in tiles if chunk_groups(w, t.block_k) is not None]


def run_tile(x: torch.Tensor, w: TritonQuantWeight, bias: torch.Tensor | None, tile: Tile) -> torch.Tensor:
    """x @ dequantized(w).T (+ bias) on `tile`."""
    if tile.kernel == "gemv":
        return quant_gemv(x, w, bias, tile.block_n, tile.block_k)
    return quant_matmul(x, w, bias, tile.block_m, tile.block_n, tile.block_k)


def tile_for(tiles: dict[int, Tile], rows: int) -> Tile | None:
    """The chosen tile for `rows` rows: that of the smallest measured bucket >= rows, or of the largest."""
    if not tiles:
        return None
    bucket = min((b for b in tiles if rows <= b), default=max(tiles))
    return tiles[bucket]


def reference(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ qw.dequantize().T (+ bias) in float32, a slice of rows at a time: never the whole weight."""
    out = torch.cat([x.float() @ qw.rows(i, 1024).dequantize().T for i in range(0, qw.shape[0], 1024)], dim=1)
    return out + bias.float() if bias is not None else out


def tinygemm_applies(qw: QuantizedWeight, dtype: torch.dtype) -> bool:
    """Whether tinygemm's int4 matmul can serve `qw` for `dtype` activations on this build."""
    n, k = qw.shape
    return (
        qw.bits == 4
        and dtype == torch.bfloat16
        and qw.group_size in TINYGEMM_GROUPS
        and k % qw.group_size == 0
        and k % 32 == 0
        and n % 8 == 0
        and qw.q.is_cuda
        and hasattr(torch.ops.aten, "_weight_int4pack_mm")
    )


def tinygemm_pack(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, int]:
    """qw for tinygemm: its int4 packing, its [K / g, N, 2] bf16 scales and zeros, and the group size.
    tinygemm computes (q - 8) * scale + zero, so zero = offset + 8 * scale."""
    k = qw.shape[1]
    inner_k_tiles = next(t for t in (8, 4, 2) if k % (16 * t) == 0)
    packed = (qw.q[:, 0::2] << 4 | qw.q[:, 1::2]).contiguous()
    weight = torch.ops.aten._convert_weight_to_int4pack(packed, inner_k_tiles)
    zero = 8 * qw.scale + (qw.offset if qw.offset is not None else 0)
    scales_and_zeros = torch.stack([qw.scale, zero], dim=2).transpose(0, 1).contiguous().to(torch.bfloat16)
    return weight, scales_and_zeros, qw.group_size


def tinygemm_matmul(
    x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor, int], bias: torch.Tensor | None
) -> torch.Tensor:
    out = torch.ops.aten._weight_int4pack_mm(x, packed[0], packed[2], packed[1])
    return out + bias if bias is not None else out


@dataclass
class QuantChoice:
    tiles: dict[int, Tile]  # row bucket -> the fastest correct tile
    tinygemm: bool  # tinygemm was faster at one row: the layer should hold tinygemm's packing instead


# (N, K, bits, group_size, offset?, dtype, bias?) -> the choice: one measurement per shape per process
_CHOICES: dict[tuple, QuantChoice] = {}
# the same keys and a bucket -> (tinygemm ms or None, the best tile's ms), for benchmarks to report
TIMINGS: dict[tuple, tuple[float | None, float]] = {}


def choose_quant_tiles(
    qw: QuantizedWeight,
    w: TritonQuantWeight,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    timer: Callable[[Callable[[], object]], float] | None = None,
    buckets: tuple[int, ...] = ROW_BUCKETS,
) -> QuantChoice:
    """The fastest tile that agrees with the float32 reference, for each of `buckets` (row counts),
    timed on `w` (qw packed by pack_for_triton for `dtype`); and whether tinygemm beats the best
    one-row tile (by less than MIN_SPEEDUP the Triton kernel does not displace it), where it applies."""
    key = (*qw.shape, qw.bits, qw.group_size, qw.offset is not None, dtype, bias is not None)
    if key not in _CHOICES:
        _CHOICES[key] = _measure(qw, w, bias, dtype, timer or cuda_timer, buckets, key)
    return _CHOICES[key]


def _cold_copies(w: TritonQuantWeight) -> list[TritonQuantWeight]:
    """`w` and enough copies to fill twice the L2 cache, as gemv.cold_copies does for a tensor."""
    if not w.q.is_cuda:
        return [w]
    l2 = getattr(torch.cuda.get_device_properties(w.q.device), "L2_cache_size", 64 << 20)
    return [w] + [w.clone() for _ in range(max(0, -(-2 * l2 // w.nbytes) - 1))]


def _agrees(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return bool((got.float() - expected).norm() <= 1e-2 * expected.norm() + 1e-6)


def _measure(qw, w, bias, dtype, timer, buckets, key) -> QuantChoice:
    device = w.q.device
    gen = torch.Generator(device).manual_seed(0)
    copies = _cold_copies(w)
    turns = itertools.cycle(copies)
    enough = min_programs(device)
    tiles, one_row_ms = {}, None
    for bucket in buckets:
        x = torch.randn(bucket, w.k, generator=gen, device=device).to(dtype)
        expected = reference(x, qw, bias)
        best, best_ms = None, None
        for tile in tile_candidates(bucket, w):
            # A GEMV tile that leaves SMs idle cannot stream at full bandwidth: skip all but the narrowest.
            if tile.kernel == "gemv" and tile.block_n > 2 and triton.cdiv(w.n, tile.block_n) < enough:
                continue
            got = try_tile(lambda: run_tile(x, w, bias, tile), "quant " + tile.kernel, tile[2:], w.q)
            if got is None:
                continue
            if not _agrees(got, expected):
                log.warning(
                    "quant %s tile %s disagrees with the reference on %s; not used", tile.kernel, tile, qw.shape
                )
                continue
            ms = timer(lambda: run_tile(x, next(turns), bias, tile))
            if best_ms is None or ms < best_ms:
                best, best_ms = tile, ms
        if best is None:
            raise RuntimeError(
                f"no quantized kernel tile works for a {qw.shape} {qw.bits}-bit weight in groups of {qw.group_size}"
            )
        tiles[bucket] = best
        TIMINGS[(*key, bucket)] = (None, best_ms)
        if bucket == 1:
            one_row_ms = best_ms
    use_tinygemm = False
    if one_row_ms is not None and tinygemm_applies(qw, dtype):
        packed = tinygemm_pack(qw)
        x = torch.randn(1, w.k, generator=gen, device=device).to(dtype)
        if _agrees(tinygemm_matmul(x, packed, bias), reference(x, qw, bias)):
            # As cold as the Triton tiles' timings: a copy per Triton copy, read in turn.
            packs = itertools.cycle([packed] + [(packed[0].clone(), packed[1].clone(), packed[2]) for _ in copies[1:]])
            tiny_ms = timer(lambda: tinygemm_matmul(x, next(packs), bias))
            TIMINGS[(*key, 1)] = (tiny_ms, one_row_ms)
            use_tinygemm = one_row_ms * MIN_SPEEDUP >= tiny_ms
        else:
            log.warning("tinygemm disagrees with the reference on %s; not used", qw.shape)
    return QuantChoice(tiles, use_tinygemm)


class TritonQuantMatmul(QuantizedMatmul):
    """NVIDIA GPUs: Pagoda's Triton dequant-GEMV (decode) and dequant-GEMM (prefill) over the packed
    codes (this file's kernels), with a tile per row count measured at load; or PyTorch's
    tinygemm int4 kernel for every row count where that measured faster at one row."""

    @staticmethod
    def applies(qw: QuantizedWeight, device: torch.device) -> bool:
        return device.type == "cuda"

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype):
        super().__init__(qw)
        self.dtype = dtype
        # The kernels multiply fp16/bf16 activations; a float32 model's are rounded to bf16 for them.
        self.kernel_dtype = dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        packed = pack_for_triton(qw, self.kernel_dtype)
        choice = choose_quant_tiles(qw, packed, None, self.kernel_dtype)
        self.tiles = choice.tiles
        self.tinygemm = tinygemm_pack(qw) if choice.tinygemm else None
        self.weight = None if self.tinygemm is not None else packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.kernel_dtype)
        if self.tinygemm is not None:
            y = tinygemm_matmul(x, self.tinygemm, None)
        else:
            y = run_tile(x, self.weight, None, tile_for(self.tiles, x.shape[0]))
        return y.to(self.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", tinygemm" if self.tinygemm is not None else ", triton")
