"""Linear layers that pack several checkpoint matrices into one GEMM (q/k/v, gate/up)."""
import torch
from torch import nn


class MergedLinear(nn.Linear):
    """One matmul whose output is the concatenation of several checkpoint projections."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        start = sum(self.output_sizes[:shard])
        size = self.output_sizes[shard]
        if loaded.shape[0] != size:
            raise ValueError(f"shard {shard} has {loaded.shape[0]} rows in the checkpoint, expected {size}")
        param.data[start : start + size].copy_(loaded)
