"""Qwen3.5 (text): three Gated DeltaNet layers (linear attention with a fixed-size state, engine/layers/
gated_deltanet.py) to each gated full-attention layer. The attention layers' queries come with an output gate
(q_proj writes each head's query, then its gate), q and k are normalised per head, rotary turns a quarter of each
head; norms are zero-centred (weights stored as an offset from 1, as Gemma's). The hub's checkpoints are
Qwen3_5ForConditionalGeneration (a vision tower beside the language model): the engine serves the language model.

Its full-attention layers keep a paged KV cache; its linear layers keep a state slot per running request, and
snapshots of it for the prefix cache (engine/core/state_slots.py).
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata
from engine.layers.attention import Attention
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.layers.fused_moe import FusedMoE, Routing, TopKRouter
from engine.layers.gated_deltanet import GatedDeltaNet
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from engine.models.gemma3 import Gemma3ForConditionalGeneration, GemmaRMSNorm
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen3_5_mtp import MTP_PREFIX
from engine.runner.distributed import SINGLE, TPGroup

LAYER_KINDS = ("linear_attention", "full_attention")


class GatedAttention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding):
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads = heads, kv_heads
        q, kv = 2 * heads * self.head_dim, kv_heads * self.head_dim  # q_proj: each head's query, then its gate
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [(q, 0, q), (kv, 0, kv), (kv, 0, kv)])
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(heads, kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q_gate, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q, gate = q_gate.view(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        q, k = self.rotary(positions, torch.cat((q, k), dim=1), self.num_heads).split(
            [self.num_heads, self.num_kv_heads], dim=1
        )
        out = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), meta).flatten(1)
        return self.o_proj(out * torch.sigmoid(gate.reshape(out.shape)))


class Qwen3_5MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear.split(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SharedExpertMoE(nn.Module):
    """Qwen3.5-MoE's feed-forward block: routed experts (softmax, top k renormalised) plus a shared expert that
    every token runs, scaled by its own sigmoid gate."""

    def __init__(self, config):
        super().__init__()
        renormalize = bool(getattr(config, "norm_topk_prob", True))  # Qwen3-Next says; Qwen3.5 always does
        routing = Routing(config.num_experts, config.num_experts_per_tok, "softmax", renormalize)
        self.gate = TopKRouter(config.hidden_size, routing)
        self.experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_expert = Qwen3_5MLP(config.hidden_size, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, weights, ids) + shared


def feed_forward(config, index: int) -> nn.Module:
    """Layer `index`'s MLP: experts where the config has them (every layer of Qwen3.5-MoE; Qwen3-Next's every
    decoder_sparse_step-th but its mlp_only_layers), else a dense one."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = index in (getattr(config, "mlp_only_layers", None) or []) or (index + 1) % step
    if getattr(config, "num_experts", 0) and not dense:
        return SharedExpertMoE(config)
    return Qwen3_5MLP(config.hidden_size, config.intermediate_size)


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config, index: int, rotary: RotaryEmbedding, kind: str | None = None):
        """Layer `index` of the model, of the kind config.layer_types gives it unless `kind` says (the MTP head's
        layers, engine/models/qwen3_5_mtp.py, come after the model's)."""
        super().__init__()
        kind = kind or config.layer_types[index]
        self.linear_attn = GatedDeltaNet(config) if kind == "linear_attention" else None
        self.self_attn = GatedAttention(config, rotary) if kind == "full_attention" else None
        self.mlp = feed_forward(config, index)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.linear_attn(h, meta) if self.linear_attn is not None else self.self_attn(positions, h, meta)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5Model(nn.Module):
    def __init__(self, config, max_position: int):
        super().__init__()
        unknown = sorted(set(config.layer_types) - set(LAYER_KINDS))
        if unknown:
            raise ValueError(f"layer types {unknown} are not supported for Qwen3.5; supported: {LAYER_KINDS}")
        rotary = RotaryEmbedding(config.head_dim, max_position, rope_parameters(config))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config, i, rotary) for i in range(len(config.layer_types)))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, meta)
        return self.norm(x)


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    static_decode = True  # a decode step's state slots are device tensors (AttentionMetadata.decode_states)
    packed_modules = {
        **LlamaForCausalLM.packed_modules,
        "in_proj_qkv": ("in_proj", 0),
        "in_proj_z": ("in_proj", 1),
        "in_proj_b": ("in_proj", 2),
        "in_proj_a": ("in_proj", 3),
    }

    def __init__(self, config, max_position: int, tp: TPGroup = SINGLE):
        nn.Module.__init__(self)
        if tp.size > 1:
            raise ValueError("Qwen3.5 does not work with tensor_parallel_size > 1 yet; use one device")
        self.model = Qwen3_5Model(config, max_position)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def norm_projections(self) -> list:
        return []  # its norms are zero-centred, not the fused kernel's

    def checkpoint_name(self, name: str) -> str | None:
        """The depthwise convolution's weight is a parameter of the layer here, not a Conv1d module's. The
        multi-token-prediction head (`mtp.*`) is not the model's: engine/models/qwen3_5_mtp.py loads it."""
        if name.startswith(MTP_PREFIX):
            return None
        return name.replace(".linear_attn.conv1d.weight", ".linear_attn.conv1d_weight")


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE and Qwen3.6-35B-A3B: Qwen3.5's layers with experts and a shared expert in each."""

    static_decode = False  # the experts' loop is decided on the host (engine/layers/fused_moe.py)


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    """Qwen3-Next: Qwen3.5-MoE's network, its checkpoints holding each linear layer's projections fused per key
    head: in_proj_qkvz (each key head's q, k, then its value heads' v and z rows) and in_proj_ba (its value heads'
    b, then a rows). They are split into Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a as they load."""

    def __init__(self, config, max_position: int, tp: TPGroup = SINGLE):
        super().__init__(config, max_position, tp)
        self.key_heads, self.k_dim = config.linear_num_key_heads, config.linear_key_head_dim
        self.per_key = config.linear_num_value_heads // config.linear_num_key_heads
        self.v_dim = config.linear_value_head_dim

    def checkpoint_tensors(self, name: str, tensor) -> list[tuple[str, object]]:
        """Split by rows, so that a GGUF file's quantized tensors (QuantizedWeight) split as torch tensors do."""
        stem = name.removesuffix("in_proj_qkvz.weight").removesuffix("in_proj_ba.weight")
        if stem == name:
            return [(name, tensor)]
        take = (lambda rows: tensor[rows]) if isinstance(tensor, torch.Tensor) else tensor.take
        if name.endswith("in_proj_ba.weight"):
            b, a = self._rows([self.per_key, self.per_key])
            return [(f"{stem}in_proj_b.weight", take(b)), (f"{stem}in_proj_a.weight", take(a))]
        values = self.per_key * self.v_dim
        q, k, v, z = self._rows([self.k_dim, self.k_dim, values, values])
        return [(f"{stem}in_proj_qkv.weight", take(torch.cat((q, k, v)))), (f"{stem}in_proj_z.weight", take(z))]

    def _rows(self, sizes: list[int]) -> list[torch.Tensor]:
        """For rows fused per key head as parts of `sizes`: each part's row indices, from every key head in order."""
        heads = torch.arange(self.key_heads)[:, None] * sum(sizes)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [
            (heads + start + torch.arange(size)[None, :]).flatten() for start, size in zip(starts, sizes, strict=True)
        ]


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    RENAMES = Gemma3ForConditionalGeneration.RENAMES
    VISION = ("model.visual.", "visual.")

    def checkpoint_name(self, name: str) -> str | None:
        name = Gemma3ForConditionalGeneration.checkpoint_name(self, name)
        return None if name is None else super().checkpoint_name(name)


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The language model of a Qwen3.5 checkpoint that also holds a vision tower."""

    RENAMES = Gemma3ForConditionalGeneration.RENAMES
    VISION = ("model.visual.", "visual.")

    def checkpoint_name(self, name: str) -> str | None:
        name = Gemma3ForConditionalGeneration.checkpoint_name(self, name)
        return None if name is None else super().checkpoint_name(name)
