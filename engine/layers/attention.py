"""The attention layer: writes new K/V into the paged cache, then attends over it."""

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # Set by the ModelRunner once the cache is allocated.
        self.k_cache = self.v_cache = torch.empty(0)
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.backend.paged_attention(q, self.k_cache, self.v_cache, meta, self.scale)
