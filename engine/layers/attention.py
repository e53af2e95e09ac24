"""The attention layer: writes new K/V into the paged cache, then attends over it."""

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.attention.key_mean import KeyMean
from engine.attention.kv_format import PLAIN, KVFormat, hadamard, rotate_and_pack
from engine.layers.rotary_embedding import RotaryEmbedding


class Attention(nn.Module):
    pack_fn = staticmethod(rotate_and_pack)  # a compiled version under CUDA graph capture (kernel_passes.py)

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        sinks: bool = False,
        kv_source: "Attention | None" = None,
    ):
        """`sliding_window`: each query sees only its last `sliding_window` positions (None: all before it).
        `sinks`: a learned logit per head that joins each softmax's denominator (gpt-oss), so a head may attend to
        nothing; loaded from the checkpoint. `kv_source`: an earlier layer whose cached keys and values this one
        attends over, computing and storing none of its own (Gemma 4's shared-KV layers); it holds no cache."""
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"a sliding window spans at least 1 position, got {sliding_window}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.sliding_window = sliding_window
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None
        if kv_source is not None and (kv_source.num_kv_heads, kv_source.head_dim) != (num_kv_heads, head_dim):
            raise ValueError("a layer that shares another's KV cache must have its KV heads and head size")
        # A plain attribute, not a submodule: the source is a layer of its own, listed once in the model.
        self.__dict__["kv_source"] = kv_source
        # Set by the ModelRunner once the cache is allocated.
        self.k_cache = self.v_cache = torch.empty(0)
        self.kv_group = 0  # its KV-cache group, whose block table and slots it reads (engine/runner/kv_cache.py)
        self.kv_format = PLAIN  # how its cache stores keys and values (engine/attention/kv_format.py)
        self.kv_rotation: torch.Tensor | None = None  # a quantized cache's Hadamard rotation (see use_kv_format)
        self.key_mean: KeyMean | None = None  # what a centring format takes out of each key (key_mean.py)
        self.backend: AttentionBackend | None = None

    def use_kv_format(self, kv_format: KVFormat, device: torch.device, rotary: RotaryEmbedding | None) -> None:
        """Store keys and values as `kv_format` says; a quantized cache holds them rotated (kv_format.py), and so
        the query is rotated to meet them and the output rotated back. `rotary`: what turned this layer's keys,
        which a format that centres keys needs (key_mean.py); its mean is zero until measured
        (engine/runner/key_means.py)."""
        self.kv_format = kv_format
        self.kv_rotation = hadamard(self.head_dim, device) if kv_format.quantized else None
        centred = kv_format.centres_keys and self.kv_source is None
        self.key_mean = KeyMean(self.num_kv_heads, self.head_dim, rotary, device, self.kv_rotation) if centred else None

    def _rotated(self, x: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
        return x if rotation is None else (x.float() @ rotation).to(x.dtype)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, meta: AttentionMetadata
    ) -> torch.Tensor:
        """k and v: this step's new keys and values; None for a layer with a `kv_source`, whose cache (written
        by the source earlier in this step) it reads."""
        owner = self if self.kv_source is None else self.kv_source
        meta = meta.for_group(owner.kv_group)
        kv_format, rotation, key_mean = owner.kv_format, owner.kv_rotation, owner.key_mean
        # Backends' own defaults where the layer has none, so a test's stand-in backend needs no window or sinks
        extra = {} if self.sinks is None else {"sinks": self.sinks}
        if key_mean is not None:
            extra["mean_scores"] = key_mean.scores(q)
            if owner is self:
                positions = meta.token_positions(k.shape[0])
                key_mean.observe(k, positions)
                k = k.float() - key_mean.at(positions)
        q = self._rotated(q, rotation)
        if owner is self:
            k_rows, v_rows = self.pack_fn(k, rotation, kv_format), self.pack_fn(v, rotation, kv_format)
            self.backend.store_kvcache(k_rows, v_rows, self.k_cache, self.v_cache, meta.slot_mapping)
        k_cache, v_cache = owner.k_cache, owner.v_cache
        if kv_format.quantized:
            extra["kv_format"] = kv_format
        if self.sliding_window is None and not extra:
            return self.backend.paged_attention(q, k_cache, v_cache, meta, self.scale)
        out = self.backend.paged_attention(q, k_cache, v_cache, meta, self.scale, self.sliding_window, **extra)
        return self._rotated(out, rotation)

    def extra_repr(self) -> str:
        parts = [] if self.sliding_window is None else [f"sliding_window={self.sliding_window}"]
        parts += [] if self.sinks is None else ["sinks"]
        parts += [f"kv_cache_dtype={self.kv_format.name}"] if self.kv_format.quantized else []
        return ", ".join(parts + ([] if self.kv_source is None else ["shares an earlier layer's KV cache"]))
