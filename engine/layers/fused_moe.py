"""Mixture of experts: a router picks each token's top-k experts, whose gated MLPs run on that token and are
summed by the router's weights. Experts are stacked tensors, [experts, 2 * intermediate, hidden] for gate and up
and [experts, hidden, intermediate] for down, as transformers 5 holds them.

On the CPU the step runs expert by expert over the tokens routed to each (tokens grouped by expert), so each
expert's weights are read once per step however many tokens chose it, and experts no token chose are not read at
all. That loop is decided on the host, from the routing, so steps with MoE layers run eagerly (no compiled CPU
decode step). On a GPU, two grouped Triton matmuls over the pairs sorted by expert do the same from device
tensors alone (engine/layers/fused_moe_triton.py).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.activation import silu_and_mul
from engine.quantization.layout import QuantizedWeight
from engine.runner.distributed import SINGLE, TPGroup

SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Routing:
    """How a family's router turns its logits into each token's experts and their weights."""

    num_experts: int
    top_k: int
    scoring: str = "softmax"  # softmax over all experts, or an independent sigmoid per expert
    renormalize: bool = False  # rescale the top-k weights to sum to 1

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"router scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"experts per token must be in 1..{self.num_experts}, got {self.top_k}")


class TopKRouter(nn.Module):
    """Router logits x W^T (+ b with `bias`, gpt-oss), scored and cut to the top k. Computed in float32, as
    transformers does, and the weights handed back in the activations' dtype."""

    def __init__(self, hidden_size: int, routing: Routing, bias: bool = False):
        super().__init__()
        self.routing = routing
        self.weight = nn.Parameter(torch.empty(routing.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(routing.num_experts)) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, k] in x's dtype, expert ids [tokens, k])."""
        logits = F.linear(x, self.weight, self.bias)
        if self.routing.scoring == "softmax":
            scores = logits.softmax(dim=-1, dtype=torch.float32)
        else:
            scores = logits.float().sigmoid()
        weights, ids = torch.topk(scores, self.routing.top_k, dim=-1)
        if self.routing.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def extra_repr(self) -> str:
        r = self.routing
        return f"experts={r.num_experts}, top_k={r.top_k}, {r.scoring}" + (", renormalized" if r.renormalize else "")


def run_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    num_experts: int,
    expert_mlp: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """sum_k weights[:, k] * expert_mlp(ids[:, k], x), expert by expert over the tokens routed to each (in expert
    order, as transformers adds them up)."""
    out = torch.zeros_like(x)
    # Token-expert pairs sorted by expert: each expert's tokens are then one slice, found with one sync.
    order = ids.flatten().argsort(stable=True)
    counts = torch.bincount(ids.flatten(), minlength=num_experts).tolist()
    tokens, slots = order // ids.shape[1], order % ids.shape[1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows, k = tokens[start : start + count], slots[start : start + count]
        start += count
        y = expert_mlp(expert, x[rows]) * weights[rows, k, None]
        out.index_add_(0, rows, y.to(out.dtype))
    return out


class Experts(nn.Module):
    """What every family's experts module is (FusedMoE, gpt-oss's): passes that do not cover experts yet (weight
    quantization) look for it."""

    def quantized(self, target) -> nn.Module:
        """This layer for weights that arrive quantized (a GGUF file's), its kernels built for `target` (a
        quantization.KernelTarget) as they load."""
        raise NotImplementedError(f"{type(self).__name__} cannot take quantized weights")


class FusedMoE(Experts):
    """The experts of one layer. `forward(x, weights, ids)` is sum_k weights[:, k] * expert_{ids[:, k]}(x)."""

    # gate_up's output [.., 2 * intermediate] -> the activation down_proj takes: SwiGLU here; a family with another
    # gated activation (Gemma 4's GELU) subclasses this and sets its own
    act = staticmethod(silu_and_mul)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TPGroup = SINGLE):
        super().__init__()
        if tp.size > 1:
            raise ValueError("mixture-of-experts models do not work with tensor_parallel_size > 1 yet; use one device")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self._loaded_parts: set[tuple[str, int, int]] = set()  # (parameter, expert, shard) from per-expert tensors

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from engine.layers.fused_moe_triton import fused_moe  # Triton: imported where a GPU runs it

            return fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids, self.act)

        def expert_mlp(expert: int, h: torch.Tensor) -> torch.Tensor:
            return F.linear(self.act(F.linear(h, self.gate_up_proj[expert])), self.down_proj[expert])

        return run_experts(x, weights, ids, self.num_experts, expert_mlp)

    def quantized(self, target) -> nn.Module:
        from engine.quantization.moe import QuantizedFusedMoE  # quantization builds on these layers, not back

        return QuantizedFusedMoE(self.num_experts, self.hidden_size, self.intermediate_size, target)

    # ---- loading ----------------------------------------------------------------------------------------
    _PER_EXPERT = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor | QuantizedWeight) -> list[str]:
        """Take one checkpoint tensor named relative to this module: stacked as transformers 5 holds them
        (`gate_up_proj`, `down_proj`), or one expert's as the hub's checkpoints store them
        (`3.gate_proj.weight`). Returns the parameters now complete."""
        if isinstance(tensor, QuantizedWeight):
            raise ValueError(f"is quantized ({tensor.source}); these experts take full-precision weights only")
        if name in ("gate_up_proj", "down_proj"):
            param = getattr(self, name)
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}")
            param.data.copy_(tensor)
            return [name]
        expert, _, rest = name.partition(".")
        part, _, suffix = rest.partition(".")
        if not expert.isdigit() or part not in self._PER_EXPERT or suffix != "weight":
            raise ValueError("is not an expert weight this layer knows (gate_proj, up_proj, down_proj)")
        index = int(expert)
        if index >= self.num_experts:
            raise ValueError(f"names expert {index}, but the layer has {self.num_experts}")
        target, shard = self._PER_EXPERT[part]
        param = getattr(self, target)
        rows = self.intermediate_size if target == "gate_up_proj" else param.shape[1]
        view = param.data[index, shard * rows : (shard + 1) * rows]
        if tuple(tensor.shape) != tuple(view.shape):
            raise ValueError(f"has shape {tuple(tensor.shape)}, the model expects {tuple(view.shape)}")
        view.copy_(tensor)
        self._loaded_parts.add((target, index, shard))
        shards = 2 if target == "gate_up_proj" else 1
        done = sum(1 for t, _, _ in self._loaded_parts if t == target) == self.num_experts * shards
        return [target] if done else []

    def extra_repr(self) -> str:
        e, h, i = self.num_experts, self.down_proj.shape[1], self.intermediate_size
        return f"experts={e}, hidden={h}, intermediate={i}"
