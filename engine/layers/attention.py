"""The attention layer: writes new K/V into the paged cache, then attends over it."""

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        sinks: bool = False,
    ):
        """`sliding_window`: each query sees only its last `sliding_window` positions (None: all before it).
        `sinks`: a learned logit per head that joins each softmax's denominator (gpt-oss), so a head may attend to
        nothing; loaded from the checkpoint."""
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"a sliding window spans at least 1 position, got {sliding_window}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.sliding_window = sliding_window
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None
        # Set by the ModelRunner once the cache is allocated.
        self.k_cache = self.v_cache = torch.empty(0)
        self.kv_group = 0  # its KV-cache group, whose block table and slots it reads (engine/runner/kv_cache.py)
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        meta = meta.for_group(self.kv_group)
        self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        # Backends' own defaults where the layer has neither, so a test's stand-in backend needs no window or sinks
        extra = {} if self.sinks is None else {"sinks": self.sinks}
        if self.sliding_window is None and not extra:
            return self.backend.paged_attention(q, self.k_cache, self.v_cache, meta, self.scale)
        return self.backend.paged_attention(
            q, self.k_cache, self.v_cache, meta, self.scale, self.sliding_window, **extra
        )

    def extra_repr(self) -> str:
        parts = [] if self.sliding_window is None else [f"sliding_window={self.sliding_window}"]
        return ", ".join(parts + ([] if self.sinks is None else ["sinks"]))
