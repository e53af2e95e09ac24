"""Attention backends. `torch` is the reference; on CUDA, Triton kernels, or flash-attn's where it applies."""

import functools
import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from engine.attention.kv_format import KV_FORMAT_BACKENDS
from engine.attention.metadata import AttentionMetadata

FLASH_ATTN_PAGE_MULTIPLE = 256  # flash-attn 2's paged kernels read pages of a multiple of 256 tokens


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    store_kvcache: Callable
    paged_attention: Callable


# The backends whose paged_attention takes attention sinks (`sinks=`, a logit per head: gpt-oss)
SINK_BACKENDS = ("torch", "triton")


@functools.cache
def importable(package: str) -> bool:
    """Whether `package` imports (a flash-attn built for another torch fails here, not mid-step)."""
    try:
        importlib.import_module(package)
    except ImportError:
        return False
    return True


def triton_available() -> bool:
    return importable("triton")


def flash_attn_available() -> bool:
    return importable("flash_attn")


def flash_attn_unusable(device: torch.device, dtype: torch.dtype, block_size: int) -> str | None:
    """Why flash-attn's kernels cannot serve this engine, or None when they can. The imports come
    last: at the default block size a CUDA start-up never pays for importing flash-attn."""
    if device.type != "cuda":
        return "it runs on CUDA devices"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"it computes in float16 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    if block_size % FLASH_ATTN_PAGE_MULTIPLE:
        return (
            f"its paged kernels need kvcache_block_size to be a multiple of {FLASH_ATTN_PAGE_MULTIPLE}, "
            f"and it is {block_size}"
        )
    if not triton_available():
        return "its KV writes use the Triton kernel, and triton is not installed"
    if not flash_attn_available():
        return "it needs the flash-attn package (pip install flash-attn)"
    return None


def select_backend(
    requested: str,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    sinks: bool = False,
    kv_cache_dtype: str = "auto",
) -> AttentionBackend:
    """`auto` takes flash-attn's kernels on CUDA where they apply (package installed, half precision,
    blocks of a multiple of 256 tokens), else Triton kernels on CUDA when Triton is installed, else
    the torch reference. `sinks`: the model's attention has sinks, which only SINK_BACKENDS compute.
    A quantized KV cache (`kv_cache_dtype`) is read by KV_FORMAT_BACKENDS only."""
    name = requested
    if requested != "auto" and sinks and requested not in SINK_BACKENDS:
        raise ValueError(
            f"attention_backend={requested!r} does not compute attention sinks yet, which this model's attention "
            f"has; use {' or '.join(repr(b) for b in SINK_BACKENDS)} (or 'auto')"
        )
    if kv_cache_dtype != "auto" and requested not in ("auto", *KV_FORMAT_BACKENDS):
        raise ValueError(
            f"attention_backend={requested!r} cannot read a quantized KV cache (kv_cache_dtype={kv_cache_dtype!r}) "
            f"yet; use attention_backend={' or '.join(repr(b) for b in KV_FORMAT_BACKENDS)} (or 'auto'), "
            "or kv_cache_dtype='auto'"
        )
    if requested == "auto":
        if sinks or kv_cache_dtype != "auto":  # flash-attn 2 has no sinks, and reads no quantized cache
            name = "triton" if device.type == "cuda" and triton_available() else "torch"
        elif flash_attn_unusable(device, dtype, block_size) is None:
            name = "flash-attn"
        else:
            name = "triton" if device.type == "cuda" and triton_available() else "torch"
    if name == "torch":
        from engine.attention import torch_backend as impl
    elif name == "triton":
        if not triton_available():
            raise ValueError("attention_backend='triton' needs the triton package: pip install triton")
        if device.type != "cuda":
            raise ValueError("attention_backend='triton' runs on CUDA devices; use 'torch' on CPU")
        from engine.attention import triton_kernels as impl
    elif name == "flash-attn":
        reason = flash_attn_unusable(device, dtype, block_size)
        if reason is not None:
            raise ValueError(
                f"attention_backend='flash-attn' cannot be used here: {reason}; "
                "use 'auto' to pick the fastest backend that can"
            )
        from engine.attention import flash_attn_backend as impl
    else:
        raise ValueError(f"unknown attention backend {requested!r}; choose auto, torch, triton or flash-attn")
    return AttentionBackend(name, impl.store_kvcache, impl.paged_attention)


__all__ = ["AttentionBackend", "AttentionMetadata", "select_backend"]
