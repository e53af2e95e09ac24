"""Gemma 4 (text): Gemma 3's sliding and global layers, with what Gemma 4 adds, each where its config sets it:

- global layers with heads of their own size (`global_head_dim`) and KV heads (`num_global_key_value_heads`), and
  with `attention_k_eq_v` keys that serve as values too (no v_proj); proportional RoPE over a quarter of each
  global head;
- q, k and v each normalised per head (v without a weight); attention unscaled (the norms set the scale);
- the last `num_kv_shared_layers` layers compute no keys or values: each attends over the cache of the last
  earlier layer of its kind (`Attention.kv_source`), and may have an MLP twice as wide (`use_double_wide_mlp`);
- per-layer inputs (the E2B/E4B models): a second embedding table gives every token a small vector per layer,
  mixed with a projection of the token's embedding, and gated into each layer's output;
- a mixture of experts beside the dense MLP (26B-A4B), its router normalising and scaling its own input;
- a learned scalar on each layer's output; RMSNorm weights used as they are (Gemma 3's were offsets from 1).

Hub checkpoints are Gemma4ForConditionalGeneration (vision and audio towers beside the language model): the engine
serves the language model and does not read the towers (images and audio are not supported yet).
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata
from engine.layers.attention import Attention
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.layers.fused_moe import FusedMoE
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.layers.rotary_embedding import RotaryEmbedding
from engine.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration, layer_rope
from engine.models.llama import layer_windows
from engine.quantization.moe import QuantizedFusedMoE
from engine.runner.distributed import SINGLE, TPGroup


def gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def unscaled_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (Gemma 4's v and router norms), in float32."""
    return F.rms_norm(x.float(), x.shape[-1:], None, eps).type_as(x)


def kv_sources(config) -> list[int | None]:
    """Each layer's source of keys and values: None for a layer that computes its own, else the last layer of its
    kind before the shared ones (transformers' kv_sharing_modes)."""
    types, shared = getattr(config, "layer_types", None), getattr(config, "num_kv_shared_layers", 0) or 0
    first_shared = config.num_hidden_layers - shared
    if shared and first_shared < 1:
        raise ValueError(f"num_kv_shared_layers={shared} leaves no layer to compute keys and values")
    sources: list[int | None] = [None] * first_shared
    for i in range(first_shared, config.num_hidden_layers):
        owners = [j for j in range(first_shared) if types[j] == types[i]]
        if not owners:
            raise ValueError(f"layer {i} shares the KV cache of a {types[i]} layer, but none comes before it")
        sources.append(owners[-1])
    return sources


class Gemma4Attention(nn.Module):
    def __init__(self, config, index: int, rotary: RotaryEmbedding, window, source: Attention | None, tp: TPGroup):
        super().__init__()
        shape = config.per_layer_config[index]  # a global layer's heads differ from a sliding one's
        heads, kv_heads, self.head_dim = config.num_attention_heads, shape.num_key_value_heads, shape.head_dim
        bias, self.eps = bool(config.attention_bias), config.rms_norm_eps
        qkv = ColumnParallelLinear.qkv(config.hidden_size, self.head_dim, heads, kv_heads, tp, bias)
        self.keys_are_values = bool(getattr(config, "attention_k_eq_v", False)) and window is None
        projections = 1 if source is not None else 2 if self.keys_are_values else 3
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, qkv.slices[:projections], bias)
        self.split = self.qkv_proj.output_sizes
        self.num_heads, self.num_kv_heads = self.split[0] // self.head_dim, qkv.output_sizes[1] // self.head_dim
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, bias=bias, tp=tp)
        self.q_norm = RMSNorm(self.head_dim, self.eps)
        self.k_norm = RMSNorm(self.head_dim, self.eps) if source is None else None
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, 1.0, window, kv_source=source)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        parts = self.qkv_proj(x).split(self.split, dim=-1)
        q = parts[0].view(-1, self.num_heads, self.head_dim)
        if self.k_norm is None:  # a shared-KV layer: queries only
            q = self.rotary(positions, self.q_norm(q), self.num_heads)
            return self.o_proj(self.attn(q, None, None, meta).flatten(1))
        k = parts[1].view(-1, self.num_kv_heads, self.head_dim)
        v = unscaled_rms_norm(k if self.keys_are_values else parts[2].view_as(k), self.eps)
        qk = self.rotary(positions, torch.cat((q, k), dim=1), self.num_heads, self.q_norm, self.k_norm)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return self.o_proj(self.attn(q, k, v, meta).flatten(1))


class Gemma4MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear.split(hidden_size, [intermediate_size] * 2, tp, False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_and_mul(self.gate_up_proj(x)))


class Gemma4Router(nn.Module):
    """Softmax over the experts of the router's own normalised and scaled input, top k renormalised to sum to 1,
    then each chosen expert's weight scaled by its learned `per_expert_scale`. Weights stay float32."""

    def __init__(self, config):
        super().__init__()
        self.top_k, self.eps, self.root = config.top_k_experts, config.rms_norm_eps, config.hidden_size**-0.5
        self.proj = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = unscaled_rms_norm(x, self.eps) * self.scale * self.root
        weights, ids = torch.topk(self.proj(h).softmax(dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4Experts(FusedMoE):
    act = staticmethod(gelu_and_mul)

    def quantized(self, target) -> nn.Module:
        return Gemma4QuantizedExperts(self.num_experts, self.hidden_size, self.intermediate_size, target)


class Gemma4QuantizedExperts(QuantizedFusedMoE):
    """The experts as a GGUF file keeps them, gate and up in one stacked tensor (llama.cpp's ffn_gate_up_exps: each
    expert's gate rows, then its up rows) or apart."""

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh") * up

    def load_checkpoint_tensor(self, name: str, tensor) -> list[str]:
        if name != "gate_up_proj.weight":
            return super().load_checkpoint_tensor(name, tensor)
        rows = self.intermediate_size
        if tensor.shape[0] != 2 * self.num_experts * rows:
            raise ValueError(f"has {tensor.shape[0]} rows, the model expects {self.num_experts} experts of 2 x {rows}")
        order = torch.arange(tensor.shape[0]).view(self.num_experts, 2, rows)
        for shard, projection in enumerate(("gate_proj", "up_proj")):
            part = order[:, shard].reshape(-1)
            super().load_checkpoint_tensor(
                f"{projection}.weight", tensor[part] if torch.is_tensor(tensor) else tensor.take(part)
            )
        return []


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config, index: int, rotary: RotaryEmbedding, window, source: Attention | None, tp: TPGroup):
        super().__init__()
        self.self_attn = Gemma4Attention(config, index, rotary, window, source, tp)
        wide = source is not None and bool(getattr(config, "use_double_wide_mlp", False))
        self.mlp = Gemma4MLP(config.hidden_size, config.intermediate_size * (2 if wide else 1), tp)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        norms = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm"]
        norms += ["post_feedforward_layernorm"]
        self.router = self.experts = None
        if getattr(config, "enable_moe_block", False):
            if tp.size > 1:
                raise ValueError(
                    "mixture-of-experts models do not work with tensor_parallel_size > 1 yet; use one device"
                )
            self.router = Gemma4Router(config)
            self.experts = Gemma4Experts(config.num_experts, hidden, config.moe_intermediate_size)
            norms += ["post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2"]
        self.per_layer_size = getattr(config, "hidden_size_per_layer_input", 0) or 0
        if self.per_layer_size:  # small and replicated on every rank
            self.per_layer_input_gate = ColumnParallelLinear.split(hidden, [self.per_layer_size], SINGLE)
            self.per_layer_projection = ColumnParallelLinear.split(self.per_layer_size, [hidden], SINGLE)
            norms.append("post_per_layer_input_norm")
        for name in norms:
            setattr(self, name, RMSNorm(hidden, eps))
        self.layer_scalar = nn.Parameter(torch.ones(1))

    def forward(self, positions, x: torch.Tensor, per_layer_input, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), meta))
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.experts is not None:  # the experts read the layer's input to the MLP, not the MLP's output
            weights, ids = self.router(x)
            routed = self.experts(self.pre_feedforward_layernorm_2(x), weights, ids)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(h)
        if self.per_layer_size:
            gated = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, config, max_position: int, tp: TPGroup):
        super().__init__()
        if config.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(f"Gemma 4's activation {config.hidden_activation!r} is not supported")
        if getattr(config, "use_bidirectional_attention", None) == "all":
            raise ValueError(
                "this Gemma 4 config attends both ways (use_bidirectional_attention='all'): not a chat model"
            )
        windows, sources = layer_windows(config), kv_sources(config)
        rotaries = {
            kind: RotaryEmbedding(config.per_layer_config[kind].head_dim, max_position, layer_rope(config, kind))
            for kind in set(config.layer_types)
        }
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList()
        for i, kind in enumerate(config.layer_types):
            source = None if sources[i] is None else self.layers[sources[i]].self_attn.attn
            self.layers.append(Gemma4DecoderLayer(config, i, rotaries[kind], windows[i], source, tp))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.per_layer_size = getattr(config, "hidden_size_per_layer_input", 0) or 0
        if self.per_layer_size:
            width = config.num_hidden_layers * self.per_layer_size
            self.embed_tokens_per_layer = VocabParallelEmbedding(config.vocab_size_per_layer_input, width, tp)
            self.per_layer_model_projection = ColumnParallelLinear.split(config.hidden_size, [width], SINGLE)
            self.per_layer_projection_norm = RMSNorm(self.per_layer_size, config.rms_norm_eps)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[tokens, layers, per-layer size]: each token's own vector per layer (its second embedding), mixed with
        a projection of its embedding `x`."""
        shape = (x.shape[0], len(self.layers), self.per_layer_size)
        own = self.embed_tokens_per_layer(input_ids)
        own = (own * torch.tensor(self.per_layer_size**0.5, dtype=own.dtype)).view(shape)
        mixed = self.per_layer_projection_norm((self.per_layer_model_projection(x) * x.shape[-1] ** -0.5).view(shape))
        return (mixed + own) * 2**-0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # the scale rounded to the weights' dtype first
        per_layer = self.per_layer_inputs(input_ids, x) if self.per_layer_size else None
        for i, layer in enumerate(self.layers):
            x = layer(positions, x, None if per_layer is None else per_layer[:, i], meta)
        return self.norm(x)


class Gemma4ForCausalLM(Gemma3ForCausalLM):
    def __init__(self, config, max_position: int, tp: TPGroup = SINGLE):
        nn.Module.__init__(self)
        self.model = Gemma4Model(config, max_position, tp)
        self.static_decode = not getattr(config, "enable_moe_block", False)  # the experts' loop runs on the host
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_softcap = getattr(config, "final_logit_softcapping", None)


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """The language model of a Gemma 4 checkpoint that also holds vision and audio towers."""

    RENAMES = Gemma3ForConditionalGeneration.RENAMES
    VISION = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")
    checkpoint_name = Gemma3ForConditionalGeneration.checkpoint_name
