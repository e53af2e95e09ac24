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

Which kernel and tile serve each row count is measured when a layer loads (`choose_quant_tiles`,
triton_tiles.py), against tinygemm (`torch.ops.aten._weight_int4pack_mm`, tinygemm.py) where that
applies (4 bits, bf16, groups of 32 to 256); elsewhere there is nothing else that multiplies by the
codes in place, so a Triton kernel is used and only its tile is chosen.
"""

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.quantization.layout import QuantizedWeight

ROW_ALIGN_BYTES = 16  # packed rows padded to this: aligned rows let every load be 16 bytes wide
GEMV_ROW_BUCKETS = (1, 2, 4, 8)  # rows the GEMV takes, padded up to the next bucket


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
