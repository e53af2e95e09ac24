"""Linear layers, split across tensor-parallel ranks as in Megatron-LM.

Column-parallel layers split their output rows: each rank computes its slice of the output, with
no communication. Row-parallel layers split their input columns: each rank computes a partial
sum, and one all-reduce adds them up. So q/k/v -> o and gate/up -> down cost one all-reduce each.
With one rank both are plain nn.Linear, and no collective is ever called.
"""
import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import SINGLE, TPGroup


class ColumnParallelLinear(nn.Linear):
    """One GEMM whose output packs several checkpoint projections (q/k/v, gate/up), each split by rows.

    `slices[i] = (rows, start, count)`: projection i has `rows` rows in the checkpoint, and this
    rank holds `count` of them from `start`. Build it with `split` or `qkv`."""

    def __init__(self, in_features: int, slices: list[tuple[int, int, int]], bias: bool = False):
        super().__init__(in_features, sum(count for _, _, count in slices), bias=bias)
        self.slices = slices
        self.output_sizes = [count for _, _, count in slices]

    @classmethod
    def split(cls, in_features: int, output_sizes: list[int], tp: TPGroup = SINGLE, bias: bool = False) -> "ColumnParallelLinear":
        """Each projection cut into tp.size equal row blocks; this rank takes block tp.rank."""
        return cls(in_features, [(n, tp.rank * (n // tp.size), n // tp.size) for n in output_sizes], bias)

    @classmethod
    def qkv(cls, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, tp: TPGroup = SINGLE,
            bias: bool = False) -> "ColumnParallelLinear":
        """q, k and v by whole heads. With fewer KV heads than ranks, consecutive ranks share a copy of
        one KV head: exactly the one their query heads attend to."""
        q = num_heads // tp.size * head_dim
        kv = max(1, num_kv_heads // tp.size) * head_dim
        kv_start = tp.rank * num_kv_heads // tp.size * head_dim
        kv_slice = (num_kv_heads * head_dim, kv_start, kv)
        return cls(hidden_size, [(num_heads * head_dim, tp.rank * q, q), kv_slice, kv_slice], bias)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        rows, start, count = self.slices[shard]
        if loaded.shape[0] != rows:
            raise ValueError(f"shard {shard} has {loaded.shape[0]} rows in the checkpoint, expected {rows}")
        offset = sum(self.output_sizes[:shard])
        param.data[offset : offset + count].copy_(loaded[start : start + count])


class RowParallelLinear(nn.Linear):
    """y = x W^T + b with W's input columns split across ranks; the partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = SINGLE):
        super().__init__(in_features // tp.size, out_features, bias=bias)
        self.tp = tp

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        is_weight = param is self.weight
        expected = (self.out_features, self.in_features * self.tp.size) if is_weight else (self.out_features,)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"the checkpoint gives shape {tuple(loaded.shape)}, the model expects {expected}")
        param.data.copy_(loaded.narrow(1, self.tp.rank * self.in_features, self.in_features) if is_weight else loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        # Every rank holds the whole bias; only rank 0 adds it, or the sum would count it tp.size times.
        return self.tp.all_reduce(F.linear(x, self.weight, self.bias if self.tp.rank == 0 else None))
