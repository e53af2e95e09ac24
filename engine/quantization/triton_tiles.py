"""Which Triton kernel and tile serve each row count of a quantized weight, measured when a layer loads, against
tinygemm where that applies; and TritonQuantMatmul, the module that runs the choice (what a quantized layer holds
on an NVIDIA GPU). The kernels themselves are in triton_matmul.py, tinygemm's path in tinygemm.py.

Each row bucket gets the fastest tile that agrees with the float32 reference, timed on cold copies of the weight;
the GEMV's tiles up to 8 rows, the GEMM's from 4. One measurement per shape and layout per process."""

import itertools
import logging
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import triton

from engine.layers.gemv import MIN_SPEEDUP, cuda_timer, min_programs, try_tile
from engine.quantization.kernels import QuantizedMatmul
from engine.quantization.layout import QuantizedWeight
from engine.quantization.tinygemm import tinygemm_applies, tinygemm_matmul, tinygemm_pack
from engine.quantization.triton_matmul import (
    GEMV_ROW_BUCKETS,
    TritonQuantWeight,
    chunk_groups,
    pack_for_triton,
    quant_gemv,
    quant_matmul,
)

log = logging.getLogger("engine")

# A call with r rows uses the choice of the smallest bucket >= r, and the last one beyond it.
ROW_BUCKETS = (*GEMV_ROW_BUCKETS, 16, 64, 256)
MAX_GEMV_TILE = 8192  # rows x BLOCK_N x BLOCK_K fp32 products live at once: 64 registers a thread at 4 warps


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
        # 128 x 128 x 128 tile reached the 255-register limit in the sm_86 and sm_90 code. Beside it
        # the accumulator: with a 128 x 64 one, a 64 x 128 tile spilled to a stack frame on sm_86/89.
        tiles += [
            Tile("matmul", bm, bn, bk)
            for bm in (16, 32, 64, 128)
            if bm <= max(16, bucket)
            for bn in (64, 128)
            for bk in (64, 128)
            if bn * bk <= 8192 and bm * bn + bn * bk < 16384
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
    codes (triton_matmul.py's kernels), with a tile per row count measured at load; or PyTorch's
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
