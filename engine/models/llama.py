"""The Llama decoder, in one file. Qwen2 and Qwen3 are the same network with small switches.

Inputs are flattened: `input_ids` and `positions` are [num_tokens] for the whole batch, and the
AttentionMetadata says which tokens belong to which sequence.

Tensor parallelism: with `tp` of size N, each rank holds 1/N of the attention heads and MLP
columns, and the row-parallel o_proj and down_proj add up the ranks' partial sums. The network
code is the same for every N; the layers in engine/layers do the splitting.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.layers.activation import SiluAndMul
from engine.layers.attention import Attention
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from engine.runner.distributed import SINGLE, TPGroup


@dataclass(frozen=True)
class ModelFlags:
    """Where the families' decoders differ: each family's `flags(config)` says."""

    qkv_bias: bool  # biases on the q, k and v projections (Qwen2 always; Llama and Qwen3 as configured)
    o_bias: bool  # a bias on the attention's output projection
    qk_norm: bool  # RMSNorm over each head of q and k before rotary (Qwen3)
    mlp_bias: bool  # biases on gate/up and down
    attention_sinks: bool = False  # a learned logit per head in each attention softmax's denominator (gpt-oss)


LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window (None: full attention), from transformers' `layer_types` where the config has
    them (Qwen2/3 with use_sliding_window, Ministral), else `sliding_window` on every layer (Mistral) or none."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        return [window] * config.num_hidden_layers
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer types {unknown} are not supported by this model family; supported: {LAYER_TYPES}")
    if "sliding_attention" in types and not window:
        raise ValueError("the config has sliding-attention layers but no sliding_window; the checkpoint is broken")
    return [window if kind == "sliding_attention" else None for kind in types]


class DecoderAttention(nn.Module):
    def __init__(
        self,
        config,
        rotary: RotaryEmbedding | None,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        tp: TPGroup,
        sliding_window: int | None = None,
        sinks: bool = False,
    ):
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = config.num_key_value_heads or num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        self.qkv_proj = ColumnParallelLinear.qkv(
            config.hidden_size, self.head_dim, num_heads, num_kv_heads, tp, qkv_bias
        )
        self.split = self.qkv_proj.output_sizes
        # Heads on this rank.
        self.num_heads, self.num_kv_heads = self.split[0] // self.head_dim, self.split[1] // self.head_dim
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size, bias=o_bias, tp=tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, sliding_window, sinks
        )

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm: RMSNorm,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over norm(x + residual); returns its output and x + residual."""
        qkv, residual = self.qkv_proj.normed(x, residual, norm)
        qk, v = qkv.split([self.split[0] + self.split[1], self.split[2]], dim=-1)
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.rotary is not None:  # Qwen3 normalises each head first
            qk = self.rotary(positions, qk, self.num_heads, self.q_norm, self.k_norm)
        elif self.q_norm is not None:  # a layer without positions (SmolLM3's NoPE layers)
            qk = torch.cat([self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], dim=1)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, meta).flatten(1)), residual


class DecoderMLP(nn.Module):
    def __init__(self, config, bias: bool, tp: TPGroup):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear.split(config.hidden_size, [config.intermediate_size] * 2, tp, bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias, tp=tp)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP of norm(x + residual); returns its output and x + residual."""
        h, residual = self.gate_up_proj.normed(x, residual, norm, self.act)
        return self.down_proj(h), residual


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        rotary: RotaryEmbedding | None,
        flags: ModelFlags,
        tp: TPGroup,
        mlp: nn.Module,
        sliding_window: int | None = None,
    ):
        """`mlp`: the layer's feed-forward block, called as mlp(x, residual, norm) like DecoderMLP."""
        super().__init__()
        self.self_attn = DecoderAttention(
            config, rotary, flags.qkv_bias, flags.o_bias, flags.qk_norm, tp, sliding_window, flags.attention_sinks
        )
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, residual, meta):
        # Each norm (and the residual add before it) is applied by the projection that follows it,
        # which at batch-1 decode may run all of it in one kernel (engine/layers/normed_gemv.py).
        x, residual = self.self_attn(positions, x, residual, self.input_layernorm, meta)
        return self.mlp(x, residual, self.post_attention_layernorm)


class DecoderModel(nn.Module):
    def __init__(self, config, max_position: int, flags: ModelFlags, tp: TPGroup, make_mlp: Callable[[int], nn.Module]):
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = RotaryEmbedding(head_dim, max_position, rope_parameters(config))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        windows = layer_windows(config)
        # SmolLM3 leaves rotary out of some layers (NoPE): its no_rope_layers holds 1 where a layer has it
        uses_rope = getattr(config, "no_rope_layers", None) or [1] * config.num_hidden_layers
        self.layers = nn.ModuleList(
            DecoderLayer(config, rotary if uses_rope[i] else None, flags, tp, make_mlp(i), windows[i])
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # Whether a decode step decides nothing on the host, so that it can be a CUDA graph or a compiled CPU graph.
    static_decode = True
    # checkpoint name -> (our parameter's module, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @staticmethod
    def flags(config) -> ModelFlags:
        bias = bool(getattr(config, "attention_bias", False))
        return ModelFlags(qkv_bias=bias, o_bias=bias, qk_norm=False, mlp_bias=bool(getattr(config, "mlp_bias", False)))

    def __init__(self, config, max_position: int, tp: TPGroup = SINGLE):
        super().__init__()
        flags = self.flags(config)
        self.model = DecoderModel(config, max_position, flags, tp, lambda i: self.make_mlp(config, i, flags, tp))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, config, layer_index: int, flags: ModelFlags, tp: TPGroup) -> nn.Module:
        """Layer `layer_index`'s feed-forward block: a gated MLP in every layer of a dense family."""
        return DecoderMLP(config, flags.mlp_bias, tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def norm_projections(self) -> list[tuple[ColumnParallelLinear, RMSNorm, SiluAndMul | None]]:
        """(projection, the norm it applies first, the activation it applies last or None) for each
        norm that a projection runs: what engine/layers/normed_gemv.py may fuse into one kernel."""
        pairs = []
        for layer in self.model.layers:
            pairs.append((layer.self_attn.qkv_proj, layer.input_layernorm, None))
            if isinstance(layer.mlp, DecoderMLP):  # a mixture of experts has no one projection to fuse into
                pairs.append((layer.mlp.gate_up_proj, layer.post_attention_layernorm, layer.mlp.act))
        return pairs

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits of the given rows; with tensor parallelism, on rank 0 only (None elsewhere)."""
        return self.lm_head(hidden)
