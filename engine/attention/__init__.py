"""Attention backends. `torch` is the reference; `triton` is the fast path on CUDA."""
from dataclasses import dataclass
from typing import Callable

import torch

from engine.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    store_kvcache: Callable
    paged_attention: Callable


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(requested: str, device: torch.device) -> AttentionBackend:
    """`auto` takes Triton kernels on CUDA when Triton is installed, else the torch reference."""
    name = requested
    if requested == "auto":
        name = "triton" if device.type == "cuda" and triton_available() else "torch"
    if name == "torch":
        from engine.attention import torch_backend as impl
    elif name == "triton":
        if not triton_available():
            raise ValueError("attention_backend='triton' needs the triton package: pip install triton")
        if device.type != "cuda":
            raise ValueError("attention_backend='triton' runs on CUDA devices; use 'torch' on CPU")
        from engine.attention import triton_kernels as impl
    else:
        raise ValueError(f"unknown attention backend {requested!r}; choose auto, torch or triton")
    return AttentionBackend(name, impl.store_kvcache, impl.paged_attention)


__all__ = ["AttentionBackend", "AttentionMetadata", "select_backend"]
