"""gpt-oss: Llama's decoder with biased projections, attention sinks (a learned logit per head that joins each
softmax's denominator, so a head may attend to nothing), layers alternating between a 128-token sliding window and
full attention, YaRN rotary, and a mixture of experts in every layer whose MLPs carry biases and a clamped SwiGLU.

OpenAI's checkpoints hold the experts in MXFP4 (the config's quantization_config says so), and so do llama.cpp's
GGUF files of it: they stay so in memory, in GGUF's layout, and the CPU kernel reads them as stored
(engine/quantization/mxfp4.py, kquant.cpp). Checkpoints with full-precision experts load too.
"""

import torch
from torch import nn

from engine.layers.fused_moe import Experts, Routing, TopKRouter, run_experts
from engine.layers.layernorm import RMSNorm
from engine.models.llama import LlamaForCausalLM, ModelFlags
from engine.quantization.layout import QuantizedWeight
from engine.quantization.modules import KernelTarget
from engine.quantization.moe import QuantizedFusedMoE
from engine.quantization.mxfp4 import GGML_BLOCK_BYTES, GROUP, checkpoint_reads_mxfp4, ggml_blocks, ggml_weight
from engine.runner.distributed import SINGLE, TPGroup


class GptOssExperts(Experts):
    """The experts of one layer, stacked as the checkpoint holds them: gate_up_proj [experts, hidden, 2 *
    intermediate] with gate and up interleaved column by column, down_proj [experts, intermediate, hidden], and
    a bias for each."""

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        if tp.size > 1:
            raise ValueError("mixture-of-experts models do not work with tensor_parallel_size > 1 yet; use one device")
        experts, hidden, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.config, self.num_experts = config, experts
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
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
        hidden = clamped_swiglu(gate_up[..., ::2], gate_up[..., 1::2], self.alpha, self.limit)
        return hidden @ down_proj + self.down_proj_bias[expert]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return run_experts(x, weights, ids, self.num_experts, self.expert_mlp)

    def quantized(self, target: KernelTarget) -> "GptOssQuantizedExperts":
        """This layer for weights that arrive quantized (a GGUF file's)."""
        return GptOssQuantizedExperts(self.config, SINGLE, target)

    def extra_repr(self) -> str:
        e, h, i = self.gate_up_proj.shape[0], self.gate_up_proj.shape[1], self.down_proj.shape[1]
        return f"experts={e}, hidden={h}, intermediate={i}, swiglu_limit={self.limit}"


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation: both halves clamped (gate from above only), then SwiGLU with sigmoid(alpha * gate) and
    up shifted by 1."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


class GptOssQuantizedExperts(QuantizedFusedMoE):
    """The experts with weights kept as stored: OpenAI's MXFP4 (`*_blocks`, `*_scales`, repacked losslessly into
    GGUF's MXFP4 layout as they load) or a GGUF file's stacked ffn_*_exps, each expert multiplied by the kernel the
    chooser measured (on the CPU, kquant.cpp reads MXFP4 as stored); biases and the clamped SwiGLU as
    GptOssExperts has them."""

    MXFP4_PARTS = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")

    def __init__(self, config, tp: TPGroup, target: KernelTarget):
        if tp.size > 1:
            raise ValueError("mixture-of-experts models do not work with tensor_parallel_size > 1 yet; use one device")
        hidden, inter = config.hidden_size, config.intermediate_size
        if hidden % GROUP or inter % GROUP:
            raise ValueError(f"MXFP4 experts need hidden and intermediate sizes divisible by {GROUP}")
        super().__init__(config.num_local_experts, hidden, inter, target, bias=True)
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.arriving: dict[str, torch.Tensor] = {}  # a checkpoint's MXFP4 blocks until their scales come, or back

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(gate, up, self.alpha, self.limit)

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor | QuantizedWeight) -> list[str]:
        if name == "gate_up_proj_bias":  # gate and up interleaved column by column, as in the blocks' rows
            return super().load_checkpoint_tensor("gate_proj.bias", tensor[..., 0::2]) + super().load_checkpoint_tensor(
                "up_proj.bias", tensor[..., 1::2]
            )
        if name == "down_proj_bias":
            return super().load_checkpoint_tensor("down_proj.bias", tensor)
        if name not in self.MXFP4_PARTS:
            return super().load_checkpoint_tensor(name, tensor)
        projection, part = name.rsplit("_", 1)
        rows = 2 * self.intermediate_size if projection == "gate_up_proj" else self.hidden_size
        cols = self.hidden_size if projection == "gate_up_proj" else self.intermediate_size
        shape = (self.num_experts, rows, cols // GROUP) + ((GROUP // 2,) if part == "blocks" else ())
        if tensor.dtype != torch.uint8:
            raise ValueError(f"is {tensor.dtype}; MXFP4 blocks and scales are uint8")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"has shape {tuple(tensor.shape)}, the model expects {shape}")
        self.arriving[name] = tensor
        other = f"{projection}_{'scales' if part == 'blocks' else 'blocks'}"
        if other not in self.arriving:
            return []
        blocks, scales = self.arriving.pop(f"{projection}_blocks"), self.arriving.pop(f"{projection}_scales")
        # One expert at a time, so that repacking holds a few MB beside the checkpoint's tensor. gate_up's rows
        # interleave gate and up (even rows gate): each half gets its own stacked tensor, as a GGUF file keeps them.
        halves = ("down_proj",) if projection == "down_proj" else ("gate_proj", "up_proj")
        row_bytes = cols // GROUP * GGML_BLOCK_BYTES
        stored = [torch.empty(self.num_experts, rows // len(halves), row_bytes, dtype=torch.uint8) for _ in halves]
        for expert in range(self.num_experts):
            for index, half in enumerate(stored):
                rows_of_half = slice(index, None, len(halves))
                ggml_blocks(blocks[expert, rows_of_half], scales[expert, rows_of_half], out=half[expert])
        for half, tensor_of_half in zip(halves, stored):
            super().load_checkpoint_tensor(f"{half}.weight", ggml_weight(tensor_of_half.flatten(0, 1), cols))
        return []

    def missing(self) -> list[str]:
        """The MXFP4 parts whose counterpart never came (blocks without scales, or back), or the projections."""
        if self.arriving:
            other = {"blocks": "scales", "scales": "blocks"}
            return sorted(f"{name.rsplit('_', 1)[0]}_{other[name.rsplit('_', 1)[1]]}" for name in self.arriving)
        return super().missing()

    def extra_repr(self) -> str:
        return super().extra_repr() + f", swiglu_limit={self.limit}"


class GptOssMoeBlock(nn.Module):
    """The router (biased; softmax over each token's top-k logits) and the experts, called as a DecoderMLP is."""

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        # Softmax over all experts then renormalised over the top k: the softmax of the top-k logits
        routing = Routing(config.num_local_experts, config.num_experts_per_tok, "softmax", renormalize=True)
        self.router = TopKRouter(config.hidden_size, routing, bias=True)
        if checkpoint_reads_mxfp4(config):  # kept as stored, its kernels built as it loads on this device
            target = KernelTarget(torch.empty(0).device, torch.get_default_dtype(), onednn=False)
            self.experts = GptOssQuantizedExperts(config, tp, target)
        else:
            self.experts = GptOssExperts(config, tp)

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
        """The sinks live in the attention layer the projections feed (self_attn.attn); a GGUF file names them as a
        weight (attn_sinks.weight)."""
        if name.endswith(".self_attn.sinks.weight"):
            name = name.removesuffix(".weight")
        return name.replace(".self_attn.sinks", ".self_attn.attn.sinks")
