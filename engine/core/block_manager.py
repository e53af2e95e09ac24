"""Paged KV blocks with a hash-chained prefix cache.

A block holds `block_size` consecutive tokens of one sequence's KV. Once a block is full and
the step writing its KV is launched (any step that reads it runs after that one on the device),
it is registered under a hash that chains the parent block's hash with the
block's token ids, so equal prefixes map to equal hash chains. Registered blocks are immutable
and can be shared: a sequence only ever writes into its own unregistered tail block.

A registered block also records its parent block, and a lookup follows only those links, so a
colliding hash can only miss. A sequence that computed a block already registered (a fully
cached prompt's last block, which is computed again for its logits; the same prompt in the same
step) keeps its copy unregistered, and its next blocks name the registered block as their parent:
its KV is the same, and it is the one a lookup finds.

Free blocks come in two kinds: empty ones, and cached ones that still hold a registered hash.
Allocation takes empty blocks first and then evicts cached ones, least recently freed first.

KV-cache groups (vLLM v1's hybrid KV-cache manager, in short). A model whose layers attend differently (Gemma 3:
five sliding-window layers to one global) has its layers in groups of one kind, each group with its own block
table per sequence, all drawing on this one pool: a block id holds one group's KV (engine/runner/kv_cache.py
shares each cache tensor among the groups). A sliding-window group releases the blocks no query of the sequence
will see again (`release_out_of_window`), so at long context it holds about its window, not the whole history.
A prefix-cache hit must cover what every group needs: the whole prefix in a full group, and the blocks of the
last `window` positions before the hit point in a sliding one. Hashes are per group: the same tokens in two
groups are two blocks.
"""

from collections import OrderedDict, deque
from dataclasses import dataclass

from engine.core.sequence import Sequence
from engine.core.state_slots import StateSlots

NO_BLOCK = -1  # a block-table entry whose block a sliding-window group has released


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    group: int = 0  # the KV-cache group whose KV it holds (while in use, or registered)
    token_ids: tuple[int, ...] = ()  # kept with the hash, so a hash collision never serves wrong KV
    parent: tuple[int, int] | None = None  # (block_id, serial) of the registered block before it in its chain
    serial: int = 0  # bumped at each registration, so a reused block id never passes for its old self


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        group_windows: tuple[int | None, ...] = (None,),
        states: StateSlots | None = None,
    ):
        """`group_windows`: each KV-cache group's sliding window in tokens, or None for full attention.
        `states`: a hybrid model's recurrent-state slots (engine/core/state_slots.py), one per running sequence,
        and the snapshots a prefix hit starts from."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}"
            )
        if not group_windows or any(w is not None and w < 1 for w in group_windows):
            raise ValueError(
                f"each KV-cache group has no window (None) or one of at least 1 token, got {group_windows}"
            )
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = tuple(group_windows)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.empty_block_ids: deque[int] = deque(range(num_blocks))
        self.cached_free_block_ids: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self.hash_to_block_id: dict[tuple[int, int], int] = {}  # (group, chain hash) -> block id
        self.prefix_cache_queries = 0  # in tokens, as vLLM counts them
        self.prefix_cache_hits = 0
        self.used_blocks_per_group = [0] * len(self.group_windows)  # blocks some sequence holds, by group
        self.states = states
        if states is not None and states.snapshot_tokens % block_size:
            raise ValueError(
                f"state snapshots every {states.snapshot_tokens} tokens fall inside {block_size}-token blocks"
            )

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_free_blocks(self) -> int:
        return len(self.empty_block_ids) + len(self.cached_free_block_ids)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self.cached_free_block_ids)

    def new_tables(self, seq: Sequence) -> None:
        """Give `seq` one empty block table per group."""
        groups = self.num_groups
        seq.block_tables, seq.chain_tails, seq.num_released_blocks = (
            [[] for _ in range(groups)],
            [None] * groups,
            [0] * groups,
        )

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add to `seq`'s block tables (one in each group per block of positions) so they can hold
        `num_new_tokens` more KV rows."""
        total = seq.num_computed_tokens + num_new_tokens
        return self.num_groups * max(0, -(-total // self.block_size) - len(seq.block_tables[0]))

    # ---- prefix cache -------------------------------------------------------------------------
    def block_hashes(self, token_ids: list[int], num_blocks: int) -> list[int]:
        hashes, parent = [], None
        for i in range(num_blocks):
            parent = chain_hash(parent, tuple(token_ids[i * self.block_size : (i + 1) * self.block_size]))
            hashes.append(parent)
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[list[int]]:
        """Per group, the block ids of the longest cached prefix that every group can serve: the same number of
        entries in each, NO_BLOCK where a sliding-window group needs none. Takes no references.

        The last token is never served from the cache: its logits must be computed. So at most
        (len - 1) // block_size blocks can match, and a fully cached prompt recomputes its last block.
        Likewise a request that wants prompt logprobs needs the logits of every prompt position it has
        no logprobs for yet (vLLM skips the cache for it): only blocks before those can match.
        """
        none: list[list[int]] = [[] for _ in self.group_windows]
        if not self.enable_prefix_caching:
            return none
        num_blocks = (len(seq) - 1) // self.block_size
        if seq.prompt_logprobs is not None:
            num_blocks = min(num_blocks, (len(seq.prompt_logprobs) - 1) // self.block_size)
        hashes = self.block_hashes(seq.token_ids, num_blocks)
        found = [self._cached_blocks(seq, g, hashes, window is None) for g, window in enumerate(self.group_windows)]
        # The longest hit every group serves: all of a full group's blocks before it, a sliding group's last ones
        # (the blocks a query at the hit sees: a run of cached blocks ending just before it, as long as the window)
        hit = min((len(ids) for ids, w in zip(found, self.group_windows) if w is None), default=num_blocks)
        if self.states is not None:  # recurrent layers start from a snapshot: the newest at or before the hit
            hit = self._snapshot_before(hashes, hit)
        runs = [None if w is None else _cached_runs(ids) for ids, w in zip(found, self.group_windows)]
        while hit > 0 and not all(
            run is None or hit - self._first_seen(hit * self.block_size, w) <= run[hit - 1]
            for run, w in zip(runs, self.group_windows)
        ):
            hit -= 1
        if hit == 0:
            return none
        return [
            ids[:hit]
            if w is None
            else [NO_BLOCK] * (first := self._first_seen(hit * self.block_size, w)) + ids[first:hit]
            for ids, w in zip(found, self.group_windows)
        ]

    def _snapshot_before(self, hashes: list[int], hit: int) -> int:
        """The most blocks up to `hit` whose prefix has a state snapshot (0: none)."""
        every = self.states.snapshot_tokens // self.block_size
        for blocks in range(hit - hit % every, 0, -every) if every else ():
            if hashes[blocks - 1] in self.states.snapshots:
                return blocks
        return 0

    def plan_snapshots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """The snapshots `seq`'s next step writes: (tokens into the step, slot) at each multiple of the snapshot
        interval it reaches within its known tokens, each slot reserved now under the prefix's hash."""
        every = self.states.snapshot_tokens if self.states is not None and self.states.num_snapshots else 0
        start, end = seq.num_computed_tokens, min(seq.num_computed_tokens + num_new_tokens, len(seq.token_ids))
        if not every or end // every == start // every:
            return []
        planned = []
        for position in range((start // every + 1) * every, end + 1, every):
            slot = self.states.reserve(self.block_hashes(seq.token_ids, position // self.block_size)[-1])
            if slot is not None:
                planned.append((position - start, slot))
        return planned

    def _first_seen(self, position: int, window: int) -> int:
        """The first block a query at `position` sees through a sliding window of `window` positions."""
        return max(0, position - window + 1) // self.block_size

    def _cached_blocks(self, seq: Sequence, group: int, hashes: list[int], prefix_only: bool) -> list[int]:
        """Group `group`'s cached blocks for `hashes`, NO_BLOCK where it has none; for a full group
        (`prefix_only`), only those before its first miss. A hit must hold these very tokens and follow the very
        block matched before it (where that one matched), so a colliding hash can only miss, never serve another
        prefix's KV. A block whose own parent has been evicted is taken on its hash alone, as after a miss: once
        its prefix was computed again elsewhere, refusing it made a sequence's registered blocks unreachable."""
        ids: list[int] = []
        for i, h in enumerate(hashes):
            block_id = self.hash_to_block_id.get((group, h))
            block = self.blocks[block_id] if block_id is not None else None
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            before = ids[-1] if ids else None
            parent = None if before in (None, NO_BLOCK) else (before, self.blocks[before].serial)
            if (
                block is None
                or block.token_ids != tokens
                or (before != NO_BLOCK and block.parent != parent and self._registered(block.parent))
            ):
                if prefix_only:
                    break
                ids.append(NO_BLOCK)
                continue
            ids.append(block_id)
        return ids

    def _registered(self, ref: tuple[int, int] | None) -> bool:
        """Whether `ref` (a block id and serial; None: no parent, a first block) still names a registered block."""
        return ref is None or (self.blocks[ref[0]].serial == ref[1] and self.blocks[ref[0]].hash is not None)

    def can_admit(self, seq: Sequence, cached: list[list[int]], num_new_tokens: int) -> bool:
        # Matched blocks that sit in the free pool stop being free once taken.
        reclaimed = sum(1 for ids in cached for b in ids if b != NO_BLOCK and self.blocks[b].ref_count == 0)
        hit = len(cached[0])
        num_tokens = hit * self.block_size + num_new_tokens
        needed = self.num_groups * (-(-num_tokens // self.block_size) - hit)
        has_state = self.states is None or bool(self.states.free_running)
        return needed <= self.num_free_blocks - reclaimed and has_state

    def admit(self, seq: Sequence, cached: list[list[int]]) -> None:
        """Start `seq` (which holds no blocks) on its cached prefix (find_cached_prefix's)."""
        if any(seq.block_tables):
            raise RuntimeError(f"request {seq.request_id} already holds KV blocks")
        self.new_tables(seq)
        hit = len(cached[0])
        if self.states is not None:
            seq.state_slot = self.states.take()
            if hit:  # find_cached_prefix stopped the hit where a snapshot is
                seq.restore_slot = self.states.snapshot_of(self.block_hashes(seq.token_ids, hit)[-1])
        for g, ids in enumerate(cached):
            for block_id in ids:
                if block_id == NO_BLOCK:
                    continue
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.cached_free_block_ids[block_id]
                    self.used_blocks_per_group[g] += 1
                block.ref_count += 1
            seq.block_tables[g] = list(ids)
            seq.num_released_blocks[g] = sum(1 for b in ids if b == NO_BLOCK)
            last = self.blocks[ids[-1]] if ids and ids[-1] != NO_BLOCK else None
            seq.chain_tails[g] = (last.block_id, last.serial) if last else None
        seq.num_computed_tokens = seq.num_cached_tokens = hit * self.block_size
        seq.num_registered_blocks = hit
        seq.registered_hash = (
            next((self.blocks[ids[-1]].hash for ids in cached if ids and ids[-1] != NO_BLOCK), None) if hit else None
        )
        if hit and seq.registered_hash is None:
            seq.registered_hash = self.block_hashes(seq.token_ids, hit)[-1]
        self.prefix_cache_queries += len(seq)
        self.prefix_cache_hits += seq.num_cached_tokens

    # ---- allocation -------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"need {needed} KV blocks but only {self.num_free_blocks} are free")
        for _ in range(needed // self.num_groups):
            for group, table in enumerate(seq.block_tables):
                table.append(self._take_free_block(group))

    def release_out_of_window(self, seq: Sequence) -> None:
        """Give back the blocks of `seq`'s sliding-window groups that its next query (at position
        num_computed_tokens) and every later one can no longer see. Registered ones stay cached for others."""
        for g, window in enumerate(self.group_windows):
            if window is None:
                continue
            table, first = seq.block_tables[g], self._first_seen(seq.num_computed_tokens, window)
            for i in range(seq.num_released_blocks[g], min(first, len(table))):
                if table[i] != NO_BLOCK:
                    self._release(table[i])
                    table[i] = NO_BLOCK
            seq.num_released_blocks[g] = max(seq.num_released_blocks[g], min(first, len(table)))

    def _take_free_block(self, group: int) -> int:
        if self.empty_block_ids:
            block_id = self.empty_block_ids.popleft()
        else:
            block_id, _ = self.cached_free_block_ids.popitem(last=False)  # evict least recently freed
            self._forget(self.blocks[block_id])
        block = self.blocks[block_id]
        block.ref_count, block.group = 1, group
        self.used_blocks_per_group[group] += 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} freed more often than it was taken")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.used_blocks_per_group[block.group] -= 1
            if block.hash is not None:
                self.cached_free_block_ids[block_id] = None
            else:
                self.empty_block_ids.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Tail blocks go first in the LRU order: they are the least shareable."""
        for table in seq.block_tables:
            for block_id in reversed(table):
                if block_id != NO_BLOCK:
                    self._release(block_id)
        self.new_tables(seq)
        seq.num_computed_tokens = seq.num_registered_blocks = 0
        seq.registered_hash = None
        if seq.state_slot is not None:
            self.states.give_back(seq.state_slot)
            seq.state_slot = seq.restore_slot = None

    def register_full_blocks(self, seq: Sequence) -> None:
        """Register the full blocks of `seq` whose KV is computed, or is being written by the last
        step launched (every step that could read a shared block runs after that one on the
        device), and whose token ids the host knows (a pending token's block waits for it)."""
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        if not self.enable_prefix_caching or num_full <= seq.num_registered_blocks:
            return
        bs = self.block_size
        start = seq.num_registered_blocks
        parent_hash = seq.registered_hash
        for i in range(start, num_full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            block_hash = chain_hash(parent_hash, tokens)
            for g, table in enumerate(seq.block_tables):
                if table[i] == NO_BLOCK:  # released before it was registered: the chain ends here in this group
                    seq.chain_tails[g] = None
                    continue
                seq.chain_tails[g] = self._register(
                    self.blocks[table[i]], g, block_hash, tokens, parent_hash, seq.chain_tails[g] if i else None
                )
            parent_hash = block_hash
        seq.num_registered_blocks, seq.registered_hash = num_full, parent_hash

    def _register(
        self,
        block: Block,
        group: int,
        block_hash: int,
        tokens: tuple[int, ...],
        parent_hash: int | None,
        parent_ref: tuple[int, int] | None,
    ) -> tuple[int, int] | None:
        """Register `block` (just computed in `group`, after the block `parent_ref`) unless a block with the
        same KV is registered already. Returns the registered block holding that KV, the parent its
        sequence's next block registers under; or `block` itself when none can be found by a lookup."""
        own_ref = (block.block_id, block.serial)
        if parent_hash is not None and (
            parent_ref is None
            or self.hash_to_block_id.get((group, parent_hash)) != parent_ref[0]
            or self.blocks[parent_ref[0]].serial != parent_ref[1]
        ):
            return own_ref  # the parent was evicted or is unregistered: no lookup reaches this block
        holder_id = self.hash_to_block_id.get((group, block_hash))
        if holder_id is not None:
            holder = self.blocks[holder_id]
            if holder.parent == parent_ref:
                if holder.token_ids == tokens:  # the same tokens after the same block: the same KV
                    return holder.block_id, holder.serial
                return own_ref  # a hash collision: the block registered first keeps the hash
            # The holder hangs off another parent than the one a lookup of this prefix finds (its
            # parent was evicted, and computed again since), so no lookup can reach it: replace it.
            self._forget(holder)
            if holder.ref_count == 0:
                del self.cached_free_block_ids[holder.block_id]
                self.empty_block_ids.append(holder.block_id)
        block.hash, block.group, block.token_ids, block.parent = block_hash, group, tokens, parent_ref
        block.serial += 1
        self.hash_to_block_id[(group, block_hash)] = block.block_id
        return block.block_id, block.serial

    def _forget(self, block: Block) -> None:
        """Unregister `block`; the caller moves it to the empty pool if it is free."""
        del self.hash_to_block_id[(block.group, block.hash)]
        block.hash, block.token_ids, block.parent = None, (), None


def _cached_runs(ids: list[int]) -> list[int]:
    """For each entry, how many cached blocks (not NO_BLOCK) end there in a row."""
    runs, run = [], 0
    for block_id in ids:
        run = run + 1 if block_id != NO_BLOCK else 0
        runs.append(run)
    return runs
