"""Rotary position embedding (rotate-half form, as Llama and Qwen use), with Llama 3 scaling."""
import math

import torch
from torch import nn

from engine.layers.layernorm import RMSNorm, rms_norm


def rope_parameters(hf_config) -> dict:
    """The rope settings of a HF config, for transformers 5 (`rope_parameters`) and 4 (`rope_theta`, `rope_scaling`)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        params.update(getattr(hf_config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    base = params["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / params["factor"]
    if kind == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_type {kind!r} is not supported; supported: default, linear, llama3")


def apply_rotary(q, k, cos, signed_sin):
    """transformers' `x * cos + rotate_half(x) * sin`, with rotate_half(x) = cat(-x2, x1) taken as
    roll(x) = cat(x2, x1) times a sin whose first half is negated: the same products, bit for bit,
    in two ops fewer."""
    half = q.shape[-1] // 2
    return q * cos + q.roll(half, -1) * signed_sin, k * cos + k.roll(half, -1) * signed_sin


def norm_and_rotate(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, q_eps: float,
                    k_eps: float, cos: torch.Tensor, signed_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's RMSNorm of each head of q and k, then the rotation: one function, so that in the
    decode graphs one compiled kernel does what three separate ones did."""
    return apply_rotary(rms_norm(q, q_weight, q_eps), rms_norm(k, k_weight, k_eps), cos, signed_sin)


class RotaryEmbedding(nn.Module):
    # Plain functions, so one torch.compile of each serves every layer (see ModelRunner).
    fn = staticmethod(apply_rotary)
    norm_fn = staticmethod(norm_and_rotate)

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), _inv_freq(head_dim, params))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("signed_sin_cache", torch.cat((-freqs.sin(), freqs.sin()), dim=-1), persistent=False)
        # One instance serves every layer: look up a step's cos/sin once, not once per layer.
        self._positions: torch.Tensor | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None):
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]. With `q_norm` and `k_norm`
        (Qwen3), each head is normalised first."""
        if positions is not self._positions:
            self._positions = positions
            self._cos_sin = (self.cos_cache[positions].unsqueeze(1).to(q.dtype),
                             self.signed_sin_cache[positions].unsqueeze(1).to(q.dtype))
        if q_norm is None:
            return self.fn(q, k, *self._cos_sin)
        return self.norm_fn(q, k, q_norm.weight, k_norm.weight, q_norm.eps, k_norm.eps, *self._cos_sin)
