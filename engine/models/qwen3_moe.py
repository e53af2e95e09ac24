"""Qwen3-MoE: Qwen3's attention, and a mixture of experts in place of the MLP on the layers the config says
(every `decoder_sparse_step`-th, except those listed in `mlp_only_layers`, which keep a dense MLP)."""

import torch
from torch import nn

from engine.layers.fused_moe import FusedMoE, Routing, TopKRouter
from engine.layers.layernorm import RMSNorm
from engine.models.llama import DecoderMLP, ModelFlags
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.runner.distributed import TPGroup


class SparseMoeBlock(nn.Module):
    """The router (`gate`) and the experts, called as a DecoderMLP is: mlp(x, residual, norm)."""

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        routing = Routing(config.num_experts, config.num_experts_per_tok, "softmax", bool(config.norm_topk_prob))
        self.gate = TopKRouter(config.hidden_size, routing)
        self.experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = norm(x, residual)
        weights, ids = self.gate(h)
        return self.experts(h, weights, ids), residual


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    static_decode = False  # the experts' loop is decided on the host (engine/layers/fused_moe.py)

    def make_mlp(self, config, layer_index: int, flags: ModelFlags, tp: TPGroup) -> nn.Module:
        sparse = (
            layer_index not in (config.mlp_only_layers or [])
            and config.num_experts > 0
            and (layer_index + 1) % config.decoder_sparse_step == 0
        )
        return SparseMoeBlock(config, tp) if sparse else DecoderMLP(config, flags.mlp_bias, tp)
