"""PyTorch's tinygemm int4 matmul (`torch.ops.aten._weight_int4pack_mm`) on Pagoda's 4-bit weights, on a GPU:
where it applies, the weight in its packing, and the product. The Triton tile choice (triton_tiles.py) times it
against Pagoda's own kernels at one row, and TritonQuantMatmul holds its packing where it measured faster."""

import torch

from engine.quantization.layout import QuantizedWeight

TINYGEMM_GROUPS = (32, 64, 128, 256)


def tinygemm_applies(qw: QuantizedWeight, dtype: torch.dtype) -> bool:
    """Whether tinygemm's int4 matmul can serve `qw` for `dtype` activations on this build."""
    n, k = qw.shape
    return (
        qw.bits == 4
        and dtype == torch.bfloat16
        and qw.group_size in TINYGEMM_GROUPS
        and k % qw.group_size == 0
        and k % 32 == 0
        and n % 8 == 0
        and qw.q.is_cuda
        and hasattr(torch.ops.aten, "_weight_int4pack_mm")
    )


def tinygemm_pack(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, int]:
    """qw for tinygemm: its int4 packing, its [K / g, N, 2] bf16 scales and zeros, and the group size.
    tinygemm computes (q - 8) * scale + zero, so zero = offset + 8 * scale."""
    k = qw.shape[1]
    inner_k_tiles = next(t for t in (8, 4, 2) if k % (16 * t) == 0)
    packed = (qw.q[:, 0::2] << 4 | qw.q[:, 1::2]).contiguous()
    weight = torch.ops.aten._convert_weight_to_int4pack(packed, inner_k_tiles)
    zero = 8 * qw.scale + (qw.offset if qw.offset is not None else 0)
    scales_and_zeros = torch.stack([qw.scale, zero], dim=2).transpose(0, 1).contiguous().to(torch.bfloat16)
    return weight, scales_and_zeros, qw.group_size


def tinygemm_matmul(
    x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor, int], bias: torch.Tensor | None
) -> torch.Tensor:
    out = torch.ops.aten._weight_int4pack_mm(x, packed[0], packed[2], packed[1])
    return out + bias if bias is not None else out
