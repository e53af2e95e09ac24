"""The GPU kernel passes a loaded model gets, measured on its own weight shapes: the Triton few-row matmul
where it beats cuBLAS, a decoder norm run inside the projection after it, and the compiled elementwise
ops that decode graphs capture. Each swaps modules or functions in place, so `print(model)` shows it.

They run in half precision on CUDA with Triton only: float32 keeps cuBLAS, whose sums the exact-match
tests against transformers rely on.
"""

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from engine.attention.kv_format import KVFormat, rotate_and_pack
from engine.layers.activation import SiluAndMul, silu_and_mul
from engine.layers.attention import Attention
from engine.layers.layernorm import RMSNorm, add_rms_norm, rms_norm
from engine.layers.linear import PackableLinear
from engine.layers.rotary_embedding import RotaryEmbedding, apply_rotary, norm_and_rotate

log = logging.getLogger("engine")

_COMPILED: dict = {}  # shared by every engine in the process, so each op compiles once


def triton_matmuls_apply(device: torch.device, dtype: torch.dtype) -> bool:
    from engine.attention import triton_available

    return device.type == "cuda" and dtype != torch.float32 and triton_available()


@torch.inference_mode()
def choose_gemv(model: nn.Module, device: torch.device, dtype: torch.dtype) -> dict[int, int]:
    """Measure the Triton few-row matmul against cuBLAS on each weight shape, before the KV cache takes
    the memory the timing runs need. Returns, per row bucket, how many layers took the kernel."""
    if not triton_matmuls_apply(device, dtype):
        return {}
    from engine.layers.gemv import choose_gemv as choose

    linears = [m for m in model.modules() if isinstance(m, PackableLinear)]
    start = time.perf_counter()
    used = choose(linears)  # the first load on a machine also compiles the kernel's variants
    log.info(
        "Triton GEMV chosen over cuBLAS for %s of %d linear layers (measured in %.1f s)",
        ", ".join(f"{n} at {rows} row(s)" for rows, n in used.items()),
        len(linears),
        time.perf_counter() - start,
    )
    return used


@torch.inference_mode()
def choose_normed(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Measure running each decoder norm inside the projection after it, at one row, against the
    separate ops as the decode graphs run them (compiled). Returns how many projections took the
    fused kernel."""
    if not triton_matmuls_apply(device, dtype):
        return 0
    from engine.layers.normed_gemv import choose_normed as choose

    start, pairs = time.perf_counter(), model.norm_projections()
    with compiled_small_ops(model):
        used = choose(pairs)
    log.info(
        "norm fused into the projection after it at one row: %d of %d projections (measured in %.1f s)",
        used,
        len(pairs),
        time.perf_counter() - start,
    )
    return used


def quantizer_compiles(kv_format: KVFormat, device: torch.device) -> bool:
    """Whether a quantized cache's quantizer may be compiled for `device`: inductor's Triton code converts to float8
    e4m3 only on sm_89 and later (RTX 40, H100), so an RTX 30 GPU (sm_86) keeps the eager fp8 quantizer, whose
    conversion ATen does."""
    if kv_format.name != "fp8" or device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


@contextmanager
def compiled_small_ops(model: nn.Module) -> Iterator[None]:
    """Swap in torch.compile'd versions of the elementwise ops between the GEMMs (and a quantized KV cache's
    quantizer), for graph capture.

    Each op is one plain function compiled once with dynamic shapes and shared by every layer.
    Inside a graph they cost nothing on the host; called eagerly, each compiled call spends
    ~0.25 ms checking guards, more than it saves, so eager steps keep the plain functions."""
    if not _COMPILED:
        _COMPILED.update(
            {
                fn: torch.compile(fn, dynamic=True)
                for fn in (rms_norm, add_rms_norm, silu_and_mul, apply_rotary, norm_and_rotate, rotate_and_pack)
            }
        )
    swaps = []
    for m in model.modules():
        if isinstance(m, RMSNorm):
            swaps += [(m, "norm_fn", rms_norm), (m, "add_norm_fn", add_rms_norm)]
        elif isinstance(m, SiluAndMul):
            swaps.append((m, "fn", silu_and_mul))
        elif isinstance(m, RotaryEmbedding):
            swaps += [(m, "fn", apply_rotary), (m, "norm_fn", norm_and_rotate)]
        elif isinstance(m, Attention) and m.kv_format.quantized and quantizer_compiles(m.kv_format, m.k_cache.device):
            swaps.append((m, "pack_fn", rotate_and_pack))
    for module, name, fn in swaps:
        setattr(module, name, _COMPILED[fn])
    try:
        yield
    finally:
        for module, name, _ in swaps:
            delattr(module, name)  # back to the class's plain function
