"""Choosing each weight's kernel at load by measurement, without ever holding whole alternatives.

Once per shape and layout (the first layer of its kind; the others reuse the choice), every candidate kernel
(kernels.py) is built in turn over a proxy of the weight: up to PROXY_VALUES of its own rows, spread over it,
first and last included. Each proxy kernel is checked against the exact float32 product of those rows, timed
at decode's one row, and freed before the next is built. Then the fastest that agreed is built once over the
whole weight and checked against the exact product: of its first WIDE_CHECK_ROWS rows and CHECK_ROWS spread to
the last (`checked_rows`) for the first weight of each shape and layout to take that kernel, of the CHECK_ROWS
for the others; should it disagree, the next fastest is tried. Checking every row of every weight decoded the whole
model to float32 in PyTorch at each load: 30-65 s of a Qwen3-4B file's load, most of its time to first token
(issue 38); checking every row of the first weight of each shape still took 2.6 s of a Llama-8B file's load, most of
it in the 128k-row output head, whose rows past the first thousands exercise no code the spread rows do not.

Building every candidate over the whole weight, beside the weight dequantized to float32, took several times
the weight's size for each of the largest weights: a 2.5 GB Q4_K_M file passed 10.5 GB while loading (issue 38).
Now what loading holds beyond the finished kernels is the weight in the loader's loose layout and a few MB.
"""

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.quantization import kernels, kquant, native
from engine.quantization.blocks import BlockWeight
from engine.quantization.kernels import QuantizedMatmul
from engine.quantization.kquant import KQuantMatmul, isa_setting
from engine.quantization.layout import QuantizedWeight

log = logging.getLogger("engine")

# Rows enough for about this many weights make a proxy (64 rows at least, for the kernels' threads to share):
# the candidates differ by 5x and more at one row (bench/RESULTS.md), which a MB of weight shows as well as the
# whole weight does.
PROXY_VALUES = 1 << 20
TIMING_BUDGET_S = 0.05  # a kernel is timed for up to this long
REFERENCE_SLAB_BYTES = 8 << 20  # float32 rows dequantized at a time for the exact product
CHECK_ROWS = 64  # rows of a weight checked, spread from first to last
WIDE_CHECK_ROWS = 4096  # and before them, for the first weight of a shape and layout to take a kernel

_CHOICES: dict[tuple, list[str]] = {}  # per shape and layout: the kernels that agreed on a proxy, fastest first
PREFILL_ROWS = (128, 512)  # where prefill's dequantized path is tried, fewest first
_PREFILL_CHOICES: dict[tuple, int | None] = {}
_CHECKED_WIDE: set[tuple] = set()  # (shape and layout, kernel name): a weight of it agreed over its wide check


def _seconds_per_call(kernel: nn.Module, x: torch.Tensor, calls: int = 20) -> float:
    """The fastest of up to `calls` calls, or of those that fit in TIMING_BUDGET_S: the least disturbed by
    whatever else the machine runs."""
    kernel(x)  # first-call costs (allocator, one-time dispatch) are not the kernel's speed
    fastest, spent = float("inf"), 0.0
    for _ in range(calls):
        start = time.perf_counter()
        kernel(x)
        seconds = time.perf_counter() - start
        fastest, spent = min(fastest, seconds), spent + seconds
        if spent > TIMING_BUDGET_S:
            break
    return fastest


def sampled_rows(n: int, k: int) -> torch.Tensor | None:
    """Indices of the proxy's rows, evenly spread from the first to the last; None: the whole weight is small
    enough to be its own proxy."""
    count = max(64, PROXY_VALUES // k)
    if count >= n:
        return None
    return torch.linspace(0, n - 1, count).round().long().unique()


def take_rows(qw: QuantizedWeight, index: torch.Tensor) -> QuantizedWeight:
    if isinstance(qw, BlockWeight):  # decoded as a slab, not whole
        return qw.take(index)
    return QuantizedWeight(
        qw.bits,
        qw.q[index],
        qw.scale[index],
        None if qw.offset is None else qw.offset[index],
        qw.group_size,
        qw.source,
        None if qw.blocks is None else qw.blocks[index],
    )


def checked_rows(n: int, wide: bool) -> torch.Tensor:
    """The rows of an [n, K] weight that its kernel's check compares: CHECK_ROWS spread from the first to the
    last, after the first WIDE_CHECK_ROWS where `wide`."""
    spread = torch.linspace(0, n - 1, CHECK_ROWS).round().long()
    return torch.cat((torch.arange(min(n, WIDE_CHECK_ROWS)), spread) if wide else (spread,)).unique()


def exact_product(qw: QuantizedWeight, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T in float32 from the exact dequantized weight, a slab of rows at a time; only `rows` of it if given."""
    if rows is not None:
        qw = take_rows(qw, rows)
    n, k = qw.shape
    slab = max(1, REFERENCE_SLAB_BYTES // (4 * k))
    return torch.cat(
        [F.linear(x.float(), _dequantized(qw.rows(start, min(slab, n - start)))) for start in range(0, n, slab)], dim=-1
    )


def _dequantized(qw: QuantizedWeight) -> torch.Tensor:
    """`qw` in float32: GGUF blocks by the K-quant kernel's dequantizer where it reads them (equal to gguf-py's bit
    for bit, tests/test_kquant.py, and 10x faster than decoding them in PyTorch: a 4B file's tied Q6_K table took
    seconds), anything else by its own `dequantize()`."""
    blocks = getattr(qw, "blocks", None)
    if blocks is not None and blocks.device.type == "cpu" and qw.source in kquant.KINDS and kquant.ops() is not None:
        return kquant.dequantize_blocks(blocks, qw.source)
    return qw.dequantize()


def _disagreement(
    kernel: nn.Module, reference: torch.Tensor, x: torch.Tensor, rows: torch.Tensor | None = None
) -> float:
    """How far `kernel` is from `reference` (over the weight's `rows` only, if given), in multiples of what bf16
    activations may cost (1 or less: agrees)."""
    tolerance = 0.02 * reference.abs().max().item() + 1e-3  # bf16 activations round each product at 2^-8
    got = kernel(x).float()
    if rows is not None:
        got = got[:, rows]
    return (got - reference).abs().max().item() / tolerance


def candidates(
    qw: QuantizedWeight, device: torch.device, dtype: torch.dtype
) -> dict[str, Callable[[QuantizedWeight], nn.Module]]:
    """The kernels that can multiply by `qw` here, by name, each a builder over a weight of `qw`'s layout
    (the chooser builds them over a few of its rows first); the fallback last."""
    kinds = [
        kernels.Int4PackMatmul,
        kernels.Int8PackMatmul,
        kernels.SplitInt4Matmul,
        kernels.HalvesSplitInt4Matmul,
        native.GroupedInt8Matmul,
        KQuantMatmul,
    ]
    if device.type == "cuda":
        from engine.quantization.triton_tiles import TritonQuantMatmul  # Triton is imported only where a GPU runs

        kinds.insert(0, TritonQuantMatmul)  # choose_matmul tries it first there
    if qw.source == "MXFP4" and device.type == "cpu" and KQuantMatmul.applies(qw, device):
        # The others hold a byte a code, twice the 4.25 bits the blocks take: gpt-oss's experts are most of the model
        kinds = [KQuantMatmul]
    made = {cls.__name__: lambda w, cls=cls: cls(w, dtype) for cls in kinds if cls.applies(qw, device)}
    return {**made, kernels.DequantMatmul.__name__: lambda w: kernels.DequantMatmul(w, dtype)}


@torch.inference_mode()
def choose_matmul(qw: QuantizedWeight, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The fastest kernel for `qw` at one row that agrees with the dequantized reference."""
    builders = candidates(qw, device, dtype)
    if len(builders) == 1:
        return next(iter(builders.values()))(qw)
    if device.type == "cuda":
        # The Triton kernel measures its own tiles with CUDA events; the slab fallback is far slower on a
        # GPU (it would need a timing that waits for the device to compare at all).
        first, fallback = list(builders.values())[0], list(builders.values())[-1]
        try:
            return first(qw)
        except RuntimeError as e:
            log.warning(
                "the Triton quantized kernel cannot run a %s weight %s here (%s); using the slow dequantizing fallback",
                qw.source,
                qw.shape,
                str(e).splitlines()[0],
            )
            return fallback(qw)
    # the K-quant kernel's build is part of the key: a process may load one model with each (bench/vs_llama_cpp.py)
    key = (qw.shape, qw.bits, qw.group_size, not qw.has_offset, qw.source, device.type, dtype, isa_setting())
    ranked = _CHOICES.get(key)
    if ranked is None or not any(name in builders for name in ranked):  # an applicability that depends on the codes
        ranked = _CHOICES[key] = _rank_on_proxy(qw, builders, device, dtype)
    x = torch.randn(1, qw.shape[1], device=device, dtype=dtype)
    references: dict[bool, tuple] = {}  # wide or not: (rows, the exact product over them)
    for name in (name for name in ranked if name in builders):
        wide = (key, name) not in _CHECKED_WIDE
        if wide not in references:
            rows = checked_rows(qw.shape[0], wide)
            references[wide] = (rows, exact_product(qw, x, rows))
        rows, reference = references[wide]
        kernel = builders[name](qw)
        error = _disagreement(kernel, reference, x, rows)
        if error <= 1:
            _CHECKED_WIDE.add((key, name))
            if isinstance(kernel, QuantizedMatmul):
                kernel.dense_from_rows = _prefill_rows(qw, builders, name, key, dtype)
            return kernel
        log.warning(
            "%s agreed on sampled rows of a %s weight %s but is off by %.3g times the tolerance over %s; not used",
            name,
            qw.source,
            qw.shape,
            error,
            f"{len(rows)} of its {qw.shape[0]} rows",
        )
        del kernel
    raise RuntimeError(f"no kernel multiplies a {qw.source} weight of shape {qw.shape} correctly on {device}")


def _proxy(qw: QuantizedWeight) -> QuantizedWeight:
    index = sampled_rows(*qw.shape)
    return qw if index is None else take_rows(qw, index)


def _rank_on_proxy(qw: QuantizedWeight, builders: dict, device: torch.device, dtype: torch.dtype) -> list[str]:
    """The names of the kernels that agree with the reference on `qw`'s proxy, fastest at one row first. Each is
    built, checked, timed and freed before the next."""
    proxy = _proxy(qw)
    x = torch.randn(1, qw.shape[1], device=device, dtype=dtype)
    reference = F.linear(x.float(), proxy.dequantize())
    timed: dict[str, float] = {}
    for name, build in builders.items():
        try:
            kernel = build(proxy)
            error = _disagreement(kernel, reference, x)
        except RuntimeError as e:  # a kernel this torch build or CPU lacks
            log.info("%s cannot run here: %s", name, str(e).splitlines()[0])
            continue
        if error > 1:
            log.warning(
                "%s disagrees with the reference by %.3g times the tolerance on %s; not used", name, error, qw.shape
            )
        else:
            timed[name] = _seconds_per_call(kernel, x)
        del kernel
    if not timed:
        raise RuntimeError(f"no kernel multiplies a {qw.source} weight of shape {qw.shape} correctly on {device}")
    ranked = sorted(timed, key=timed.get)
    log.debug(
        "kernels for a %s weight %s, on %d of its rows: %s",
        qw.source,
        qw.shape,
        proxy.shape[0],
        ", ".join(f"{name} {timed[name] * 1e6:.0f} us" for name in ranked),
    )
    return ranked


def _prefill_rows(qw: QuantizedWeight, builders: dict, name: str, key: tuple, dtype: torch.dtype) -> int | None:
    """The fewest rows of PREFILL_ROWS at which multiplying by the dequantized bf16 weight beats kernel `name`, if
    any, measured once per shape and layout on the kernel built over the weight's proxy."""
    if (name, key) not in _PREFILL_CHOICES:
        _PREFILL_CHOICES[name, key] = choose_prefill_rows(builders[name](_proxy(qw)), dtype)
    return _PREFILL_CHOICES[name, key]


@torch.inference_mode()
def choose_prefill_rows(kernel: nn.Module, dtype: torch.dtype) -> int | None:
    """The fewest rows of PREFILL_ROWS at which `kernel` runs faster through its dequantized bf16 weight, if any
    (None also where the kernel cannot rebuild its weight)."""
    if not isinstance(kernel, QuantizedMatmul) or kernel.dequantized_bf16() is None:
        return None
    for rows in PREFILL_ROWS:
        x = torch.randn(rows, kernel.in_features, dtype=dtype)
        kernel.dense_from_rows = None
        plain = _seconds_per_call(kernel, x, calls=3)
        kernel.dense_from_rows = rows
        dense = _seconds_per_call(kernel, x, calls=3)
        if dense < plain:
            return rows
    return None
