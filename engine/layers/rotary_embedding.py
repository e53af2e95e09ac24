"""Rotary position embedding (rotate-half form, as Llama and Qwen use), with Llama 3, LongRoPE and YaRN scaling, over
the whole head or its first `partial_rotary_factor` share (Phi-3/4)."""

import contextlib
import math

import torch
from torch import nn

from engine.layers.layernorm import RMSNorm, rms_norm
from engine.runner.tracing import tracing_decode_step


def rope_parameters(hf_config) -> dict:
    """The rope settings of a HF config, for transformers 5 (`rope_parameters`) and 4 (`rope_theta`, `rope_scaling`)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        params.update(getattr(hf_config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in ("longrope", "yarn"):
        params.setdefault(
            "original_max_position_embeddings", getattr(hf_config, "original_max_position_embeddings", None)
        )
        if params.get("factor") is None:  # Phi-3's (and YaRN's) rule: the context's growth over its pretraining length
            params["factor"] = hf_config.max_position_embeddings / params["original_max_position_embeddings"]
    return params


def rotary_dim(head_dim: int, params: dict) -> int:
    """The dimensions of each head that rotate as pairs (i, i + half). Proportional RoPE (Gemma 4) pairs across the
    whole head and leaves its share of frequencies past `partial_rotary_factor` at zero (`_inv_freq`)."""
    if params["rope_type"] == "proportional":
        return head_dim
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def attention_factor(params: dict) -> float:
    """LongRoPE and YaRN scale cos and sin by this (their paper's choice, unless the config names one); 1 otherwise."""
    if params["rope_type"] not in ("longrope", "yarn"):
        return 1.0
    if params.get("attention_factor") is not None:
        return params["attention_factor"]
    factor = params["factor"]
    if params["rope_type"] == "longrope":
        original = params["original_max_position_embeddings"]
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):  # DeepSeek's variant
        return mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
    return mscale(factor)


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, params: dict) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than `beta_slow` times over the pretraining length are interpolated by
    `factor`, those turning more than `beta_fast` times are kept, and a linear ramp blends the ones between."""
    base, factor = params["rope_theta"], params["factor"]
    original = params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _inv_freq(head_dim: int, params: dict, long: bool = False) -> torch.Tensor:
    """`head_dim`: the dimensions rotated. `long`: LongRoPE's factors for positions past the pretraining length."""
    base = params["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "longrope":
        factors = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
        return inv_freq / factors
    if kind == "linear":
        return inv_freq / params["factor"]
    if kind == "proportional":  # the first share of frequencies over the whole head's; the rest turn not at all
        turning = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq[turning:] = 0.0
        return inv_freq / params.get("factor", 1.0)
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, params)
    if kind == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(
        f"rope_type {kind!r} is not supported; supported: default, linear, llama3, longrope, proportional, yarn"
    )


def apply_rotary(qk: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin`, with rotate_half(x) = cat(-x2, x1) taken as
    roll(x) = cat(x2, x1) times a sin whose first half is negated: the same products, bit for bit,
    in two ops fewer."""
    return qk * cos + qk.roll(qk.shape[-1] // 2, -1) * signed_sin


def norm_and_rotate(
    qk: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    num_q_heads: int,
    q_eps: float,
    k_eps: float,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
) -> torch.Tensor:
    """Qwen3's RMSNorm of each head (q's heads by the q norm, k's by the k norm), then the
    rotation. q and k go through as one tensor: compiled, that is one kernel in the decode graphs,
    where separate q and k took two (H200 profile, bench/RESULTS.md)."""
    num_k_heads = qk.shape[-2] - num_q_heads
    if q_eps != k_eps:  # no checkpoint does this (both come from rms_norm_eps): normalise apart
        q, k = qk.split([num_q_heads, num_k_heads], dim=-2)
        normed = torch.cat((rms_norm(q, q_weight, q_eps), rms_norm(k, k_weight, k_eps)), dim=-2)
    else:
        weight = torch.cat((q_weight.expand(num_q_heads, -1), k_weight.expand(num_k_heads, -1)))
        normed = rms_norm(qk, weight, q_eps)
    return apply_rotary(normed, cos, signed_sin)


class RotaryEmbedding(nn.Module):
    # Plain functions, so one torch.compile of each serves every layer (see ModelRunner).
    fn = staticmethod(apply_rotary)
    norm_fn = staticmethod(norm_and_rotate)

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        self.head_dim, self.max_position, self.params = head_dim, max_position, params
        self.rotary_dim = rotary_dim(head_dim, params)
        self.init_caches()
        # One instance serves every layer: look up a step's cos/sin once, not once per layer. One
        # tuple, read and replaced whole: a second thread's forward (the compiled decode steps' trace
        # and measurement, engine/runner/compiled_decode.py) may run beside the engine's.
        self._step: tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None] = (None, None)

    def init_caches(self, device: torch.device | None = None) -> None:
        """(Re)compute the cos/sin tables, on `device` if given: a model built on the meta device and
        moved with `to_empty` has only uninitialised tables until this runs."""
        with torch.device(device) if device is not None else contextlib.nullcontext():
            positions = torch.arange(self.max_position, dtype=torch.float32)
            freqs = torch.outer(positions, _inv_freq(self.rotary_dim, self.params))
            if self.params["rope_type"] == "longrope":
                # Positions past the pretraining length take the long factors. transformers switches every position
                # of a forward once the sequence is that long (keys cached before keep the short ones); vLLM switches
                # the batch. Per position, a sequence's rotation never changes under it; within the pretraining
                # length all three agree.
                original = self.params["original_max_position_embeddings"]
                freqs[original:] = torch.outer(positions[original:], _inv_freq(self.rotary_dim, self.params, True))
            scale = attention_factor(self.params)
            emb = torch.cat((freqs, freqs), dim=-1)
            self.register_buffer("cos_cache", emb.cos() * scale, persistent=False)
            signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1) * scale
            self.register_buffer("signed_sin_cache", signed_sin, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,
        qk: torch.Tensor,
        num_q_heads: int,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """qk: [tokens, q heads + k heads, head_dim], q's heads first. With `q_norm` and `k_norm`
        (Qwen3), each head is normalised first."""
        if tracing_decode_step():
            # No attribute writes in a compiled graph (it is called without replaying them); the
            # compiler computes the lookup once for all layers anyway.
            cos_sin = self._lookup(positions, qk.dtype)
        else:
            step = self._step
            if step[0] is not positions:
                step = self._step = (positions, self._lookup(positions, qk.dtype))
            cos_sin = step[1]
        if self.rotary_dim < self.head_dim:  # the rest of each head passes through unrotated
            if q_norm is not None:
                qk = torch.cat((q_norm(qk[:, :num_q_heads]), k_norm(qk[:, num_q_heads:])), dim=1)
            rotated = self.fn(qk[..., : self.rotary_dim], *cos_sin)
            return torch.cat((rotated, qk[..., self.rotary_dim :]), dim=-1)
        if q_norm is None:
            return self.fn(qk, *cos_sin)
        return self.norm_fn(qk, q_norm.weight, k_norm.weight, num_q_heads, q_norm.eps, k_norm.eps, *cos_sin)

    def _lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            self.cos_cache[positions].unsqueeze(1).to(dtype),
            self.signed_sin_cache[positions].unsqueeze(1).to(dtype),
        )
