"""Linear layers, split across tensor-parallel ranks as in Megatron-LM.

Column-parallel layers split their output rows: each rank computes its slice of the output, with
no communication. Row-parallel layers split their input columns: each rank computes a partial
sum, and one all-reduce adds them up. So q/k/v -> o and gate/up -> down cost one all-reduce each.
With one rank both are plain nn.Linear, and no collective is ever called.

On the CPU, `pack_for_cpu` hands every weight (the LM head's too) to oneDNN in its prepacked
layout. MKL's sgemm, behind F.linear, re-packs the whole weight on each call, which at decode
batch sizes costs as much as the arithmetic: the 135M model's matmuls run 1.4x faster at one row
and 1.7x at 32 rows once packed (bench/RESULTS.md). Results match F.linear to float32 rounding.
"""

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.runner.distributed import SINGLE, TPGroup
from engine.runner.tracing import tracing_decode_step

log = logging.getLogger("engine")


def bucketed_rows(rows: int) -> int:
    """The row count oneDNN is asked for: `rows` rounded up to one of a few sizes. oneDNN builds and caches a
    kernel per row count (its primitive cache and ideep's, 1,024 entries each at ~0.6 MiB), and a step's token
    count takes almost any value up to max_num_batched_tokens: a server's RSS climbed 10-25 MiB a burst of
    varied requests, up to ~0.75 GiB (tests/test_load_server.py). Decode's few rows stay exact; above 16, eight
    sizes per doubling, so the padding adds at most 1/8 of the rows."""
    if rows <= 16:
        return rows
    step = 1 << ((rows - 1).bit_length() - 4)  # rows in (2^(b-1), 2^b]: steps of 2^(b-4)
    return -(-rows // step) * step


def in_bucketed_rows(matmul, x: torch.Tensor) -> torch.Tensor:
    """`matmul(x)` for a 2-D x with its rows padded to `bucketed_rows` and the padding's outputs dropped: for every
    CPU product oneDNN computes (the packed weights, and bf16 F.linear)."""
    rows = x.shape[0] if x.dim() == 2 else None
    if rows is None or bucketed_rows(rows) == rows:
        return matmul(x)
    return matmul(F.pad(x, (0, 0, 0, bucketed_rows(rows) - rows)))[:rows]  # zero rows, dropped


def _linear_pointwise(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return in_bucketed_rows(lambda rows: torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], ""), x)


@torch.library.custom_op("pagoda::onednn_linear", mutates_args=())
def _onednn_linear_op(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _linear_pointwise(x, packed, bias)


@_onednn_linear_op.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0])


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) with W in oneDNN's packed layout (`torch.ops.mkldnn._reorder_linear_weight`).
    A compiled graph calls it as an opaque op: inductor lowers oneDNN's own op only for weights it
    has frozen into constants, which the compiled decode steps' weights are not (they stay inputs)."""
    if tracing_decode_step():
        return _onednn_linear_op(x, packed, bias)
    return _linear_pointwise(x, packed, bias)


class OneDNNMatmul(nn.Module):
    """x W^T (+ b) through oneDNN's prepacked copy of W, on the CPU: what `pack_for_cpu` swaps in."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        if weight is not None:  # the packed copy is this kernel's weight; another would be silently ignored
            raise ValueError("OneDNNMatmul multiplies by its own packed weight; pass weight=None")
        return onednn_linear(x, self.packed, bias)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.dtype}"


class PackableLinear(nn.Module):
    """A layer computing x W^T (+ b). How it multiplies is a swappable child module, `kernel`, which
    `print(model)` shows: none (F.linear), oneDNN's packed copy on the CPU (`pack_for_cpu`), or the
    Triton GEMV at the row counts where it measured faster (engine/layers/gemv.py). `normed_kernel`,
    set on column-parallel layers only, runs the norm before the layer inside it at one row
    (engine/layers/normed_gemv.py)."""

    def __init__(self) -> None:
        # The layers' own __init__ (nn.Linear's, the embedding's) call this one through super().__init__().
        # A class attribute would hide the swapped-in module, which nn.Module keeps apart from __dict__.
        super().__init__()
        self.kernel: nn.Module | None = None
        self.normed_kernel: nn.Module | None = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.matmul_with(x, self.weight, bias)

    def matmul_with(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T (+ bias) the way this layer multiplies its own weight (timings pass copies)."""
        if self.kernel is not None:
            return self.kernel(x, weight, bias)
        return F.linear(x, weight, bias)

    def pack(self) -> None:
        """Swap in oneDNN's packed copy of the weight. The plain weight is dropped, unless another
        module shares it (a tied embedding), which keeps it for its lookups."""
        self.kernel = OneDNNMatmul(self.weight)
        self.weight = None


def can_pack_for_cpu(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN takes packed `dtype` weights: bf16 and fp16 need AVX-512 or AVX-NE-CONVERT."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype))
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=dtype), probe, None, "none", [], "")
    except (RuntimeError, AttributeError) as e:  # AttributeError: a torch build without these ops
        log.info("matmuls use F.linear: oneDNN cannot pack %s weights here (%s)", dtype, str(e).splitlines()[0])
        return False
    return True


def pack_for_cpu(model: nn.Module) -> None:
    """Pack every PackableLinear's weight for oneDNN; first ask `can_pack_for_cpu` of the model's dtype."""
    for module in model.modules():
        if isinstance(module, PackableLinear):
            module.pack()


class ColumnParallelLinear(nn.Linear, PackableLinear):
    """One GEMM whose output packs several checkpoint projections (q/k/v, gate/up), each split by rows.

    `slices[i] = (rows, start, count)`: projection i has `rows` rows in the checkpoint, and this
    rank holds `count` of them from `start`. Build it with `split` or `qkv`."""

    def __init__(self, in_features: int, slices: list[tuple[int, int, int]], bias: bool = False):
        super().__init__(in_features, sum(count for _, _, count in slices), bias=bias)
        self.slices = slices
        self.output_sizes = [count for _, _, count in slices]

    @classmethod
    def split(
        cls, in_features: int, output_sizes: list[int], tp: TPGroup = SINGLE, bias: bool = False
    ) -> "ColumnParallelLinear":
        """Each projection cut into tp.size equal row blocks; this rank takes block tp.rank."""
        return cls(in_features, [(n, tp.rank * (n // tp.size), n // tp.size) for n in output_sizes], bias)

    @classmethod
    def qkv(
        cls,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        tp: TPGroup = SINGLE,
        bias: bool = False,
    ) -> "ColumnParallelLinear":
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def normed(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module, act: nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(act(self(norm(x + residual))), x + residual): a decoder layer's residual add and RMSNorm
        `norm`, this projection, and `act` (a SiluAndMul, for gate/up) if given. One kernel at one
        row where `normed_kernel` is set. Without `residual`, the norm is of x, and x is returned
        as the residual."""
        if self.normed_kernel is not None and x.shape[0] == 1:
            return self.normed_kernel(x, residual, norm, self.weight, self.bias, act)
        return self.normed_unfused(x, residual, norm, act)

    def normed_unfused(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module, act: nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = (norm(x), x) if residual is None else norm(x, residual)
        out = self(h)
        return (act(out) if act is not None else out), residual


class RowParallelLinear(nn.Linear, PackableLinear):
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
            return self.matmul(x, self.bias)
        # Every rank holds the whole bias; only rank 0 adds it, or the sum would count it tp.size times.
        return self.tp.all_reduce(self.matmul(x, self.bias if self.tp.rank == 0 else None))
