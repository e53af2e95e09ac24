"""Per-step attention inputs shared by every attention backend."""

from dataclasses import dataclass, field

import torch


@dataclass
class DecodeStates:
    """A step of one token a sequence, as a hybrid model's recurrent layers read it: device tensors, so that a
    captured decode graph replays them. Each sequence's state slot (-1: none, a graph's padding row), whether its
    state starts from zeros, and the snapshot slot that keeps its state after the token (-1: none). Layers send
    the -1s to a scratch slot at the end of their pools, which no request holds."""

    slots: torch.Tensor  # int32 [num_seqs]
    fresh: torch.Tensor  # int32 [num_seqs]; 1 = a one-token prompt
    keep: torch.Tensor  # int32 [num_seqs]

    @classmethod
    def of(cls, meta: "AttentionMetadata", device: torch.device) -> "DecodeStates":
        """From the step's host lists (`state_slots_cpu`, `seq_lens_cpu`, `state_snapshots`)."""
        keep = [-1] * meta.num_seqs
        for seq, _, snapshot in meta.state_snapshots:
            keep[seq] = snapshot
        fresh = [int(length == 1) for length in meta.seq_lens_cpu]
        rows = torch.tensor([meta.state_slots_cpu, fresh, keep], dtype=torch.int32).to(device, non_blocking=True)
        return cls(*rows)


@dataclass
class AttentionMetadata:
    """Describes one batch of flattened query tokens and where their KV lives.

    Sequence ``i`` owns query tokens ``query_start_loc[i]:query_start_loc[i+1]``. Those are the
    *last* tokens of its KV history: its query token ``j`` sits at position
    ``seq_lens[i] - query_len_i + j`` and attends causally to KV positions ``0..that position``.
    KV position ``p`` of sequence ``i`` lives in cache slot
    ``block_tables[i, p // block_size] * block_size + p % block_size``.

    Prefill, prefill over a cached prefix, chunked prefill and decode are all this one shape.
    A sequence with ``seq_lens[i] == 0`` is padding (CUDA-graph rows): its output is zeros.
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]; cache slot of each new token, -1 = write nothing
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]; cumulative query lengths
    seq_lens: torch.Tensor  # int32 [num_seqs]; KV length after this step (cached + new tokens)
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]; unused entries are -1
    max_query_len: int
    max_seq_len: int
    # Host copies, so backends that loop on the host never synchronise with the device.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # False under a CUDA graph, whose host lengths are upper bounds; the device tensors hold the truth.
    host_lens_exact: bool = True
    # Scratch for a backend to keep what it derives once per step and reuses in every layer.
    backend_cache: dict = field(default_factory=dict, repr=False)
    # With KV-cache groups (engine/runner/kv_cache.py): each group's metadata, this one first. They differ in
    # slot_mapping and block_tables only.
    groups: list["AttentionMetadata"] | None = field(default=None, repr=False)
    # Each sequence's state slot, for a hybrid model's recurrent layers (engine/layers/gated_deltanet.py)
    state_slots_cpu: list[int] | None = None
    state_restores: list[tuple[int, int]] = field(default_factory=list)  # (snapshot slot, slot) copied first
    state_snapshots: list[tuple[int, int, int]] = field(default_factory=list)  # (sequence, tokens into it, slot)
    # Checking drafts (engine/runner/step_inputs.py, chain_state_rows): per row, the slot its state is written to
    # (it reads state_slots_cpu's) and its place among its request's rows; None where every row keeps its own slot
    state_writes_cpu: list[int] | None = None
    state_waves_cpu: list[int] | None = None
    # The same, for a step of one token a sequence, on the device: a graph's own (engine/runner/cuda_graph.py),
    # else made from the lists above by the first layer that needs it (`decode_states`)
    decode_state_rows: DecodeStates | None = field(default=None, repr=False)

    def for_group(self, group: int) -> "AttentionMetadata":
        """The metadata the layers of KV-cache group `group` read."""
        return self if self.groups is None else self.groups[group]

    def decode_states(self, device: torch.device) -> DecodeStates:
        if self.decode_state_rows is None:
            self.decode_state_rows = DecodeStates.of(self, device)
        return self.decode_state_rows

    def token_positions(self, num_tokens: int) -> torch.Tensor:
        """Each query token's position in its sequence, int64 [num_tokens] (0 for tokens no sequence owns). A step
        of one token a sequence (a captured or compiled decode step's too) reads only device tensors."""
        if self.max_query_len == 1 and num_tokens == self.seq_lens.shape[0]:
            return (self.seq_lens.long() - 1).clamp(min=0)
        if "positions" not in self.backend_cache:
            spans = [range(s - q, s) for q, s in zip(self.query_lens_cpu, self.seq_lens_cpu, strict=True)]
            positions = [p for span in spans for p in span]
            positions += [0] * (num_tokens - len(positions))
            self.backend_cache["positions"] = torch.tensor(positions, device=self.seq_lens.device)
        return self.backend_cache["positions"]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
