"""A mixture of experts' weights as a GGUF file stores them: each projection's experts stacked in one quantized
[experts * rows, columns] tensor (llama.cpp's ffn_gate_exps, ffn_up_exps, ffn_down_exps), kept in the file's blocks
or codes. Each expert multiplies through a kernel over its own rows, a view of the stacked tensor (for the K-quants,
kquant.py's kernel reads the blocks in place), so the experts take their file size in memory.

The kernel is chosen once per projection, on expert 0, by the chooser's measurement; every expert of that
projection then gets the same kind (they share a shape and a type). Families whose experts carry biases or another
activation (gpt-oss) subclass it and override `activate`.

Decode steps of a SwiGLU layer whose experts are K-quant blocks take kquant.cpp's one-call layer (kquant_moe): the
rows of every chosen expert in one parallel pass, not 3 kernel calls and a score of small ops an expert, which
cost more than the weights' reading (bench/RESULTS.md, Qwen3-30B-A3B's shapes). Its output is checked against the
expert-by-expert one at load.
"""

import logging

import torch
from torch import nn

from engine.layers.activation import silu_and_mul
from engine.layers.fused_moe import run_experts
from engine.quantization import chooser, kquant
from engine.quantization.blocks import BlockWeight
from engine.quantization.kernels import QuantizedMatmul
from engine.quantization.kquant import KQuantMatmul
from engine.quantization.layout import QuantizedWeight
from engine.quantization.modules import KernelTarget

log = logging.getLogger("engine")

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# kquant.cpp's one-call layer (kquant_moe): the K-quant kinds it reads, and the tokens a call serves (decode steps and
# small batches; prefill goes expert by expert, where the kernels' dequantized tiles serve many rows)
FUSED_KINDS = ("Q4_K", "Q5_K", "Q6_K")
FUSED_MAX_TOKENS = 16
FUSED_CHECK_EXPERTS = 4


class QuantizedFusedMoE(nn.Module):
    """engine/layers/fused_moe.py's FusedMoE, for weights that arrive quantized: forward(x, weights, ids) alike."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, target: KernelTarget, bias: bool = False
    ):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.target, self.bias = target, bias
        self.pending: dict[str, QuantizedWeight] = {}
        self.kernels = nn.ModuleDict()  # projection -> a ModuleList of one kernel per expert
        self.stacked: dict[str, torch.Tensor] | None = None  # each projection's blocks, where the one-call layer serves
        if bias:  # one per expert and output row: gate_proj_bias [experts, intermediate], ...
            for projection in PROJECTIONS:
                setattr(self, f"{projection}_bias", nn.Parameter(torch.empty(num_experts, self._shape(projection)[0])))

    def _shape(self, projection: str) -> tuple[int, int]:
        """(rows, columns) of one expert's matrix."""
        if projection == "down_proj":
            return self.hidden_size, self.intermediate_size
        return self.intermediate_size, self.hidden_size

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor | QuantizedWeight) -> list[str]:
        projection, _, kind = name.rpartition(".")
        if projection not in PROJECTIONS or kind not in ("weight", "bias") or (kind == "bias" and not self.bias):
            raise ValueError(f"is not a stacked expert weight this layer knows ({', '.join(PROJECTIONS)})")
        rows, cols = self._shape(projection)
        if kind == "bias":
            bias = getattr(self, f"{projection}_bias")
            if isinstance(tensor, QuantizedWeight):
                raise ValueError(f"is stored as {tensor.source}; the experts' biases are read at full precision")
            if tuple(tensor.shape) != tuple(bias.shape):
                raise ValueError(f"has shape {tuple(tensor.shape)}, the model expects {tuple(bias.shape)}")
            bias.data.copy_(tensor)
            return [f"{projection}_bias"]
        if not isinstance(tensor, QuantizedWeight):  # an F16/F32 tensor of a GGUF file: [experts, rows, cols]
            raise ValueError("arrives at full precision; quantized experts take GGUF block types only")
        if tuple(tensor.shape) != (self.num_experts * rows, cols):
            raise ValueError(
                f"has shape {tuple(tensor.shape)}, the model expects {self.num_experts} experts of {(rows, cols)}"
            )
        self.pending[projection] = tensor.to(self.target.device)
        if len(self.pending) == len(PROJECTIONS):
            self._build()
        return []

    def _build(self) -> None:
        fused = self._fused_applies()
        for projection, stacked in self.pending.items():
            rows = self._shape(projection)[0]
            if fused:  # prefill's kernels: K-quant views too, taking dequantized tiles from the rows measured
                first = KQuantMatmul(stacked.rows(0, rows), self.target.dtype)
                first.dense_from_rows = chooser.choose_prefill_rows(first, self.target.dtype)
            else:
                first = chooser.choose_matmul(stacked.rows(0, rows), self.target.device, self.target.dtype)
            kernels = [first]
            for expert in range(1, self.num_experts):
                kernel = type(first)(stacked.rows(expert * rows, rows), self.target.dtype)
                if isinstance(kernel, QuantizedMatmul):
                    kernel.dense_from_rows = first.dense_from_rows
                kernels.append(kernel)
            self.kernels[projection] = nn.ModuleList(kernels)
        if fused:  # the experts' kernels view these blocks: no second copy
            self.stacked = {p: self.pending[p].blocks for p in PROJECTIONS}
            self._check_fused()
        self.pending = {}

    def _fused_applies(self) -> bool:
        """Whether kquant.cpp's one-call layer serves this layer's decode steps: SwiGLU experts without biases, all
        three projections K-quant blocks it reads, on the CPU (measured: bench/RESULTS.md, 2026-12-03)."""
        return (
            not self.bias
            and type(self).activate is QuantizedFusedMoE.activate
            and self.target.device.type == "cpu"
            and all(
                isinstance(w, BlockWeight)
                and w.source in FUSED_KINDS
                and KQuantMatmul.__name__ in chooser.candidates(w, self.target.device, self.target.dtype)
                for w in self.pending.values()
            )
        )

    def _check_fused(self) -> None:
        """The one-call layer must agree with the expert-by-expert one (which the chooser's checks stand behind)
        on tokens routed to the first experts, or it is not used."""
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, self.hidden_size, generator=g)
        ids = torch.arange(2 * FUSED_CHECK_EXPERTS).view(2, -1) % self.num_experts
        weights = torch.rand(ids.shape, generator=g)
        expected = self._by_expert(x, weights, ids)
        error = (self._fused(x, weights, ids) - expected).abs().max().item()
        if error > 0.02 * expected.abs().max().item() + 1e-3:
            log.warning("the one-call MoE kernel is off by %.3g on a check; its layers run expert by expert", error)
            self.stacked = None

    def _fused(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        kinds = [kquant.KINDS[self.kernels[p][0].source] for p in PROJECTIONS]
        ops = self.kernels["gate_proj"][0].ops
        return ops.kquant_moe(
            x.float().contiguous(), ids.long(), weights.float(), *self.stacked.values(), *kinds, self.num_experts
        ).to(x.dtype)

    def missing(self) -> list[str]:
        """The stacked tensors the checkpoint has not given yet."""
        return [p for p in PROJECTIONS if p not in self.kernels and p not in self.pending]

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The experts' gated activation: SwiGLU, silu(gate) * up."""
        return silu_and_mul(torch.cat((gate, up), dim=-1))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.stacked is not None and x.shape[0] <= FUSED_MAX_TOKENS:
            return self._fused(x, weights, ids)
        return self._by_expert(x, weights, ids)

    def _by_expert(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        gate, up, down = (self.kernels[p] for p in PROJECTIONS)

        def expert_mlp(expert: int, h: torch.Tensor) -> torch.Tensor:
            g, u = gate[expert](h), up[expert](h)
            if not self.bias:
                return down[expert](self.activate(g, u))
            g, u = g + self.gate_proj_bias[expert], u + self.up_proj_bias[expert]
            return down[expert](self.activate(g, u)) + self.down_proj_bias[expert]

        return run_experts(x, weights, ids, self.num_experts, expert_mlp)

    def extra_repr(self) -> str:
        kinds = ", ".join(f"{p}: {type(self.kernels[p][0]).__name__}" for p in PROJECTIONS if p in self.kernels)
        return f"experts={self.num_experts}, {kinds}"
