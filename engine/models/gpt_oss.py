"""gpt-oss: Llama's decoder with biased projections, attention sinks (a learned logit per head that joins each
softmax's denominator, so a head may attend to nothing), layers alternating between a 128-token sliding window and
full attention, YaRN rotary, and a mixture of experts in every layer whose MLPs carry biases and a clamped SwiGLU.

OpenAI's checkpoints hold the experts in MXFP4 (the config's quantization_config says so): they stay so in memory,
and each step widens only the experts it runs (engine/quantization/mxfp4.py). Checkpoints with full-precision
experts load too.
"""

import torch
from torch import nn

from engine.layers.fused_moe import Experts, Routing, TopKRouter, run_experts
from engine.layers.layernorm import RMSNorm
from engine.models.llama import LlamaForCausalLM, ModelFlags
from engine.quantization.mxfp4 import GROUP, checkpoint_reads_mxfp4, dequantize_mxfp4
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

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's gate_up [hidden, 2 * intermediate] and down [intermediate, hidden] matrices."""
        return self.gate_up_proj[expert], self.down_proj[expert]

    def expert_mlp(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        gate_up_proj, down_proj = self.expert_weights(expert)
        gate_up = h @ gate_up_proj + self.gate_up_proj_bias[expert]
        # Both halves clamped (gate from above only), then SwiGLU with sigmoid(alpha * gate) and up shifted by 1
        gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
        hidden = (up + 1) * gate * torch.sigmoid(gate * self.alpha)
        return hidden @ down_proj + self.down_proj_bias[expert]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return run_experts(x, weights, ids, self.num_experts, self.expert_mlp)

    def extra_repr(self) -> str:
        e, h, i = self.gate_up_proj.shape[0], self.gate_up_proj.shape[1], self.down_proj.shape[1]
        return f"experts={e}, hidden={h}, intermediate={i}, swiglu_limit={self.limit}"


class GptOssMXFP4Experts(GptOssExperts):
    """The experts as OpenAI ships them: MXFP4 blocks and scales (uint8, 4.25 bits a weight) in place of the two
    matrices, kept so; a step widens each expert it runs, one at a time, to the activations' dtype."""

    PARTS = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")

    def __init__(self, config, tp: TPGroup):
        nn.Module.__init__(self)
        if tp.size > 1:
            raise ValueError("mixture-of-experts models do not work with tensor_parallel_size > 1 yet; use one device")
        experts, hidden, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
        if hidden % GROUP or inter % GROUP:
            raise ValueError(f"MXFP4 experts need hidden and intermediate sizes divisible by {GROUP}")
        self.num_experts, self.alpha, self.limit = experts, config.swiglu_alpha, config.swiglu_limit
        shapes = {  # as transformers names them: rows (the output features), then groups of 32 inputs
            "gate_up_proj": (experts, 2 * inter, hidden // GROUP),
            "down_proj": (experts, hidden, inter // GROUP),
        }
        for name, shape in shapes.items():
            self.register_buffer(f"{name}_blocks", torch.zeros(*shape, GROUP // 2, dtype=torch.uint8))
            self.register_buffer(f"{name}_scales", torch.zeros(shape, dtype=torch.uint8))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))
        self._loaded: set[str] = set()

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.gate_up_proj_bias.dtype
        gate_up = dequantize_mxfp4(self.gate_up_proj_blocks[expert], self.gate_up_proj_scales[expert], dtype)
        down = dequantize_mxfp4(self.down_proj_blocks[expert], self.down_proj_scales[expert], dtype)
        return gate_up.T, down.T

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> list[str]:
        """The four MXFP4 tensors, copied as they are, and the two biases."""
        if name in self.PARTS:
            target = getattr(self, name)
            if tensor.dtype != torch.uint8:
                raise ValueError(f"is {tensor.dtype}; MXFP4 blocks and scales are uint8")
        elif name in ("gate_up_proj_bias", "down_proj_bias"):
            target = getattr(self, name).data
        else:
            raise ValueError(f"is not a part of MXFP4 experts ({', '.join(self.PARTS)}, and the biases)")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}")
        target.copy_(tensor)
        self._loaded.add(name)
        return [name] if name.endswith("_bias") else []

    def missing(self) -> list[str]:
        return [p for p in (*self.PARTS, "gate_up_proj_bias", "down_proj_bias") if p not in self._loaded]

    def extra_repr(self) -> str:
        e, rows = self.num_experts, self.gate_up_proj_blocks.shape[1]
        return f"experts={e}, hidden={self.down_proj_blocks.shape[1]}, intermediate={rows // 2}, mxfp4"


class GptOssMoeBlock(nn.Module):
    """The router (biased; softmax over each token's top-k logits) and the experts, called as a DecoderMLP is."""

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        # Softmax over all experts then renormalised over the top k: the softmax of the top-k logits
        routing = Routing(config.num_local_experts, config.num_experts_per_tok, "softmax", renormalize=True)
        self.router = TopKRouter(config.hidden_size, routing, bias=True)
        self.experts = (GptOssMXFP4Experts if checkpoint_reads_mxfp4(config) else GptOssExperts)(config, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = norm(x, residual)
        weights, ids = self.router(h)
        return self.experts(h, weights, ids), residual


class GptOssForCausalLM(LlamaForCausalLM):
    static_decode = False  # the experts' loop is decided on the host (engine/layers/fused_moe.py)
    checkpoint_quantizations = ("mxfp4",)  # quantization_config methods whose tensors it reads as they are

    @staticmethod
    def flags(config) -> ModelFlags:
        bias = bool(getattr(config, "attention_bias", True))
        return ModelFlags(qkv_bias=bias, o_bias=bias, qk_norm=False, mlp_bias=True, attention_sinks=True)

    def make_mlp(self, config, layer_index: int, flags: ModelFlags, tp: TPGroup) -> nn.Module:
        return GptOssMoeBlock(config, tp)

    def checkpoint_name(self, name: str) -> str:
        """The sinks live in the attention layer the projections feed (self_attn.attn)."""
        return name.replace(".self_attn.sinks", ".self_attn.attn.sinks")
