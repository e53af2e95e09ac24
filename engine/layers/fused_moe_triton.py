"""A mixture of experts on a GPU in two grouped matmuls (vLLM's fused_moe, in its simplest form), instead of a loop
over the experts decided on the host.

Each token chose `top_k` experts: that is tokens x top_k (token, expert) pairs. The pairs are sorted by expert and
each expert's run padded to a multiple of BLOCK_M rows (`align_by_expert`), so every BLOCK_M rows of the sorted
list belong to one expert. A program then multiplies its BLOCK_M rows by its expert's weight tile:

    gate_up[pair] = x[token of pair] @ W_gate_up[expert]^T      (one grouped matmul over all pairs)
    h[pair]       = act(gate_up[pair])                          (SwiGLU, or Gemma 4's GELU: the layer's own)
    y[pair]       = weight[pair] * h[pair] @ W_down[expert]^T   (the second, scaled by the router's weight)
    out[token]    = sum of y over the token's top_k pairs

Every step runs on the device from device tensors: the sort, the padding (the padded list is as long as it can
ever be, pairs + experts x (BLOCK_M - 1), and blocks past the real end return at once), both matmuls. Nothing is
read back to the host, so a step with it can be captured in a CUDA graph.

Full-precision stacked weights ([experts, 2 x intermediate, hidden] and [experts, hidden, intermediate], as
FusedMoE holds them). Tested under TRITON_INTERPRET=1 against the expert-by-expert loop, and compiled for
sm_86/sm_89/sm_90 in tests/test_kernels_compile_for_gpu.py.
"""

from collections.abc import Callable

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_matmul_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    weights_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    num_padded_ptr,
    num_pairs,
    N,
    K,
    stride_a,
    stride_we,
    stride_wn,
    stride_c,
    PAIRS_PER_A_ROW: tl.constexpr,
    MUL_WEIGHTS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """C[pair, n] = (weights[pair] *) sum_k A[pair // PAIRS_PER_A_ROW, k] * W[expert, n, k] for BLOCK_M sorted pairs
    of one expert and BLOCK_N outputs."""
    block, column_block = tl.program_id(0), tl.program_id(1)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    live = pairs < num_pairs  # padding rows hold num_pairs
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    a_rows = (pairs // PAIRS_PER_A_ROW).to(tl.int64)
    cols = column_block * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_a + ks[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_left = K - k
        a = tl.load(a_ptrs, mask=live[:, None] & (ks[None, :] < k_left), other=0.0)
        w = tl.load(w_ptrs, mask=(cols[None, :] < N) & (ks[:, None] < k_left), other=0.0)
        if IEEE:  # float32 weights: exact products, as the float32 reference computes them
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if MUL_WEIGHTS:
        acc *= tl.load(weights_ptr + pairs, mask=live, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + pairs[:, None].to(tl.int64) * stride_c + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=live[:, None] & (cols[None, :] < N))


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """(sorted_pairs, block_experts, num_padded) for the pairs of `ids` [tokens, top_k] (pair = token * top_k + slot):
    the pairs sorted by expert, each expert's run padded with `pairs` (past the last) to a multiple of `block_m`;
    each block's expert; the padded length, on the device."""
    flat = ids.flatten().long()
    num_pairs = flat.numel()
    # scatter_add, not bincount: bincount reads the largest id back to the host to size its output
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    experts = flat[order]
    rank = torch.arange(num_pairs, device=ids.device) - (counts.cumsum(0) - counts)[experts]
    length = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((length,), num_pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs[(padded_ends - padded)[experts] + rank] = order.int()
    block_starts = torch.arange(0, length, block_m, device=ids.device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True).clamp(max=num_experts - 1).int()
    return sorted_pairs, block_experts, padded_ends[-1:].int()


def _grouped_matmul(a, w, c, weights, aligned, pairs_per_a_row: int, block_m: int) -> None:
    sorted_pairs, block_experts, num_padded = aligned
    n, k = w.shape[1], w.shape[2]
    # float32's exact products run on plain FMAs, whose operand tiles crowd registers: the narrow K tile
    block_n, block_k = 64, 32 if k <= 64 or w.dtype == torch.float32 else 64
    grid = (sorted_pairs.numel() // block_m, triton.cdiv(n, block_n))
    _grouped_matmul_kernel[grid](
        a,
        w,
        c,
        weights if weights is not None else c,
        sorted_pairs,
        block_experts,
        num_padded,
        c.shape[0],
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        c.stride(0),
        PAIRS_PER_A_ROW=pairs_per_a_row,
        MUL_WEIGHTS=weights is not None,
        IEEE=w.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """sum_k weights[:, k] * down[ids[:, k]] @ act(gate_up[ids[:, k]] @ x): FusedMoE's forward in two grouped
    matmuls. x [tokens, hidden]; gate_up [experts, 2 * intermediate, hidden]; down [experts, hidden, intermediate]."""
    tokens, top_k = ids.shape
    num_experts, hidden = gate_up.shape[0], down.shape[1]
    block_m = 16 if tokens * top_k <= 16 * num_experts else 64  # decode: few pairs an expert
    aligned = align_by_expert(ids, num_experts, block_m)
    x = x.contiguous()
    first = torch.empty(tokens * top_k, gate_up.shape[1], dtype=x.dtype, device=x.device)
    _grouped_matmul(x, gate_up, first, None, aligned, top_k, block_m)
    h = act(first).contiguous()
    out = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _grouped_matmul(h, down, out, weights.flatten().contiguous(), aligned, 1, block_m)
    return out.view(tokens, top_k, hidden).sum(dim=1)
