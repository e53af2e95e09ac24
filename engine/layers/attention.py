"""The attention layer: writes new K/V into the paged cache, then attends over it."""

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None = None
    ):
        """`sliding_window`: each query sees only its last `sliding_window` positions (None: all before it)."""
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"a sliding window spans at least 1 position, got {sliding_window}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.sliding_window = sliding_window
        # Set by the ModelRunner once the cache is allocated.
        self.k_cache = self.v_cache = torch.empty(0)
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if self.sliding_window is None:  # backends' own default, so a test's stand-in backend needs no window
            return self.backend.paged_attention(q, self.k_cache, self.v_cache, meta, self.scale)
        return self.backend.paged_attention(q, self.k_cache, self.v_cache, meta, self.scale, self.sliding_window)

    def extra_repr(self) -> str:
        return "" if self.sliding_window is None else f"sliding_window={self.sliding_window}"
