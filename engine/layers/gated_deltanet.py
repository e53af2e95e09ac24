"""Gated DeltaNet (Qwen3.5, Qwen3-Next): linear attention whose memory is a fixed-size state per request instead of
a KV history that grows with the context.

Each value head keeps a matrix S [key dim, value dim]. For every token, with a decay g <= 0 and a rate beta in (0, 1):

    S = exp(g) * S                        forget a little
    S = S + k (beta * (v - S^T k))^T      the delta rule: write only what S did not already predict for k
    o = S^T q                             read

q and k are L2-normalised per head (q also scaled by 1/sqrt(key dim)); q, k and v first go through a short causal
depthwise convolution (kernel 4), whose last inputs are state too. The output is RMS-normalised and gated by
silu(z), a projection of the layer's input.

Two forms compute the same thing: the recurrent one above, a token at a time (decode), and the chunked one, which
does 64 tokens at a time in matmuls and carries S from chunk to chunk (prefill). Both follow transformers'
torch reference (its `torch_chunk_gated_delta_rule` and `torch_recurrent_gated_delta_rule`) step for step, so the
engine's tokens equal transformers'. On NVIDIA GPUs both run as Triton kernels over the whole step instead
(engine/layers/gated_deltanet_triton.py), held to these.

The states live in per-layer pools, a slot per running request (`BlockManager`'s state slots, read from the step's
`AttentionMetadata.state_slots_cpu`): conv_state [slots, channels, kernel - 1] and recurrent_state [slots, value
heads, key dim, value dim] in float32. A request whose step starts at position 0 starts from zeros; chunked prefill
continues from what the last chunk left.
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear

CHUNK = 64


def uses_triton(x: torch.Tensor) -> bool:
    """Whether the delta rule runs as Triton kernels (engine/layers/gated_deltanet_triton.py): on NVIDIA GPUs."""
    return x.is_cuda


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunked_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens in chunks of CHUNK. q, k [heads, L, dk] (normalised and scaled), v [heads, L, dv],
    g and beta [heads, L], state [heads, dk, dv], all float32. Returns (output [heads, L, dv], final state)."""
    heads, length, dv = v.shape
    pad = (CHUNK - length % CHUNK) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    chunks = (length + pad) // CHUNK
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(heads, chunks, CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    decay = g.reshape(heads, chunks, CHUNK).cumsum(dim=-1)  # log of the decay from the chunk's start
    later = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(later, float("-inf")).exp()
    # The chunk's delta-rule updates solved at once: a unit lower-triangular system (the UT transform)
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    within = (q @ k.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    decayed_keys = torch.linalg.solve_triangular(
        system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True
    )
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    out = torch.zeros_like(new_values)
    for i in range(chunks):
        corrected = new_values[:, i] - decayed_keys[:, i] @ state
        out[:, i] = q[:, i] @ state + within[:, i] @ corrected
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ corrected
    return out.reshape(heads, -1, dv)[:, :length], state


def recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of S sequences: q, k [S, heads, dk], v [S, heads, dv], g and beta [S, heads], state
    [S, heads, dk, dv], float32. Returns (output [S, heads, dv], new state). `in_place`: `state` is updated where
    it lies (the same arithmetic, without a state's worth of new memory twice)."""
    decay = g.exp()[..., None, None]
    state = state.mul_(decay) if in_place else state * decay
    predicted = (state * k[..., None]).sum(dim=-2)
    delta = (v - predicted) * beta[..., None]
    update = k[..., None] * delta[..., None, :]
    state = state.add_(update) if in_place else state + update
    return (state * q[..., None]).sum(dim=-2), state


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, then times silu(gate) (transformers' Qwen3_5RMSNormGated)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        key_size, value_size = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        self.conv_size, self.kernel = 2 * key_size + value_size, config.linear_conv_kernel_dim
        # Value head j reads key head j // (value heads per key head) in transformers' order; j % key heads where
        # llama.cpp's converter tiled them (its GGUF files): every value-head tensor comes in that order alike
        self.tiled = bool(getattr(config, "linear_v_heads_tiled", False))
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"Gated DeltaNet's activation {config.hidden_act!r} is not supported")
        # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a of the checkpoint, in one matmul
        heads = self.num_v_heads
        self.in_proj = ColumnParallelLinear.split(config.hidden_size, [self.conv_size, value_size, heads, heads])
        self.split = self.in_proj.output_sizes
        self.conv1d_weight = nn.Parameter(torch.empty(self.conv_size, 1, self.kernel))  # depthwise, no bias
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.norm = GatedRMSNorm(self.v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(value_size, config.hidden_size, bias=False)
        # Set by the ModelRunner: a slot per running request (engine/runner/kv_cache.py, allocate_states)
        self.conv_state = self.recurrent_state = torch.empty(0)

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], bool]]:
        """One slot's states: name -> (shape, whether it is kept in float32 whatever the model's dtype)."""
        return {
            "conv_state": ((self.conv_size, self.kernel - 1), False),
            "recurrent_state": ((self.num_v_heads, self.k_dim, self.v_dim), True),
        }

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        for snapshot, slot in meta.state_restores:  # sequences starting on a cached prefix: its state first
            self.conv_state[slot] = self.conv_state[snapshot]
            self.recurrent_state[slot] = self.recurrent_state[snapshot]
        tokens, one_each = x.shape[0], meta.max_query_len == 1  # decode: every sequence's token at once
        qkv, z, b, a = self.in_proj(x).split(self.split, dim=-1)
        qkv = self._convolve_one_each(qkv, meta) if one_each else self._convolve(qkv, meta)
        key_size = self.num_k_heads * self.k_dim
        q, k, v = qkv.split([key_size, key_size, self.num_v_heads * self.v_dim], dim=-1)
        q, k = (l2norm(t.reshape(tokens, self.num_k_heads, self.k_dim).float()) for t in (q, k))
        q = q * self.k_dim**-0.5
        v = v.reshape(tokens, self.num_v_heads, self.v_dim).float()
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if uses_triton(x):
            out = self._delta_rule_triton(q, k, v, g, beta, meta, chunked=not one_each)
        else:
            groups = self.num_v_heads // self.num_k_heads  # each q/k head serves this many value heads
            q, k = (t.repeat(1, groups, 1) if self.tiled else t.repeat_interleave(groups, dim=1) for t in (q, k))
            delta_rule = self._delta_rule_one_each if one_each else self._delta_rule
            out = delta_rule(q, k, v, g, beta, meta)
        out = self.norm(out.to(x.dtype).reshape(-1, self.v_dim), z.reshape(-1, self.v_dim))
        return self.out_proj(out.reshape(tokens, -1))

    def _sequences(self, meta: AttentionMetadata):
        """(first token, tokens, state slot it reads, slot it writes, whether its state starts from zeros, [(tokens
        into the step, snapshot slot)] to keep) of each sequence in the step, in order: the rows of a request
        checking drafts come one after another, each reading the state the one before wrote."""
        snapshots: dict[int, list[tuple[int, int]]] = {}
        for i, offset, slot in meta.state_snapshots:
            snapshots.setdefault(i, []).append((offset, slot))
        writes = meta.state_writes_cpu or meta.state_slots_cpu
        start = 0
        for i, (n, length, slot, written) in enumerate(
            zip(meta.query_lens_cpu, meta.seq_lens_cpu, meta.state_slots_cpu, writes, strict=True)
        ):
            yield start, n, slot, written, length == n, snapshots.get(i, [])
            start += n

    def _convolve(self, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The causal depthwise convolution of each sequence's tokens after its last kernel - 1 inputs, then silu."""
        out = torch.empty_like(qkv)
        weight = self.conv1d_weight
        for start, n, slot, written, fresh, snapshots in self._sequences(meta):
            past = torch.zeros_like(self.conv_state[slot]) if fresh else self.conv_state[slot]
            inputs = torch.cat((past, qkv[start : start + n].T.to(weight.dtype)), dim=-1)
            for offset, snapshot in snapshots:  # the last kernel - 1 inputs before that token
                self.conv_state[snapshot] = inputs[:, offset : offset + self.kernel - 1]
            self.conv_state[written] = inputs[:, -(self.kernel - 1) :]
            mixed = F.conv1d(inputs[None], weight, groups=self.conv_size)[0, :, -n:]
            out[start : start + n] = F.silu(mixed).T.to(qkv.dtype)
        return out

    def _one_each(self, meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(state slots, whether each starts from zeros, the slot that keeps each one's state after its token, -1
        for none) of a step of one token a sequence, on the device: none of it is decided on the host, so a graph
        replays it. A row with no slot (a graph's padding) uses the scratch slot."""
        rows = meta.decode_states(device)
        return self._or_scratch(rows.slots), rows.fresh.bool(), rows.keep

    def _or_scratch(self, slots: torch.Tensor) -> torch.Tensor:
        """Slots, with -1 sent to the pools' last slot: a scratch slot no request holds."""
        return torch.where(slots < 0, self.recurrent_state.shape[0] - 1, slots).long()

    def _convolve_one_each(self, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        slots, fresh, keep = self._one_each(meta, qkv.device)
        if meta.state_waves_cpu is not None:
            return self._in_waves(self._convolve_rows, meta, qkv, slots, fresh, keep)
        return self._convolve_rows(qkv, slots, fresh, slots, keep)

    def _one_slot(self, slots: torch.Tensor, writes: torch.Tensor, keep: torch.Tensor | None) -> int | None:
        """The slot of a step of one sequence on the CPU that writes the slot it reads: such a step reads and
        updates its slot where it lies, instead of gathering and scattering a state of MBs, and skips the scratch
        slot's write when it keeps no snapshot. None for any other step (a graph's replays read device tensors)."""
        if slots.is_cuda or slots.numel() != 1 or writes is not slots or (keep is not None and keep.numel() != 1):
            return None
        return int(slots[0])

    def _convolve_rows(self, qkv, slots, fresh, writes, keep=None) -> torch.Tensor:
        slot = self._one_slot(slots, writes, keep)
        if slot is not None:
            past = self.conv_state[slot : slot + 1]
            if fresh[0]:
                past.zero_()
            inputs = torch.cat((past, qkv.to(past.dtype)[:, :, None]), dim=-1)
            past.copy_(inputs[:, :, 1:])
            if keep is not None and keep[0] >= 0:
                self.conv_state[int(keep[0])].copy_(inputs[0, :, 1:])
            return F.silu((inputs * self.conv1d_weight[:, 0]).sum(dim=-1)).to(qkv.dtype)
        past = self.conv_state[slots].masked_fill(fresh[:, None, None], 0)
        inputs = torch.cat((past, qkv.to(past.dtype)[:, :, None]), dim=-1)  # [sequences, channels, kernel]
        self.conv_state[writes] = inputs[:, :, 1:]
        if keep is not None:
            self.conv_state[self._or_scratch(keep)] = inputs[:, :, 1:]
        return F.silu((inputs * self.conv1d_weight[:, 0]).sum(dim=-1)).to(qkv.dtype)

    def _delta_rule_one_each(self, q, k, v, g, beta, meta: AttentionMetadata) -> torch.Tensor:
        slots, fresh, keep = self._one_each(meta, q.device)
        if meta.state_waves_cpu is not None:
            return self._in_waves(self._delta_rule_rows, meta, (q, k, v, g, beta), slots, fresh, keep)
        return self._delta_rule_rows((q, k, v, g, beta), slots, fresh, slots, keep)

    def _delta_rule_rows(self, inputs, slots, fresh, writes, keep=None) -> torch.Tensor:
        slot = self._one_slot(slots, writes, keep)
        if slot is not None:
            state = self.recurrent_state[slot : slot + 1]
            if fresh[0]:
                state.zero_()
            out, state = recurrent_delta_rule(*inputs, state, in_place=True)
            if keep is not None and keep[0] >= 0:
                self.recurrent_state[int(keep[0])].copy_(state[0])
            return out
        state = self.recurrent_state[slots].masked_fill(fresh[:, None, None, None], 0)
        out, state = recurrent_delta_rule(*inputs, state)
        self.recurrent_state[writes] = state
        if keep is not None:
            self.recurrent_state[self._or_scratch(keep)] = state
        return out

    def _in_waves(self, step_rows, meta: AttentionMetadata, inputs, slots, fresh, keep) -> torch.Tensor:
        """A step whose requests check drafts: their rows in order of place (every request's first row, then every
        second, ...), each wave reading the states the one before wrote, as plain decode steps would, one row a
        step. The rows' arithmetic is a decode step's, row for row."""
        waves = torch.tensor(meta.state_waves_cpu, device=slots.device)
        writes = torch.tensor(meta.state_writes_cpu, device=slots.device)
        out = None
        for wave in range(int(waves.max()) + 1):
            rows = (waves == wave).nonzero().flatten()
            part = tuple(t[rows] for t in inputs) if isinstance(inputs, tuple) else inputs[rows]
            result = step_rows(part, slots[rows], fresh[rows], writes[rows], keep[rows])  # keep: prefix snapshots
            if out is None:
                out = result.new_empty((len(waves), *result.shape[1:]))
            out[rows] = result
        return out

    def _delta_rule_triton(self, q, k, v, g, beta, meta: AttentionMetadata, chunked: bool) -> torch.Tensor:
        from engine.layers import gated_deltanet_triton as kernels  # Triton: imported where a GPU runs it

        if meta.state_waves_cpu is not None:  # refused at load (engine/spec_decode/speculator.py): never silently
            raise RuntimeError("checking drafts on a hybrid model runs on the CPU only; its GPU kernels cannot yet")

        plan = meta.backend_cache.get(("delta_rule_plan", chunked))  # the same for every linear layer of the step
        if plan is None and chunked:
            sequences = list(self._sequences(meta))
            lists = ([s[i] for s in sequences] for i in (1, 2, 4, 5))  # tokens, slot, fresh, snapshots
            plan = kernels.DeltaRulePlan.build(*lists, q.device, kernels.CHUNK)
        elif plan is None:
            plan = kernels.DeltaRulePlan.one_each(*self._one_each(meta, q.device))
        meta.backend_cache[("delta_rule_plan", chunked)] = plan
        return kernels.delta_rule(q, k, v, g, beta, self.recurrent_state, plan, chunked=chunked, tiled=self.tiled)

    def _delta_rule(self, q, k, v, g, beta, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(v)
        for start, n, slot, written, fresh, snapshots in self._sequences(meta):
            state = torch.zeros_like(self.recurrent_state[slot]) if fresh else self.recurrent_state[slot]
            kept = dict(snapshots)
            cuts = sorted({offset for offset in kept if 0 < offset < n} | {n})
            first = 0
            for cut in cuts:  # pieces ending where a snapshot is kept
                rows = slice(start + first, start + cut)
                if cut - first == 1 and not (fresh and first == 0):
                    o, state = recurrent_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], state[None])
                    out[rows], state = o, state[0]
                else:
                    o, state = chunked_delta_rule(*(t[rows].transpose(0, 1) for t in (q, k, v, g, beta)), state)
                    out[rows] = o.transpose(0, 1)
                if cut in kept:
                    self.recurrent_state[kept[cut]] = state
                first = cut
            self.recurrent_state[written] = state
        return out
