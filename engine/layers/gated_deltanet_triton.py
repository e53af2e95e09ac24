"""Gated DeltaNet's delta rule on a GPU: the recurrent form (decode) and the chunked form (prefill) as Triton kernels
over every sequence of a step at once, reading and writing the state pool in place.

The math is engine/layers/gated_deltanet.py's torch reference (`recurrent_delta_rule`, `chunked_delta_rule`), which
stays the ground truth: tests/test_gated_deltanet_triton.py holds the kernels to it under TRITON_INTERPRET=1, and
tests/test_kernels_compile_for_gpu.py compiles them for sm_86/sm_89/sm_90.

A step's sequences are cut into pieces (`DeltaRulePlan`): where a snapshot slot keeps the state, a piece ends, and
the chunked form cuts pieces into chunks of CHUNK tokens. A program that carries S owns one (sequence, value head,
BLOCK_V columns of the value dim): its slice of S [key dim, BLOCK_V] stays in registers from the sequence's first
piece to its last, and is written to the sequence's slot at the end, and to a snapshot slot after a piece that
keeps one. Value head h reads key head h // (value heads per key head), or h % key heads where the GGUF converter
tiled them.

The chunked form runs in two kernels, as flash-linear-attention's does. Within a chunk the delta-rule updates are
one unit lower-triangular system (the UT transform); the first kernel, a program per (chunk, value head) and all of
them at once, solves it by forward substitution into its inverse T and keeps what does not depend on S:

    T            = (I + strictly_lower(beta k k^T * decay))^-1
    new_values   = T (beta v)           decayed_keys = T (beta k exp(cumulative g))
    within       = (q k^T * decay, lower)

The second walks each sequence's chunks in order:

    corrected = new_values - decayed_keys S
    out       = (q exp(cumulative g)) S + within corrected
    S         = exp(chunk's g) S + (k exp(chunk's g - cumulative g))^T corrected

Matmuls take TF32 inputs (float32 sums), as GPU linear-attention kernels do: the tensor cores, and registers enough
for a key dim of 128 on a laptop's sm_86. The interpreter computes them in float32.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Chosen by compiling for sm_86 (tests/test_kernels_compile_for_gpu.py): the largest tiles that neither spill
# registers nor pass its 99 KiB of shared memory a block, for a key dim of 128
CHUNK = 32
BLOCK_V = 32  # the recurrent kernel's
STATE_BLOCK_V = 16  # the chunked state kernel's, whose chunk tiles take the registers


@dataclass
class DeltaRulePlan:
    """A step's pieces, as device tensors the kernels read. Sequence i continues state slot `slot[i]` (or starts
    from zeros: `fresh[i]`) and is pieces piece_ptr[i]:piece_ptr[i + 1]; a piece is `piece_len` tokens from token
    `piece_start` of the step, after which snapshot slot `piece_keep` keeps the state (-1: none)."""

    slot: torch.Tensor
    fresh: torch.Tensor
    piece_ptr: torch.Tensor
    piece_start: torch.Tensor
    piece_len: torch.Tensor
    piece_keep: torch.Tensor

    @classmethod
    def build(
        cls,
        lengths: list[int],
        slots: list[int],
        fresh: list[bool],
        cuts: list[list[tuple[int, int]]],
        device: torch.device,
        chunk: int | None = None,
    ) -> "DeltaRulePlan":
        """lengths, slots, fresh and cuts ([(tokens into the sequence's step, snapshot slot)]) per sequence, in
        step order; with `chunk`, no piece is longer."""
        ptr, starts, lens, keeps = [0], [], [], []
        first_token = 0
        for length, kept in zip(lengths, cuts, strict=True):
            done = 0
            for end, keep in [*sorted(kept), (length, -1)]:
                while True:  # a piece a chunk, the last of them keeping the snapshot
                    size = end - done if chunk is None else min(chunk, end - done)
                    starts.append(first_token + done)
                    lens.append(size)
                    done += size
                    keeps.append(keep if done == end else -1)
                    if done == end:
                        break
            ptr.append(len(starts))
            first_token += length
        values = [slots, [int(f) for f in fresh], ptr, starts, lens, keeps]
        flat = torch.tensor([x for v in values for x in v], dtype=torch.int32).to(device, non_blocking=True)
        return cls(*flat.split([len(v) for v in values]))

    @classmethod
    def one_each(cls, slots: torch.Tensor, fresh: torch.Tensor, keep: torch.Tensor) -> "DeltaRulePlan":
        """A step of one token a sequence, from device tensors (a decode graph replays it): each sequence's slot,
        whether it starts from zeros, and the slot that keeps its state after the token."""
        rows = torch.arange(len(slots) + 1, dtype=torch.int32, device=slots.device)
        return cls(slots, fresh.int(), rows, rows[:-1], torch.ones_like(rows[:-1]), keep)


@triton.jit
def _key_head(h, H: tl.constexpr, HK: tl.constexpr, TILED: tl.constexpr):
    return h % HK if TILED else h // (H // HK)


@triton.jit
def _load_state(state_ptr, slot_ptr, fresh_ptr, stride_slot, seq, h, offs_k, offs_v, K: tl.constexpr, V: tl.constexpr):
    """A program's slice of its sequence's S (zeros for a fresh one), and where in the pool it lives."""
    state_offs = h * K * V + offs_k[:, None] * V + offs_v[None, :]
    state_mask = (offs_k[:, None] < K) & (offs_v[None, :] < V)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    S = tl.load(state_ptr + slot * stride_slot + state_offs, mask=state_mask, other=0.0)
    S = tl.where(tl.load(fresh_ptr + seq) == 0, S, 0.0)  # a fresh slot holds whatever its last request left
    return S, slot, state_offs, state_mask


@triton.jit
def _recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    out_ptr,
    state_ptr,
    slot_ptr,
    fresh_ptr,
    piece_ptr_ptr,
    piece_start_ptr,
    piece_len_ptr,
    piece_keep_ptr,
    stride_qt,
    stride_vt,
    stride_gt,
    stride_slot,
    H: tl.constexpr,
    HK: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    K_PAD: tl.constexpr,
    TILED: tl.constexpr,
    BV: tl.constexpr,
):
    """A token at a time: S = exp(g) S; S += k (beta (v - S^T k))^T; out = S^T q."""
    seq, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kh = _key_head(h, H, HK, TILED)
    offs_k, offs_v = tl.arange(0, K_PAD), vb * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < K, offs_v < V
    S, slot, state_offs, state_mask = _load_state(
        state_ptr, slot_ptr, fresh_ptr, stride_slot, seq, h, offs_k, offs_v, K, V
    )
    for piece in range(tl.load(piece_ptr_ptr + seq), tl.load(piece_ptr_ptr + seq + 1)):
        start = tl.load(piece_start_ptr + piece).to(tl.int64)
        for token in range(start, start + tl.load(piece_len_ptr + piece)):
            q = tl.load(q_ptr + token * stride_qt + kh * K + offs_k, mask=mask_k, other=0.0)
            k = tl.load(k_ptr + token * stride_qt + kh * K + offs_k, mask=mask_k, other=0.0)
            v = tl.load(v_ptr + token * stride_vt + h * V + offs_v, mask=mask_v, other=0.0)
            S = S * tl.exp(tl.load(g_ptr + token * stride_gt + h))
            delta = (v - tl.sum(S * k[:, None], 0)) * tl.load(beta_ptr + token * stride_gt + h)
            S += k[:, None] * delta[None, :]
            tl.store(out_ptr + token * stride_vt + h * V + offs_v, tl.sum(S * q[:, None], 0), mask=mask_v)
        keep = tl.load(piece_keep_ptr + piece).to(tl.int64)
        if keep >= 0:
            tl.store(state_ptr + keep * stride_slot + state_offs, S, mask=state_mask)
    tl.store(state_ptr + slot * stride_slot + state_offs, S, mask=state_mask)


@triton.jit
def _chunk_prepare_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    piece_start_ptr,
    piece_len_ptr,
    decay_ptr,
    keys_ptr,
    values_ptr,
    within_ptr,
    stride_qt,
    stride_vt,
    stride_gt,
    H: tl.constexpr,
    HK: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    K_PAD: tl.constexpr,
    TILED: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
):
    """One chunk's T, decayed_keys, new_values and within; rows past the chunk's end are zeros (their decay the
    chunk's total)."""
    chunk, h = tl.program_id(0), tl.program_id(1)
    kh = _key_head(h, H, HK, TILED)
    start = tl.load(piece_start_ptr + chunk).to(tl.int64)
    rows, offs_k = tl.arange(0, BT), tl.arange(0, K_PAD)
    live = rows < tl.load(piece_len_ptr + chunk)
    token = start + rows
    qk_offs = token[:, None] * stride_qt + kh * K + offs_k[None, :]
    qk_mask = live[:, None] & (offs_k[None, :] < K)
    g = tl.load(g_ptr + token * stride_gt + h, mask=live, other=0.0)
    beta = tl.load(beta_ptr + token * stride_gt + h, mask=live, other=0.0)
    decay = tl.cumsum(g, 0)
    pairwise = tl.where(rows[:, None] >= rows[None, :], tl.exp(decay[:, None] - decay[None, :]), 0.0)
    k = tl.load(k_ptr + qk_offs, mask=qk_mask, other=0.0)
    q = tl.load(q_ptr + qk_offs, mask=qk_mask, other=0.0)
    within = tl.dot(q, tl.trans(k), input_precision="tf32") * pairwise
    out_rows = chunk * BT + rows  # the scratch tensors' rows: BT a chunk
    tl.store(within_ptr + (out_rows[:, None] * H + h) * BT + rows[None, :], within)
    system = tl.dot(k * beta[:, None], tl.trans(k), input_precision="tf32") * pairwise
    system = tl.where(rows[:, None] > rows[None, :], system, 0.0)
    inverse = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for i in range(1, BT):  # row i of (I + L)^-1 = e_i - sum over j < i of L[i, j] x row j
        l_row = tl.sum(tl.where(rows[:, None] == i, system, 0.0), 0)
        row = tl.where(rows == i, 1.0, 0.0) - tl.sum(l_row[:, None] * inverse, 0)
        inverse = tl.where(rows[:, None] == i, row[None, :], inverse)
    tl.store(decay_ptr + out_rows * H + h, decay)
    keys = tl.dot(inverse, k * (beta * tl.exp(decay))[:, None], input_precision="tf32")
    tl.store(keys_ptr + (out_rows[:, None] * H + h) * K + offs_k[None, :], keys, mask=offs_k[None, :] < K)
    for vb in range(0, V, BV):
        offs_v = vb + tl.arange(0, BV)
        v_mask = offs_v[None, :] < V
        v = tl.load(v_ptr + token[:, None] * stride_vt + h * V + offs_v[None, :], mask=live[:, None] & v_mask, other=0)
        values = tl.dot(inverse, v * beta[:, None], input_precision="tf32")
        tl.store(values_ptr + (out_rows[:, None] * H + h) * V + offs_v[None, :], values, mask=v_mask)


@triton.jit
def _chunk_state_kernel(
    q_ptr,
    k_ptr,
    out_ptr,
    state_ptr,
    slot_ptr,
    fresh_ptr,
    piece_ptr_ptr,
    piece_start_ptr,
    piece_len_ptr,
    piece_keep_ptr,
    decay_ptr,
    keys_ptr,
    values_ptr,
    within_ptr,
    stride_qt,
    stride_vt,
    stride_slot,
    H: tl.constexpr,
    HK: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    K_PAD: tl.constexpr,
    TILED: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
):
    """A sequence's chunks in order, carrying S from one to the next."""
    seq, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kh = _key_head(h, H, HK, TILED)
    rows, offs_k, offs_v = tl.arange(0, BT), tl.arange(0, K_PAD), vb * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < K, offs_v < V
    S, slot, state_offs, state_mask = _load_state(
        state_ptr, slot_ptr, fresh_ptr, stride_slot, seq, h, offs_k, offs_v, K, V
    )
    for chunk in range(tl.load(piece_ptr_ptr + seq), tl.load(piece_ptr_ptr + seq + 1)):
        token = tl.load(piece_start_ptr + chunk).to(tl.int64) + rows
        live = rows < tl.load(piece_len_ptr + chunk)
        scratch_rows = chunk * BT + rows
        decay = tl.load(decay_ptr + scratch_rows * H + h)
        keys = tl.load(keys_ptr + (scratch_rows[:, None] * H + h) * K + offs_k[None, :], mask=mask_k[None, :], other=0)
        values = tl.load(values_ptr + (scratch_rows[:, None] * H + h) * V + offs_v[None, :], mask=mask_v[None, :])
        corrected = values - tl.dot(keys, S, input_precision="tf32")
        qk_offs = token[:, None] * stride_qt + kh * K + offs_k[None, :]
        qk_mask = live[:, None] & mask_k[None, :]
        q = tl.load(q_ptr + qk_offs, mask=qk_mask, other=0.0)
        within = tl.load(within_ptr + (scratch_rows[:, None] * H + h) * BT + rows[None, :])
        out = tl.dot(q * tl.exp(decay)[:, None], S, input_precision="tf32")
        out += tl.dot(within, corrected, input_precision="tf32")
        out_offs = token[:, None] * stride_vt + h * V + offs_v[None, :]
        tl.store(out_ptr + out_offs, out, mask=live[:, None] & mask_v[None, :])
        total = tl.sum(tl.where(rows == BT - 1, decay, 0.0), 0)
        k = tl.load(k_ptr + qk_offs, mask=qk_mask, other=0.0) * tl.exp(total - decay)[:, None]
        S = S * tl.exp(total) + tl.dot(tl.trans(k), corrected, input_precision="tf32")
        keep = tl.load(piece_keep_ptr + chunk).to(tl.int64)
        if keep >= 0:
            tl.store(state_ptr + keep * stride_slot + state_offs, S, mask=state_mask)
    tl.store(state_ptr + slot * stride_slot + state_offs, S, mask=state_mask)


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    plan: DeltaRulePlan,
    *,
    chunked: bool,
    tiled: bool = False,
) -> torch.Tensor:
    """Every sequence of the step, in the plan's pieces (built with chunk=CHUNK for the chunked form). q, k [tokens,
    key heads, key dim] (normalised, q scaled), v [tokens, value heads, value dim], g and beta [tokens, value
    heads], states [slots, value heads, key dim, value dim]: all float32. Updates states in place (each sequence's
    slot, and its snapshots); returns the output [tokens, value heads, value dim]."""
    tokens, heads, dv = v.shape
    key_heads, dk = q.shape[1], q.shape[2]
    if heads % key_heads:
        raise ValueError(f"{heads} value heads cannot share {key_heads} key heads evenly")
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    out = torch.empty_like(v)
    block_v = min(BLOCK_V, max(16, triton.next_power_of_2(dv)))
    shape = dict(H=heads, HK=key_heads, K=dk, V=dv, K_PAD=max(16, triton.next_power_of_2(dk)), TILED=tiled, BV=block_v)
    grid = (len(plan.slot), heads, triton.cdiv(dv, block_v))
    pieces = (plan.piece_ptr, plan.piece_start, plan.piece_len, plan.piece_keep)
    if not chunked:
        _recurrent_kernel[grid](
            q, k, v, g, beta, out, states, plan.slot, plan.fresh, *pieces,
            q.stride(0), v.stride(0), g.stride(0), states.stride(0), **shape, num_warps=4,
        )  # fmt: skip
        return out
    chunks = len(plan.piece_len)
    decay = q.new_empty(chunks * CHUNK, heads)
    keys = q.new_empty(chunks * CHUNK, heads, dk)
    values = q.new_empty(chunks * CHUNK, heads, dv)
    within = q.new_empty(chunks * CHUNK, heads, CHUNK)
    scratch = (decay, keys, values, within)
    _chunk_prepare_kernel[(chunks, heads)](
        q, k, v, g, beta, plan.piece_start, plan.piece_len, *scratch,
        q.stride(0), v.stride(0), g.stride(0), **shape, BT=CHUNK, num_warps=8,
    )  # fmt: skip
    shape["BV"] = min(STATE_BLOCK_V, block_v)
    grid = (len(plan.slot), heads, triton.cdiv(dv, shape["BV"]))
    _chunk_state_kernel[grid](
        q, k, out, states, plan.slot, plan.fresh, *pieces, *scratch,
        q.stride(0), v.stride(0), states.stride(0), **shape, BT=CHUNK, num_warps=8,
    )  # fmt: skip
    return out
