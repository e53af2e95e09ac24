"""gpt-oss: Llama's decoder with biased projections, attention sinks (a learned logit per head that joins each
softmax's denominator, so a head may attend to nothing), layers alternating between a 128-token sliding window and
full attention, YaRN rotary, and a mixture of experts in every layer whose MLPs carry biases and a clamped SwiGLU.

OpenAI's checkpoints hold the experts in MXFP4, which the loader refuses for now (the config's quantization_config
says so); checkpoints with full-precision experts load.
"""

import torch
from torch import nn

from engine.layers.fused_moe import Experts, Routing, TopKRouter, run_experts
from engine.layers.layernorm import RMSNorm
from engine.models.llama import LlamaForCausalLM, ModelFlags
from engine.runner.distributed import TPGroup


class GptOssExperts(Experts):
    """The experts of one layer, stacked as the checkpoint holds them: gate_up_proj [experts, hidden, 2 *
    intermediate] with gate and up interleaved column by column, down_proj [experts, intermediate, hidden], and
    a bias for each."""

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        if tp.size > 1:
            raise ValueError("mixture-of-experts models do not work with tensor_parallel_size > 1 yet; use one device")
        experts, hidden, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.num_experts, self.alpha, self.limit = experts, config.swiglu_alpha, config.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(experts, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))

    def expert_mlp(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        gate_up = h @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]
        # Both halves clamped (gate from above only), then SwiGLU with sigmoid(alpha * gate) and up shifted by 1
        gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
        hidden = (up + 1) * gate * torch.sigmoid(gate * self.alpha)
        return hidden @ self.down_proj[expert] + self.down_proj_bias[expert]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return run_experts(x, weights, ids, self.num_experts, self.expert_mlp)

    def extra_repr(self) -> str:
        e, h, i = self.gate_up_proj.shape[0], self.gate_up_proj.shape[1], self.down_proj.shape[1]
        return f"experts={e}, hidden={h}, intermediate={i}, swiglu_limit={self.limit}"


class GptOssMoeBlock(nn.Module):
    """The router (biased; softmax over each token's top-k logits) and the experts, called as a DecoderMLP is."""

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        # Softmax over all experts then renormalised over the top k: the softmax of the top-k logits
        routing = Routing(config.num_local_experts, config.num_experts_per_tok, "softmax", renormalize=True)
        self.router = TopKRouter(config.hidden_size, routing, bias=True)
        self.experts = GptOssExperts(config, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = norm(x, residual)
        weights, ids = self.router(h)
        return self.experts(h, weights, ids), residual


class GptOssForCausalLM(LlamaForCausalLM):
    static_decode = False  # the experts' loop is decided on the host (engine/layers/fused_moe.py)

    @staticmethod
    def flags(config) -> ModelFlags:
        bias = bool(getattr(config, "attention_bias", True))
        return ModelFlags(qkv_bias=bias, o_bias=bias, qk_norm=False, mlp_bias=True, attention_sinks=True)

    def make_mlp(self, config, layer_index: int, flags: ModelFlags, tp: TPGroup) -> nn.Module:
        return GptOssMoeBlock(config, tp)

    def checkpoint_name(self, name: str) -> str:
        """The sinks live in the attention layer the projections feed (self_attn.attn)."""
        return name.replace(".self_attn.sinks", ".self_attn.attn.sinks")
