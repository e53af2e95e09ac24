"""The modules the quantization pass swaps in for a built model's linear layers and embedding.

A checkpoint gives a fused projection (q/k/v, gate/up) in shards, and a GGUF file may store each
shard in another type: Q4_K_M files keep v_proj in Q6_K beside Q4_K q and k. So a QuantizedLinear
collects its shards as they load, each full precision or a QuantizedWeight, and `finalize` gives
every run of shards in one layout its own kernel (engine/quantization/kernels.py), measured.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.quantization import kquant
from engine.quantization.blocks import BlockWeight
from engine.quantization.chooser import choose_matmul
from engine.quantization.kernels import DenseMatmul, QuantizedMatmul, pack_nibbles, unpack_nibbles
from engine.quantization.layout import QuantizedWeight, quantize_int4, quantize_int8
from engine.quantization.methods import refuse_requantizing


@dataclass(frozen=True)
class KernelTarget:
    """Where and how the swapped modules will run: their kernels are built as each layer loads."""

    device: torch.device
    dtype: torch.dtype  # the activations'
    onednn: bool  # full-precision parts use oneDNN's packed weights (the CPU, where it takes the dtype)


def quantize_tensor(w: torch.Tensor, method: str | None, group_size: int) -> torch.Tensor | QuantizedWeight:
    """A checkpoint tensor as `method` stores it; None keeps it as it is."""
    if method is None:
        return w
    return quantize_int8(w) if method == "int8" else quantize_int4(w, group_size)


def _concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, BlockWeight) for p in parts):
        return BlockWeight.concat(parts)
    first = parts[0]
    offsets = None if first.offset is None else torch.cat([p.offset for p in parts])
    blocks = torch.cat([p.blocks for p in parts]) if all(p.blocks is not None for p in parts) else None
    return QuantizedWeight(
        first.bits,
        torch.cat([p.q for p in parts]),
        torch.cat([p.scale for p in parts]),
        offsets,
        first.group_size,
        first.source,
        blocks,
    )


def _layout_key(w: torch.Tensor | QuantizedWeight) -> tuple:
    if isinstance(w, QuantizedWeight):
        return (w.bits, w.group_size, not w.has_offset, w.source)
    return ("dense",)


class QuantizedLinear(nn.Module):
    """y = x W^T (+ b) with W's rows in shards (`shard_rows`), each loaded full precision or quantized.

    `method` ("int8", "int4", or None) is what full-precision shards become; a shard that arrives
    quantized (GGUF) is kept as it is."""

    def __init__(
        self,
        in_features: int,
        shard_rows: list[int],
        bias: nn.Parameter | None,
        method: str | None,
        group_size: int,
        target: KernelTarget,
    ):
        super().__init__()
        self.in_features, self.shard_rows = in_features, shard_rows
        self.out_features = sum(shard_rows)
        self.output_sizes = shard_rows
        self.method, self.group_size, self.target = method, group_size, target
        self.bias = bias
        self.pending: dict[int, torch.Tensor | QuantizedWeight] = {}
        self.parts = nn.ModuleList()

    def load_quantizable(self, loaded: torch.Tensor | QuantizedWeight, shard: int | None) -> None:
        """Take one checkpoint shard of the weight (the whole weight when `shard` is None)."""
        if shard is None and len(self.shard_rows) > 1 and tuple(loaded.shape) == (self.out_features, self.in_features):
            # a fused projection stored fused (Phi-3's qkv_proj, gate_up_proj): each shard takes its rows
            start = 0
            for index, rows in enumerate(self.shard_rows):
                part = loaded.rows(start, rows) if isinstance(loaded, QuantizedWeight) else loaded[start : start + rows]
                self.load_quantizable(part, index)
                start += rows
            return
        index = 0 if shard is None else shard
        rows = self.out_features if shard is None else self.shard_rows[index]
        if tuple(loaded.shape) != (rows, self.in_features):
            raise ValueError(
                f"the checkpoint gives shape {tuple(loaded.shape)}, the model expects {(rows, self.in_features)}"
            )
        if isinstance(loaded, QuantizedWeight):
            refuse_requantizing(self.method, loaded.source)
            self.pending[index] = loaded.to(self.target.device)
        else:  # quantized where it will run: a GPU does it in a blink
            self.pending[index] = quantize_tensor(loaded.to(self.target.device), self.method, self.group_size)
        if len(self.pending) == len(self.shard_rows):
            # Kernels pack the codes tighter than the loader's one code per byte: pack each layer as soon
            # as it is whole, so the loose codes of only one layer ever exist at a time.
            self.finalize()

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        """A bias shard (weights come through `load_quantizable`)."""
        start = sum(self.shard_rows[:shard])
        param.data[start : start + self.shard_rows[shard]].copy_(loaded)

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(
                f"the checkpoint gives shape {tuple(loaded.shape)}, the model expects {tuple(param.shape)}"
            )
        param.data.copy_(loaded)

    @property
    def loaded(self) -> bool:
        return len(self.parts) > 0

    def finalize(self) -> None:
        """Build the kernels over the loaded shards; the shards themselves are then dropped."""
        device, dtype = self.target.device, self.target.dtype
        shards = [self.pending[i] for i in range(len(self.shard_rows))]
        runs: list[list] = []
        for w in shards:
            if runs and _layout_key(runs[-1][0]) == _layout_key(w):
                runs[-1].append(w)
            else:
                runs.append([w])
        for run in runs:
            if isinstance(run[0], QuantizedWeight):
                self.parts.append(choose_matmul(_concat(run), device, dtype))
            else:
                self.parts.append(DenseMatmul(torch.cat(run).to(device), dtype, self.target.onednn))
        self.pending = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.parts[0](x) if len(self.parts) == 1 else torch.cat([part(x) for part in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias

    def normed(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module, act: nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(act(self(norm(x + residual))), x + residual), as ColumnParallelLinear.normed runs it unfused."""
        h, residual = (norm(x), x) if residual is None else norm(x, residual)
        out = self(h)
        return (act(out) if act is not None else out), residual

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class QuantizedEmbedding(nn.Module):
    """Token embedding whose table stays quantized; looked-up rows are dequantized."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, method: str | None, group_size: int, target: KernelTarget
    ):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.method, self.group_size, self.target = method, group_size, target
        self.dtype = torch.float32
        self.bits = 0  # 0: a full-precision table in `table`
        self.table = self.scale = self.offset = None
        self.rows_from_head = None  # a tied head's kernel's `looked_up_rows`, where that holds the table instead
        self.blocks = None  # a K-quant table in its GGUF blocks, its rows dequantized by kquant.py
        self.source = "dense"

    @property
    def loaded(self) -> bool:
        return self.table is not None or self.rows_from_head is not None or self.blocks is not None

    def load_quantizable(self, loaded: torch.Tensor | QuantizedWeight, shard: int | None = None) -> None:
        if tuple(loaded.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"the checkpoint gives shape {tuple(loaded.shape)}, the model expects "
                f"{(self.num_embeddings, self.embedding_dim)}"
            )
        if isinstance(loaded, QuantizedWeight):
            refuse_requantizing(self.method, loaded.source)
        w = (
            loaded
            if isinstance(loaded, QuantizedWeight)
            else quantize_tensor(loaded.to(self.target.device), self.method, self.group_size)
        )
        if isinstance(w, QuantizedWeight):
            self.bits, self.group_size, self.source = w.bits, w.group_size, w.source
            if self.target.device.type == "cpu" and kquant.block_rows(w) is not None:  # not expanded to codes
                self.blocks = w.blocks
                return
            self.table = pack_nibbles(w.q) if w.bits == 4 else w.q
            self.scale, self.offset = w.scale, w.offset
        else:
            self.table = w

    def finalize(self, head: nn.Module | None = None) -> None:
        """Move the table to its device. With a tied `head` whose one kernel reads rows of its own layout, look
        rows up there instead and drop the table: a tied table is then held once, in the head's layout. Idempotent:
        the loader calls it as soon as a tied head is built, so the table goes before the other tensors load."""
        device, self.dtype = self.target.device, self.target.dtype
        if self.rows_from_head is not None:
            return
        kernel = head.parts[0] if head is not None and len(head.parts) == 1 else None
        if (
            isinstance(kernel, QuantizedMatmul)
            and self.bits
            and (kernel.out_features, kernel.in_features) == (self.num_embeddings, self.embedding_dim)
            and kernel.looked_up_rows(torch.zeros(1, dtype=torch.long, device=device)) is not None
        ):
            self.rows_from_head = kernel.looked_up_rows
            self.table = self.scale = self.offset = self.blocks = None
            return
        if self.blocks is not None:
            self.blocks = self.blocks.to(device)
            self.rows_from_head = kquant.block_rows(self)
            return
        self.table = self.table.to(device) if self.bits else self.table.to(device, self.dtype)
        self.scale = None if self.scale is None else self.scale.to(device)
        self.offset = None if self.offset is None else self.offset.to(device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.rows_from_head is not None:
            rows = self.rows_from_head(input_ids.reshape(-1))
            return rows.view(*input_ids.shape, self.embedding_dim).to(self.dtype)
        if not self.bits:
            return F.embedding(input_ids, self.table)
        codes = self.table[input_ids]
        if self.bits == 4:
            codes = unpack_nibbles(codes, self.embedding_dim)
        k, g = self.embedding_dim, self.group_size
        w = codes.float() * self.scale[input_ids].repeat_interleave(g, dim=-1)[..., :k]
        if self.offset is not None:
            w += self.offset[input_ids].repeat_interleave(g, dim=-1)[..., :k]
        return w.to(self.dtype)

    def extra_repr(self) -> str:
        kind = f"{self.source}: {self.bits}-bit" if self.bits else "full precision"
        shared = ", rows read from the tied head's kernel" if self.rows_from_head is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}, {kind}{shared}"
