"""Skinny matmuls (a few rows times a whole weight) as a Triton kernel, used where it beats cuBLAS.

At decode batch sizes a linear layer reads every weight once and does two flops per weight: it
is bound by memory bandwidth. On an H200, cuBLAS ran the 0.6B model's bf16 projections at one
row at about 1 TB/s, a quarter of what a plain copy reaches there (bench/RESULTS.md). This kernel
gives each program a few weight rows (few enough that even a 1024-row output spreads over a few
hundred programs), streams them in wide loads along K, and reduces in fp32 once, at the end.

Whether it is faster depends on the GPU, the weight's shape and the row count, so nothing is
assumed: when a model loads on CUDA, `choose_gemv` times cuBLAS and a few tile shapes of the
kernel on each distinct weight shape (inside a CUDA graph, with the L2 cache cold), for 1, 2
and 4 rows, checks the kernel's result, and keeps the kernel only where it is clearly faster.
Half precision only: float32 keeps cuBLAS, whose sums the exact-match tests against transformers
rely on.
"""

import itertools
import logging
from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

log = logging.getLogger("engine")

ROW_BUCKETS = (1, 2, 4)  # a call with r rows runs the kernel tuned for the smallest bucket >= r
MAX_TILE_ELEMENTS = 8192  # rows x BLOCK_N x BLOCK_K fp32 accumulators: 64 registers a thread at 4 warps
MIN_SPEEDUP = 1.1  # the kernel must beat cuBLAS by this much: timing noise, and eager launches cost more


@triton.jit
def _load_f32(ptrs, k, k_left, MASKED: tl.constexpr):
    if MASKED:
        values = tl.load(ptrs, mask=k < k_left, other=0.0)
    else:
        values = tl.load(ptrs)
    return values.to(tl.float32)


@triton.jit
def _accumulate(
    acc0,
    acc1,
    acc2,
    acc3,
    w_ptrs,
    x_ptrs,
    x_row1,
    x_row2,
    x_row3,
    k,
    k_left,
    MASKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Add one [BLOCK_N, BLOCK_K] chunk's products to the accumulator of each row of x; a MASKED
    chunk reads only its first `k_left` columns."""
    w = _load_f32(w_ptrs, k, k_left, MASKED)
    acc0 += w * _load_f32(x_ptrs, k, k_left, MASKED)
    if BLOCK_M > 1:  # a constexpr: the accumulators of rows past BLOCK_M compile away
        acc1 += w * _load_f32(x_ptrs + x_row1, k, k_left, MASKED)
    if BLOCK_M > 2:
        acc2 += w * _load_f32(x_ptrs + x_row2, k, k_left, MASKED)
    if BLOCK_M > 3:
        acc3 += w * _load_f32(x_ptrs + x_row3, k, k_left, MASKED)
    return acc0, acc1, acc2, acc3


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K is a multiple of BLOCK_K: there is no partial last chunk
    BLOCK_M: tl.constexpr,  # 1 to 4 rows, each with its own accumulator
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]) for BLOCK_N weight rows and the M <= BLOCK_M rows of x.

    Everything in the K loop lives in the weight tile's [BLOCK_N, BLOCK_K] layout: x is loaded
    broadcast into it (each thread reads the x values its weights meet; the repeats hit the
    cache), and products accumulate elementwise, one accumulator per row of x, summed across K
    once after the loop. So the loop body is unmasked loads and multiply-adds, with no layout
    change and no barrier; only a partial last chunk is masked, apart from the loop (both
    checked in the sm_90 code Triton generates)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.zeros((BLOCK_N, 1), dtype=tl.int32) + tl.arange(0, BLOCK_K)[None, :]
    # Weight rows past N and x rows past M re-read the last real row (always in bounds), so loads
    # need no mask; the stores drop them (rows past M store to an N of 0). int64: an LM head can
    # exceed 2**31 elements.
    w_ptrs = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * stride_wn + k
    x_ptrs = x_ptr + k
    x_row1 = tl.minimum(1, M - 1) * stride_xm
    x_row2 = tl.minimum(2, M - 1) * stride_xm
    x_row3 = tl.minimum(3, M - 1) * stride_xm
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    whole = K if EVEN_K else K - K % BLOCK_K
    for k0 in range(0, whole, BLOCK_K):
        acc0, acc1, acc2, acc3 = _accumulate(
            acc0, acc1, acc2, acc3, w_ptrs + k0, x_ptrs + k0, x_row1, x_row2, x_row3, k, BLOCK_K, False, BLOCK_M
        )
    if not EVEN_K:
        acc0, acc1, acc2, acc3 = _accumulate(
            acc0, acc1, acc2, acc3, w_ptrs + whole, x_ptrs + whole, x_row1, x_row2, x_row3, k, K - whole, True, BLOCK_M
        )
    n_end1, n_end2, n_end3 = tl.where(M > 1, N, 0), tl.where(M > 2, N, 0), tl.where(M > 3, N, 0)
    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + n, (tl.sum(acc0, axis=1) + bias).to(out_ty), mask=n < N)
    if BLOCK_M > 1:
        tl.store(out_ptr + stride_om + n, (tl.sum(acc1, axis=1) + bias).to(out_ty), mask=n < n_end1)
    if BLOCK_M > 2:
        tl.store(out_ptr + 2 * stride_om + n, (tl.sum(acc2, axis=1) + bias).to(out_ty), mask=n < n_end2)
    if BLOCK_M > 3:
        tl.store(out_ptr + 3 * stride_om + n, (tl.sum(acc3, axis=1) + bias).to(out_ty), mask=n < n_end3)


def row_bucket(rows: int) -> int | None:
    """The smallest bucket that holds `rows`, or None when the kernel is not for this many rows."""
    return next((b for b in ROW_BUCKETS if rows <= b), None)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block_n: int, block_k: int) -> torch.Tensor:
    """x @ weight.T (+ bias) for x of at most max(ROW_BUCKETS) rows; weight is [N, K], contiguous rows."""
    rows, k = x.shape
    n = weight.shape[0]
    block_m = row_bucket(rows) if rows >= 1 else None
    if block_m is None or weight.shape[1] != k or weight.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError(
            f"gemv takes 1 to {ROW_BUCKETS[-1]} rows and a [N, {k}] weight of the same dtype with "
            f"unit-stride rows; got x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} "
            f"{weight.dtype}"
        )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"gemv's bias must have shape ({n},), got {tuple(bias.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=k % block_k == 0,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out


def tile_candidates(bucket: int) -> list[tuple[int, int]]:
    """(BLOCK_N, BLOCK_K) pairs to try for `bucket` rows, narrowest first: every tile whose
    accumulators fit the register budget and that loads at least 4 KiB of bf16 weights per step."""
    return [
        (bn, bk)
        for bn in (2, 4, 8)
        for bk in (512, 1024, 2048)
        if bucket * bn * bk <= MAX_TILE_ELEMENTS and bn * bk >= 2048
    ]


def min_programs(device: torch.device) -> int:
    """Programs a tile must give to keep every SM busy: two per SM on a GPU (none to keep elsewhere)."""
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def cuda_timer(fn: Callable[[], object]) -> float:
    """Milliseconds per call of `fn` as a decode graph runs it: 32 calls captured back to back in a
    CUDA graph, replayed. Timed one launch at a time (triton's do_bench), a launch's gap of a few
    microseconds weighs as much as the small kernels measured, and misled the choice on an H200
    (bench/RESULTS.md, 2026-11-30). `fn` should read a different weight copy on each call
    (`cold_copies`), so that the L2 cache serves none of them, as in a real step."""
    calls, replays = 32, 5
    for _ in range(2):  # compile and initialise outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (replays * calls)


def cold_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """`weight` and enough copies of it to fill twice the GPU's L2 cache (just `weight` off a GPU)."""
    if not weight.is_cuda:
        return [weight]
    l2 = getattr(torch.cuda.get_device_properties(weight.device), "L2_cache_size", 64 << 20)
    extra = -(-2 * l2 // (weight.numel() * weight.element_size())) - 1
    return [weight] + [weight.clone() for _ in range(max(0, extra))]


# (N, K, dtype, has_bias, bucket) -> (BLOCK_N, BLOCK_K), or None for cuBLAS: one choice per shape per process
_CHOICES: dict[tuple, tuple[int, int] | None] = {}
# the same keys -> (cuBLAS ms, the fastest correct tile's ms or None), for benchmarks to report
TIMINGS: dict[tuple, tuple[float, float | None]] = {}


def choose_gemv(modules: list, timer: Callable[[Callable[[], object]], float] | None = None) -> dict[int, int]:
    """Swap a `TritonGemv` into each linear module's `kernel` with its tiles (rows -> (BLOCK_N, BLOCK_K))
    for every row count whose bucket measured faster with the kernel than with cuBLAS, and agreed with
    it; a module with no such row count keeps cuBLAS. Modules are PackableLinear layers (`weight`,
    `bias`). Returns how many modules took the kernel per bucket."""
    timer = timer or cuda_timer
    used = {b: 0 for b in ROW_BUCKETS}
    for module in modules:
        weight, bias = module.weight, getattr(module, "bias", None)
        if weight is None or weight.dtype not in (torch.float16, torch.bfloat16):
            continue
        tiles = {}
        for low, bucket in zip((0, *ROW_BUCKETS), ROW_BUCKETS):
            key = (*weight.shape, weight.dtype, bias is not None, bucket)
            if key not in _CHOICES:
                _CHOICES[key] = _measure(weight, bias, bucket, timer)
            if _CHOICES[key] is not None:
                tiles.update(dict.fromkeys(range(low + 1, bucket + 1), _CHOICES[key]))
                used[bucket] += 1
        module.kernel = TritonGemv(tiles) if tiles else None
    return used


class TritonGemv(nn.Module):
    """x W^T (+ b) with the Triton kernel at the row counts it holds a tile for (where it measured
    faster than cuBLAS), and cuBLAS at the others."""

    def __init__(self, tiles: dict[int, tuple[int, int]]):
        super().__init__()
        self.tiles = tiles  # rows -> (BLOCK_N, BLOCK_K)

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        tile = self.tiles.get(x.shape[0])
        if tile is None:
            return F.linear(x, weight, bias)
        return gemv(x, weight, bias, *tile)

    def extra_repr(self) -> str:
        return ", ".join(f"{rows} row{'s' * (rows > 1)}: {n}x{k}" for rows, (n, k) in sorted(self.tiles.items()))


def try_tile(run: Callable[[], object], kernel: str, tile: tuple[int, int], weight: torch.Tensor) -> object | None:
    """run() of one candidate tile, or None (logged) where this GPU cannot compile or run it: out
    of registers or shared memory. A broken CUDA context still raises, at the synchronise."""
    try:
        return run()
    except Exception as e:
        if weight.is_cuda:
            torch.cuda.synchronize(weight.device)
        log.warning(
            "%s tile %dx%d failed on %s and is not used: %s",
            kernel,
            *tile,
            tuple(weight.shape),
            str(e).splitlines()[0] if str(e) else type(e).__name__,
        )
        return None


def _measure(weight: torch.Tensor, bias: torch.Tensor | None, bucket: int, timer) -> tuple[int, int] | None:
    """The fastest correct tile for `bucket` rows, if it beats cuBLAS by MIN_SPEEDUP; else None."""
    gen = torch.Generator(weight.device).manual_seed(0)
    x = torch.randn(bucket, weight.shape[1], generator=gen, device=weight.device).to(weight.dtype)
    expected = F.linear(x, weight, bias).float()
    copies = cold_copies(weight)
    turns = itertools.cycle(copies)  # each timed call reads the next copy
    cublas_ms = timer(lambda: F.linear(x, next(turns), bias))
    best, best_ms = None, None
    # A tile that leaves SMs idle cannot stream at full bandwidth: skip it, but keep the narrowest.
    enough = min_programs(weight.device)
    for block_n, block_k in tile_candidates(bucket):
        if triton.cdiv(weight.shape[0], block_n) < enough and block_n > 2:
            continue
        got = try_tile(lambda: gemv(x, weight, bias, block_n, block_k).float(), "gemv", (block_n, block_k), weight)
        if got is None:
            continue
        if not ((got - expected).norm() <= 1e-2 * expected.norm() + 1e-6):
            log.warning("gemv tile %dx%d disagrees with cuBLAS on %s; not used", block_n, block_k, tuple(weight.shape))
            continue
        ms = timer(lambda: gemv(x, next(turns), bias, block_n, block_k))
        if best_ms is None or ms < best_ms:
            best, best_ms = (block_n, block_k), ms
    TIMINGS[(*weight.shape, weight.dtype, bias is not None, bucket)] = (cublas_ms, best_ms)
    return best if best_ms is not None and best_ms * MIN_SPEEDUP < cublas_ms else None
