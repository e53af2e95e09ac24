"""A decoder layer's RMSNorm (with its residual add) run inside the next projection's GEMV, at one row.

At batch-1 decode each small kernel between the matmuls costs a few microseconds of a ~1 ms step,
mostly launch gaps, so kernels themselves are the cost. Two of them fold into the matmul that follows:

- `add + RMSNorm` before q/k/v and before gate/up. The norm's scale is one number per row,
  rsqrt(mean(h^2) + eps), so it can be applied after the dot products: every program streams the
  whole row h = x + residual through its K loop anyway, and sums h^2 on the way.
- `SiLU(gate) * up` after gate/up: a program takes matching rows of the gate and up halves of the
  weight and writes the activation, never the gate/up vector.

One row only: batch-1 decode is where the launch gaps dominate. Whether the fused kernel is used is
measured when a model loads (`choose_normed`), against the unfused ops as the decode graphs run them.
"""

import itertools
import logging

import torch
import triton
import triton.language as tl
from torch import nn

from engine.layers.gemv import MIN_SPEEDUP, cold_copies, cuda_timer, try_tile

log = logging.getLogger("engine")


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _normed_gemv_kernel(
    x_ptr,
    res_ptr,
    norm_w_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    res_out_ptr,
    N_OUT,
    K,
    stride_wn,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out = rms_norm(x + residual) @ w.T (+ b) for one row, or with SILU_MUL (w = [gate; up], 2 *
    N_OUT rows) out = silu(gate) * up. Program 0 also stores h = x + residual to res_out.

    As in _gemv_kernel, the row's values are loaded broadcast into the weight tile's
    [BLOCK_N, BLOCK_K] layout, so products need no layout change. Unlike it, each chunk is summed
    along K at once (a model's K spans a few chunks): full-tile accumulators for the dot
    products and the squares took more registers in the sm_90 code Triton generates. Every tile
    row sees the whole of h, so each has the norm's total and the scale needs no reduction across
    programs."""
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.zeros((BLOCK_N, 1), dtype=tl.int32) + tl.arange(0, BLOCK_K)[None, :]
    rows = tl.minimum(n, N_OUT - 1).to(tl.int64)  # past the end: re-read the last row, store nothing
    w_ptrs = w_ptr + rows[:, None] * stride_wn + k
    up_ptrs = w_ptrs + N_OUT.to(tl.int64) * stride_wn
    # h is kept as the next residual once: by the tile row of output column 0.
    store_h = n[:, None] == 0
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    squares = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        in_k = k0 + k < K
        h = _load(x_ptr + k0 + k, in_k, not EVEN_K)
        if HAS_RESIDUAL:  # added in the activations' precision, as the unfused add rounds it
            h = (h.to(tl.float32) + _load(res_ptr + k0 + k, in_k, not EVEN_K).to(tl.float32)).to(h.dtype)
            tl.store(res_out_ptr + k0 + k, h, mask=in_k & store_h)
        h = h.to(tl.float32)
        squares += tl.sum(h * h, axis=1)  # a reduction per chunk: K spans a few chunks
        h *= _load(norm_w_ptr + k0 + k, in_k, not EVEN_K).to(tl.float32)
        acc += tl.sum(_load(w_ptrs + k0, in_k, not EVEN_K).to(tl.float32) * h, axis=1)
        if SILU_MUL:
            acc_up += tl.sum(_load(up_ptrs + k0, in_k, not EVEN_K).to(tl.float32) * h, axis=1)
    scale = tl.rsqrt(squares / K + eps)
    out_ty = out_ptr.dtype.element_ty
    y = acc * scale
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n < N_OUT, other=0.0).to(tl.float32)
    if SILU_MUL:
        up = acc_up * scale
        if HAS_BIAS:
            up += tl.load(b_ptr + N_OUT + n, mask=n < N_OUT, other=0.0).to(tl.float32)
        # gate and up rounded as the unfused gate_up output is, before the activation
        gate, up = y.to(out_ty).to(tl.float32), up.to(out_ty).to(tl.float32)
        y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + n, y.to(out_ty), mask=n < N_OUT)


def normed_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
    silu_mul: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ weight.T + bias, x + residual) for one row; without `residual`,
    the norm of x and x itself. With `silu_mul`, weight is [gate; up] and the first result is
    silu(gate) * up."""
    k = x.shape[-1]
    if x.shape[0] != 1 or weight.shape[1] != k or x.dtype != weight.dtype or weight.stride(1) != 1:
        raise ValueError(
            f"normed_gemv takes one row and a [N, {k}] weight of its dtype with unit-stride rows; "
            f"got x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype}"
        )
    if silu_mul and weight.shape[0] % 2:
        raise ValueError(f"silu_mul needs a [gate; up] weight of an even row count, got {weight.shape[0]} rows")
    n_out = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    x = x.contiguous()
    out = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(x) if residual is not None else x
    _normed_gemv_kernel[(triton.cdiv(n_out, block_n),)](
        x,
        residual.contiguous() if residual is not None else x,
        norm_weight,
        weight,
        bias if bias is not None else weight,
        out,
        new_residual,
        n_out,
        k,
        weight.stride(0),
        eps,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul,
        EVEN_K=k % block_k == 0,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out, new_residual


class NormedGemv(nn.Module):
    """A decoder layer's residual add and RMSNorm, the projection after it, and SiluAndMul (for
    gate/up) in one kernel at one row, with one tile: ColumnParallelLinear.normed runs it."""

    def __init__(self, tile: tuple[int, int]):
        super().__init__()
        self.tile = tile  # (BLOCK_N, BLOCK_K)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm: nn.Module,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        act: nn.Module | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return normed_gemv(x, residual, norm.weight, norm.eps, weight, bias, *self.tile, silu_mul=act is not None)

    def extra_repr(self) -> str:
        return f"tile={self.tile[0]}x{self.tile[1]}"


def normed_tile_candidates(silu_mul: bool) -> list[tuple[int, int]]:
    """(BLOCK_N, BLOCK_K) pairs that load 4 or 8 KiB of bf16 weights a chunk (with `silu_mul`, the
    gate and the up tile together), from 2 rows by 1,024 columns to 16 by 256. Every program
    reads the whole activation row as well (from L2), so taller tiles read it fewer times. In the
    sm_90 code these take 40-80 registers a thread (tests/test_kernels_compile_for_gpu.py)."""
    tiles = 2 if silu_mul else 1
    return [(bn, bk) for bn in (2, 4, 8, 16) for bk in (256, 512, 1024) if tiles * bn * bk in (2048, 4096)]


# (N, K, dtype, has_bias, silu_mul) -> (BLOCK_N, BLOCK_K), or None to keep the unfused ops
_CHOICES: dict[tuple, tuple[int, int] | None] = {}
TIMINGS: dict[tuple, tuple[float, float | None]] = {}  # the same keys -> (unfused ms, best fused ms or None)


def choose_normed(pairs: list, timer=None) -> int:
    """For each (linear, norm, act) that a decoder layer runs in a row (`act` a SiluAndMul or None),
    swap a `NormedGemv` into the linear's `normed_kernel` where the fused kernel, checked against the
    unfused ops, measured faster than them at one row. The norms' and the activation's functions are
    timed as they are set when this runs (ModelRunner calls it with the compiled ones in place). Returns how many
    linears took the fused kernel."""
    timer = timer or cuda_timer
    used = 0
    for linear, norm, act in pairs:
        weight, bias = linear.weight, getattr(linear, "bias", None)
        if weight is None or weight.dtype not in (torch.float16, torch.bfloat16):
            continue
        key = (*weight.shape, weight.dtype, bias is not None, act is not None)
        if key not in _CHOICES:
            _CHOICES[key] = _measure(linear, norm, act, timer)
        tile = _CHOICES[key]
        linear.normed_kernel = NormedGemv(tile) if tile is not None else None
        used += tile is not None
    return used


def _agrees(got: tuple[torch.Tensor, torch.Tensor], expected: torch.Tensor, expected_residual: torch.Tensor) -> bool:
    """The output within 1% of the unfused ops' (rounding differs), the residual exactly equal."""
    out, new_residual = got
    close = bool((out.float() - expected).norm() <= 1e-2 * expected.norm() + 1e-6)
    return close and torch.equal(new_residual, expected_residual)


def _measure(linear, norm, act, timer) -> tuple[int, int] | None:
    weight, bias = linear.weight, getattr(linear, "bias", None)
    gen = torch.Generator(weight.device).manual_seed(0)
    x, residual = (
        torch.randn(1, weight.shape[1], generator=gen, device=weight.device).to(weight.dtype) for _ in range(2)
    )
    checks = []  # (residual or None for a first layer, expected output, expected new residual)
    for given in (residual, None):
        out, new_residual = linear.normed_unfused(x, given, norm, act)
        checks.append((given, out.float(), new_residual))
    turns = itertools.cycle(cold_copies(weight))  # each timed call reads the next copy: the L2 cache serves none

    def unfused():
        h, _ = norm(x, residual)
        out = linear.matmul_with(h, next(turns), bias)
        return act(out) if act is not None else out

    unfused_ms = timer(unfused)
    best, best_ms = None, None
    for block_n, block_k in normed_tile_candidates(act is not None):
        agrees = try_tile(
            lambda: all(
                _agrees(
                    normed_gemv(
                        x, given, norm.weight, norm.eps, weight, bias, block_n, block_k, silu_mul=act is not None
                    ),
                    out,
                    new_residual,
                )
                for given, out, new_residual in checks
            ),
            "fused norm+GEMV",
            (block_n, block_k),
            weight,
        )
        if agrees is None:
            continue
        if not agrees:
            log.warning(
                "fused norm+GEMV tile %dx%d disagrees with the unfused ops on %s; not used",
                block_n,
                block_k,
                tuple(weight.shape),
            )
            continue
        ms = timer(
            lambda: normed_gemv(
                x, residual, norm.weight, norm.eps, next(turns), bias, block_n, block_k, silu_mul=act is not None
            )
        )
        if best_ms is None or ms < best_ms:
            best, best_ms = (block_n, block_k), ms
    TIMINGS[(*weight.shape, weight.dtype, bias is not None, act is not None)] = (unfused_ms, best_ms)
    return best if best_ms is not None and best_ms * MIN_SPEEDUP < unfused_ms else None
