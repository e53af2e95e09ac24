"""Slots of a hybrid model's recurrent state (Qwen3.5's Gated DeltaNet layers), as block ids are slots of the KV
cache: the ids BlockManager hands out; the tensors behind them are the layers' (engine/layers/gated_deltanet.py).

A running request holds one slot, its state after the tokens it has computed. With speculative decoding it also
has k verify slots, for the states between the rows of a step that checks its k drafts. Snapshot slots hold the state a
request had at a position that is a multiple of `snapshot_tokens`, keyed by the chained hash of the prompt up to
there (the KV blocks' hash): a later request with that prefix starts from a copy of it, as it starts on the
cached KV blocks, and computes only the rest. Snapshots are kept least recently used first, as many as their slots.

    request A, prompt of 300 tokens, snapshot_tokens 128:   snapshots at 128 and 256 (hash of blocks 0-7, 0-15)
    request B, same first 290 tokens:                       KV hit 288 tokens (18 blocks); the newest snapshot
                                                            at or before it is 256: B restores it, computes 256..
"""

from collections import OrderedDict, deque


class StateSlots:
    def __init__(self, num_running: int, num_snapshots: int = 0, snapshot_tokens: int = 0, verify_per_slot: int = 0):
        if num_running < 1 or num_snapshots < 0 or (num_snapshots and snapshot_tokens < 1):
            raise ValueError(
                f"state slots need >= 1 running slot and a snapshot interval for snapshots, got {num_running}, "
                f"{num_snapshots} and {snapshot_tokens}"
            )
        self.num_running, self.num_snapshots, self.snapshot_tokens = num_running, num_snapshots, snapshot_tokens
        self.free_running: deque[int] = deque(range(num_running))
        self.free_snapshots: deque[int] = deque(range(num_running, num_running + num_snapshots))
        self.snapshots: OrderedDict[int, int] = OrderedDict()  # prefix hash -> slot, least recently used first
        # Speculative decoding: after the snapshots, `verify_per_slot` slots for each running one (verify_slot)
        self.verify_per_slot = verify_per_slot

    def verify_slot(self, running_slot: int, row: int) -> int:
        """Where a step that checks drafts keeps a request's state after its row `row` (0: its input token, i: its
        i-th draft), so that the state after its last accepted token can be restored from there. The last row's
        state is written to the request's own slot."""
        if not 0 <= row < self.verify_per_slot:
            raise ValueError(f"row {row} of a check has no state slot (num_speculative_tokens={self.verify_per_slot})")
        return self.num_running + self.num_snapshots + running_slot * self.verify_per_slot + row

    def take(self) -> int:
        if not self.free_running:
            raise RuntimeError("no state slot is free; a request was admitted beyond max_num_seqs")
        return self.free_running.popleft()

    def give_back(self, slot: int) -> None:
        self.free_running.append(slot)

    def snapshot_of(self, prefix_hash: int) -> int | None:
        """The slot holding the state after this prefix, marked as just used; None if there is none."""
        slot = self.snapshots.get(prefix_hash)
        if slot is not None:
            self.snapshots.move_to_end(prefix_hash)
        return slot

    def reserve(self, prefix_hash: int) -> int | None:
        """A slot for the state after this prefix, registered now (the step that computes it writes it before any
        later step reads it); None when it is kept already or there are no snapshot slots."""
        if prefix_hash in self.snapshots or not self.num_snapshots:
            return None
        if self.free_snapshots:
            slot = self.free_snapshots.popleft()
        else:
            _, slot = self.snapshots.popitem(last=False)  # evict the least recently used
        self.snapshots[prefix_hash] = slot
        return slot
