"""Gemma 3 (text): five sliding-window layers to each global one, each with its own rotary base; RMSNorm around both
the attention and the MLP of every layer (Gemma's: weights stored as an offset from 1, computed in float32); q and k
normalised per head; queries scaled by query_pre_attn_scalar; a GELU-gated MLP; embeddings scaled by sqrt(hidden);
logits soft-capped where the config says. Weight names are Llama's plus the two feed-forward norms.
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata
from engine.layers.attention import Attention
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.layers.rotary_embedding import RotaryEmbedding
from engine.models.llama import LlamaForCausalLM, layer_windows
from engine.runner.distributed import SINGLE, TPGroup


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, rounded to x's dtype last (transformers' Gemma3RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def layer_rope(config, layer_type: str) -> dict:
    """The rotary settings of one kind of layer: transformers 5 keeps them per layer type."""
    params = dict(config.rope_parameters.get(layer_type, config.rope_parameters))
    params.setdefault("rope_type", "default")
    return params


class GemmaAttention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, sliding_window: int | None, tp: TPGroup):
        super().__init__()
        heads, kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        bias = bool(config.attention_bias)
        self.qkv_proj = ColumnParallelLinear.qkv(config.hidden_size, self.head_dim, heads, kv_heads, tp, bias)
        self.split = self.qkv_proj.output_sizes
        self.num_heads, self.num_kv_heads = self.split[0] // self.head_dim, self.split[1] // self.head_dim
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, bias=bias, tp=tp)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        scale = config.query_pre_attn_scalar**-0.5
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale, sliding_window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        q, k = self.rotary(positions, torch.cat((q, k), dim=1), self.num_heads).split(
            [self.num_heads, self.num_kv_heads], dim=1
        )
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, meta).flatten(1))


class GemmaMLP(nn.Module):
    def __init__(self, config, tp: TPGroup):
        super().__init__()
        if config.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(f"Gemma's MLP activation {config.hidden_activation!r} is not supported")
        self.gate_up_proj = ColumnParallelLinear.split(config.hidden_size, [config.intermediate_size] * 2, tp, False)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, sliding_window: int | None, tp: TPGroup):
        super().__init__()
        self.self_attn = GemmaAttention(config, rotary, sliding_window, tp)
        self.mlp = GemmaMLP(config, tp)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    def __init__(self, config, max_position: int, tp: TPGroup):
        super().__init__()
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError("attention logit soft-capping is not supported yet; this Gemma config sets it")
        windows = layer_windows(config)
        rotaries = {
            kind: RotaryEmbedding(config.head_dim, max_position, layer_rope(config, kind))
            for kind in ("sliding_attention", "full_attention")
        }
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, rotaries["sliding_attention" if w else "full_attention"], w, tp) for w in windows
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # the scale rounded to the weights' dtype first
        for layer in self.layers:
            x = layer(positions, x, meta)
        return self.norm(x)


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config, max_position: int, tp: TPGroup = SINGLE):
        nn.Module.__init__(self)
        self.model = Gemma3Model(config, max_position, tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    def norm_projections(self) -> list:
        return []  # Gemma's norms are not the fused kernel's (weights offset from 1, and around the blocks)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        if logits is None or self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text part of a Gemma 3 checkpoint that also holds a vision tower (gemma-3-4b-it and larger): the engine
    serves its language model; the vision tower and projector are not read (images are not supported yet)."""

    # checkpoint prefix -> ours: the hub's checkpoints, then transformers 5's own layout
    RENAMES = (
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),
    )
    VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")

    def checkpoint_name(self, name: str) -> str | None:
        """Our name for a checkpoint tensor; None for the vision part's."""
        if name.startswith(self.VISION):
            return None
        for prefix, ours in self.RENAMES:
            if name.startswith(prefix):
                return ours + name[len(prefix) :]
        return name
