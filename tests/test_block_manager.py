"""BlockManager and Sequence under random operation sequences, plus a few targeted unit tests.

The state machine drives the block manager the way the scheduler and engine do (admit on the
cached prefix, allocate a chunk, compute it, register full blocks, sample, preempt, free) and
keeps a shadow copy of what each KV slot holds: the token prefix it was computed from. Besides
the bookkeeping invariants, that catches the bug that matters most: a sequence attending over
KV that was computed for different tokens. It runs with one full-attention group, and with KV-cache groups
(a full and a sliding-window one, a sliding one alone) whose out-of-window blocks are released.
"""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import engine.core.block_manager as block_manager_module
from engine.core.block_manager import NO_BLOCK, BlockManager, chain_hash
from engine.core.sequence import Sequence
from engine.front.sampling_params import SamplingParams

BS = 4
NUM_BLOCKS = 8
# A few shared prefixes over a tiny alphabet, so prompts share blocks often and partially.
PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 9, 0, 0], [2, 2, 2, 2, 2, 2, 2, 2, 2]]


def first_seen(position: int, window: int | None) -> int:
    """The first block a query at `position` sees (0 for full attention)."""
    return 0 if window is None else max(0, position - window + 1) // BS


class BlockManagerMachine(RuleBasedStateMachine):
    enable_prefix_caching = True
    group_windows: tuple[int | None, ...] = (None,)

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS, self.enable_prefix_caching, self.group_windows)
        self.group_windows_range = range(len(self.group_windows))
        self.running: list[Sequence] = []
        self.pending: dict[int, int] = {}  # seq_id -> tokens allocated but not computed yet
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, slot) -> the token prefix its KV encodes
        # Registrations ((block, serial)) seen after the last rule, and how many times one has ended since
        # (an eviction), in total and when each running sequence was admitted.
        self.registrations: set[tuple[int, int]] = set()
        self.num_lost_registrations = 0
        self.lost_registrations_at_admission: dict[int, int] = {}

    # ---- helpers ----------------------------------------------------------------------------------
    def _snapshot(self):
        bm = self.bm
        return (
            [(b.ref_count, b.hash) for b in bm.blocks],
            list(bm.empty_block_ids),
            list(bm.cached_free_block_ids),
            dict(bm.hash_to_block_id),
        )

    def _try_admit(self, seq: Sequence, chunk: int) -> None:
        bm = self.bm
        cached = bm.find_cached_prefix(seq)
        hit = len(cached[0])
        assert len(cached) == bm.num_groups and all(len(ids) == hit for ids in cached)
        assert hit <= (len(seq) - 1) // BS  # the last token is always computed
        for ids, window in zip(cached, self.group_windows):
            # every block the next query sees is served, and a hit serves exactly this sequence's KV
            assert NO_BLOCK not in ids[first_seen(hit * BS, window) :]
            for i, block_id in enumerate(ids):
                for slot in range(BS if block_id != NO_BLOCK else 0):
                    assert self.kv[(block_id, slot)] == tuple(seq.token_ids[: i * BS + slot + 1])
        n = min(len(seq) - hit * BS, chunk)
        before = self._snapshot()
        hits_before = bm.prefix_cache_hits
        if not bm.can_admit(seq, cached, n):
            assert self._snapshot() == before
            return
        bm.admit(seq, cached)
        bm.allocate(seq, n)
        assert bm.prefix_cache_hits - hits_before == hit * BS == seq.num_cached_tokens
        self.running.append(seq)
        self.pending[seq.seq_id] = n
        self.lost_registrations_at_admission[seq.seq_id] = self.num_lost_registrations

    def _free(self, seq: Sequence) -> None:
        self.bm.free(seq)
        assert not any(seq.block_tables) and seq.num_computed_tokens == 0
        self.running.remove(seq)
        del self.pending[seq.seq_id]

    # ---- rules -------------------------------------------------------------------------------------
    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(0, 3), min_size=1, max_size=7),
        chunk=st.integers(1, 24),
    )
    def add(self, prefix, tail, chunk):
        self._try_admit(Sequence(prefix + tail, SamplingParams()), chunk)

    @precondition(lambda self: any(self.pending[s.seq_id] for s in self.running))
    @rule(pick=st.integers(0, 100), token=st.integers(0, 3))
    def compute(self, pick, token):
        """Run the model on a sequence's scheduled chunk: write its KV, register, maybe sample."""
        seqs = [s for s in self.running if self.pending[s.seq_id]]
        seq = seqs[pick % len(seqs)]
        n = self.pending[seq.seq_id]
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            for table in seq.block_tables:
                block = self.bm.blocks[table[pos // BS]]
                # A sequence only ever writes into its own unshared, unregistered blocks.
                assert block.ref_count == 1 and block.hash is None, (block, pos)
                self.kv[(block.block_id, pos % BS)] = tuple(seq.token_ids[: pos + 1])
        seq.num_computed_tokens += n
        self.pending[seq.seq_id] = 0
        self.bm.register_full_blocks(seq)
        if seq.num_computed_tokens == len(seq):
            seq.token_ids.append(token)

    @precondition(lambda self: any(not self.pending[s.seq_id] for s in self.running))
    @rule(pick=st.integers(0, 100), chunk=st.integers(1, 24))
    def schedule(self, pick, chunk):
        seqs = [s for s in self.running if not self.pending[s.seq_id]]
        seq = seqs[pick % len(seqs)]
        n = min(seq.num_uncomputed_tokens, chunk)
        self.bm.release_out_of_window(seq)  # as the scheduler does, first
        if self.bm.can_allocate(seq, n):
            self.bm.allocate(seq, n)
            self.pending[seq.seq_id] = n
        else:
            before = self._snapshot()
            with pytest.raises(RuntimeError):
                self.bm.allocate(seq, n)
            assert self._snapshot() == before

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100))
    def finish(self, pick):
        self._free(self.running[pick % len(self.running)])

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100), chunk=st.integers(1, 24))
    def preempt(self, pick, chunk):
        """Free a sequence mid-flight and re-admit it with its output so far, as the scheduler does."""
        seq = self.running[pick % len(self.running)]
        self._free(seq)
        self._try_admit(seq, chunk)

    # ---- invariants --------------------------------------------------------------------------------
    @invariant()
    def free_and_used_blocks_are_disjoint_and_complete(self):
        bm = self.bm
        empty, cached_free = list(bm.empty_block_ids), list(bm.cached_free_block_ids)
        free = set(empty) | set(cached_free)
        assert len(empty) + len(cached_free) == len(free), "a block is listed twice in the free pools"
        assert free == {b.block_id for b in bm.blocks if b.ref_count == 0}
        assert bm.num_free_blocks == len(free)
        assert all(bm.blocks[b].hash is None for b in empty)
        assert all(bm.blocks[b].hash is not None for b in cached_free)

    @invariant()
    def ref_counts_equal_references(self):
        counts = [0] * NUM_BLOCKS
        for seq in self.running:
            for table in seq.block_tables:
                for block_id in table:
                    counts[block_id] += block_id != NO_BLOCK
        assert [b.ref_count for b in self.bm.blocks] == counts  # so never negative, never leaked
        held = [
            {b for seq in self.running for b in seq.block_tables[g] if b != NO_BLOCK} for g in self.group_windows_range
        ]
        assert self.bm.used_blocks_per_group == [len(ids) for ids in held]
        assert all(self.bm.blocks[b].group == g for g, ids in enumerate(held) for b in ids)

    @invariant()
    def hash_table_is_consistent(self):
        bm = self.bm
        registered = {b.block_id for b in bm.blocks if b.hash is not None}
        assert set(bm.hash_to_block_id.values()) == registered
        for (group, h), block_id in bm.hash_to_block_id.items():
            block = bm.blocks[block_id]
            assert block.hash == h and block.group == group
            assert len(block.token_ids) == BS
            assert tuple(self.kv[(block_id, slot)][-1] for slot in range(BS)) == block.token_ids
        if not self.enable_prefix_caching:
            assert not registered

    @invariant()
    def sequences_see_their_own_kv(self):
        for seq in self.running:
            pending = self.pending[seq.seq_id]
            assert seq.num_registered_blocks <= seq.num_computed_tokens // BS
            for table, window in zip(seq.block_tables, self.group_windows):
                assert len(table) == -(-(seq.num_computed_tokens + pending) // BS)
                # a sliding group holds what its next query sees, and may have released what is before it
                seen = first_seen(seq.num_computed_tokens, window)
                assert NO_BLOCK not in table[seen:]
                for pos in range(seq.num_computed_tokens):
                    if table[pos // BS] != NO_BLOCK:
                        assert self.kv[(table[pos // BS], pos % BS)] == tuple(seq.token_ids[: pos + 1])

    @invariant()
    def registered_blocks_are_found_until_something_is_evicted(self):
        """A lookup of a running sequence's registered blocks finds as many blocks, as long as no
        registration has ended since it was admitted. It failed when the sequence had computed a copy
        of a registered block (a fully cached prompt's last block, or the same prompt computed twice):
        the blocks after the copy named the unregistered copy as their parent, and never hit."""
        bm = self.bm
        registrations = {(b.block_id, b.serial) for b in bm.blocks if b.hash is not None}
        if not self.registrations <= registrations:
            self.num_lost_registrations += 1
        self.registrations = registrations
        for seq in self.running:
            if self.lost_registrations_at_admission[seq.seq_id] == self.num_lost_registrations:
                n = seq.num_registered_blocks
                lookup = Sequence(seq.token_ids[: n * BS] + [0], SamplingParams())
                assert len(bm.find_cached_prefix(lookup)[0]) == (n if self.enable_prefix_caching else 0)

    @invariant()
    def counters(self):
        bm = self.bm
        assert 0 <= bm.prefix_cache_hits <= bm.prefix_cache_queries
        assert bm.prefix_cache_hits % BS == 0

    def teardown(self):
        for seq in list(self.running):
            self._free(seq)
        bm = self.bm
        assert bm.num_free_blocks == NUM_BLOCKS
        assert all(b.ref_count == 0 for b in bm.blocks)
        self.free_and_used_blocks_are_disjoint_and_complete()


class BlockManagerWithoutCachingMachine(BlockManagerMachine):
    enable_prefix_caching = False


class FullAndSlidingGroupsMachine(BlockManagerMachine):
    """Gemma-like: a full-attention group and a sliding one whose window (6) is shorter than most prompts."""

    group_windows = (None, 6)


class SlidingGroupOnlyMachine(BlockManagerMachine):
    """Mistral-like: every layer slides, with a window (5) that is no whole number of blocks."""

    group_windows = (5,)


def test_equal_tokens_after_another_prefix_are_a_miss_even_when_hashes_collide(monkeypatch):
    """A hash that forgets the parent makes block [5, 6, 7, 8] after [1, 2, 3, 4] collide with the
    same tokens at position 0. Its KV encodes a different prefix, so the parent check must refuse it."""
    monkeypatch.setattr(block_manager_module, "chain_hash", lambda parent, tokens: hash(tokens))
    bm = BlockManager(num_blocks=8, block_size=4)
    a = run_to_completion(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.find_cached_prefix(Sequence([5, 6, 7, 8, 0], SamplingParams()))[0] == []
    assert bm.find_cached_prefix(Sequence([1, 2, 3, 4, 5, 6, 7, 8, 0], SamplingParams()))[0] == a.block_table[:2]


def test_the_real_hash_chains_the_parent_so_a_block_is_cached_after_each_of_its_prefixes():
    """The test above swaps in a hash without the parent; the real one must keep it. Without it, equal
    tokens after different prefixes share one hash: the parent check keeps the KV right, but the two
    blocks take the hash from each other, and one of the prefixes always misses."""
    tokens = (5, 6, 7, 8)
    assert chain_hash(None, tokens) != chain_hash(chain_hash(None, (1, 2, 3, 4)), tokens)
    bm = BlockManager(num_blocks=8, block_size=4)
    first, second = bm.block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 2), bm.block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 2)
    assert first[0] != second[0] and first[1] != second[1]  # a different first block changes every later hash

    alone = run_to_completion(bm, [5, 6, 7, 8, 9])
    after = run_to_completion(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    alone_blocks, after_blocks = alone.block_table[:1], after.block_table[:2]
    bm.free(alone)
    bm.free(after)
    assert bm.find_cached_prefix(Sequence([5, 6, 7, 8, 0], SamplingParams()))[0] == alone_blocks
    assert bm.find_cached_prefix(Sequence([1, 2, 3, 4, 5, 6, 7, 8, 0], SamplingParams()))[0] == after_blocks


_settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = _settings
TestBlockManagerWithoutCachingStateful = BlockManagerWithoutCachingMachine.TestCase
TestBlockManagerWithoutCachingStateful.settings = settings(_settings, max_examples=40)
TestFullAndSlidingGroupsStateful = FullAndSlidingGroupsMachine.TestCase
TestFullAndSlidingGroupsStateful.settings = _settings
TestSlidingGroupOnlyStateful = SlidingGroupOnlyMachine.TestCase
TestSlidingGroupOnlyStateful.settings = _settings


# ---- unit tests ----------------------------------------------------------------------------------
def run_to_completion(bm: BlockManager, token_ids: list[int]) -> Sequence:
    """Admit, allocate and compute a whole prompt, registering its full blocks."""
    seq = Sequence(token_ids, SamplingParams())
    cached = bm.find_cached_prefix(seq)
    bm.admit(seq, cached)
    n = len(seq) - seq.num_computed_tokens
    bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.register_full_blocks(seq)
    return seq


def test_cached_free_blocks_are_evicted_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = run_to_completion(bm, [1, 2, 3, 4])  # blocks 0, 1, both registered
    b = run_to_completion(bm, [5, 6, 7, 8])  # blocks 2, 3
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    bm.free(b)
    bm.free(a)
    # Tail blocks go first within a sequence (they are the least shareable); b was freed before a.
    assert list(bm.cached_free_block_ids) == [3, 2, 1, 0]
    assert bm.num_free_blocks == 4 and bm.num_cached_free_blocks == 4

    # Reusing a's first block refreshes it: it leaves the pool and comes back last.
    c = run_to_completion(bm, [1, 2, 9])
    assert c.block_table[0] == 0 and c.num_cached_tokens == 2
    assert c.block_table[1] == 3  # the oldest cached free block was evicted for the new tail
    assert bm.blocks[3].hash is None and bm.blocks[3].token_ids == ()
    assert (7, 8) not in [blk.token_ids for blk in bm.blocks]
    bm.free(c)
    assert list(bm.cached_free_block_ids) == [2, 1, 0]
    assert list(bm.empty_block_ids) == [3]

    # The evicted block's prefix is gone; the others still hit.
    assert bm.find_cached_prefix(Sequence([5, 6, 7, 8, 1], SamplingParams()))[0] == [2]
    assert bm.find_cached_prefix(Sequence([1, 2, 3, 4, 1], SamplingParams()))[0] == [0, 1]


def test_empty_blocks_are_used_before_cached_ones_are_evicted():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = run_to_completion(bm, [1, 2, 3])  # block 0 registered, block 1 partial
    bm.free(a)
    assert list(bm.cached_free_block_ids) == [0] and sorted(bm.empty_block_ids) == [1, 2, 3]
    b = run_to_completion(bm, [7, 7, 7, 7, 7])
    assert 0 not in b.block_table and len(b.block_table) == 3
    assert bm.find_cached_prefix(Sequence([1, 2, 3], SamplingParams()))[0] == [0]


def test_hash_collision_never_serves_another_prompts_blocks(monkeypatch):
    monkeypatch.setattr(block_manager_module, "chain_hash", lambda parent, tokens: 42)
    bm = BlockManager(num_blocks=8, block_size=4)
    a = run_to_completion(bm, [1, 2, 3, 4, 5])
    first_block = a.block_table[0]
    assert bm.hash_to_block_id == {(0, 42): first_block}
    bm.free(a)
    other = Sequence([9, 9, 9, 9, 5], SamplingParams())
    assert bm.find_cached_prefix(other)[0] == []  # same hash, different tokens: a miss
    bm.admit(other, [[]])
    assert other.num_cached_tokens == 0 and bm.prefix_cache_hits == 0
    same = Sequence([1, 2, 3, 4, 6], SamplingParams())
    assert bm.find_cached_prefix(same)[0] == [first_block]


def test_prefix_caching_off_never_hits_or_registers():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = run_to_completion(bm, [1, 2, 3, 4, 5])
    assert bm.hash_to_block_id == {} and all(b.hash is None for b in bm.blocks)
    bm.free(a)
    assert bm.find_cached_prefix(Sequence([1, 2, 3, 4, 5], SamplingParams()))[0] == []
    assert bm.num_cached_free_blocks == 0 and bm.num_free_blocks == 4


def test_can_admit_counts_matched_blocks_that_leave_the_free_pool():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = run_to_completion(bm, [1, 2, 3, 4, 5])  # 3 blocks, the first two registered
    registered = a.block_table[:2]
    bm.free(a)
    seq = Sequence([1, 2, 3, 4, 6, 7, 8], SamplingParams())
    cached = bm.find_cached_prefix(seq)
    assert cached == [registered]
    # 3 tokens to compute need 2 more blocks, but taking the 2 cached ones leaves only 1 free.
    assert not bm.can_admit(seq, cached, 3)
    assert bm.can_admit(seq, cached, 2)


def test_misuse_raises_instead_of_corrupting_the_pools():
    bm = BlockManager(num_blocks=2, block_size=2)
    seq = Sequence([1, 2, 3], SamplingParams())
    bm.admit(seq, [[]])
    with pytest.raises(RuntimeError, match="need 3 KV blocks but only 2 are free"):
        bm.allocate(seq, 5)
    assert bm.num_free_blocks == 2 and seq.block_table == []
    bm.allocate(seq, 3)
    with pytest.raises(RuntimeError, match="already holds KV blocks"):
        bm.admit(seq, [[]])
    stale_table = list(seq.block_table)
    bm.free(seq)
    assert bm.num_free_blocks == 2
    seq.block_table = stale_table  # a second free of the same blocks
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free(seq)
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=16)


def compute_more(bm: BlockManager, seq: Sequence, token_ids: list[int]) -> None:
    """Append tokens to a computed sequence and compute them, as its decode steps would."""
    seq.token_ids.extend(token_ids)
    n = len(seq) - seq.num_computed_tokens
    bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.register_full_blocks(seq)


def test_blocks_after_a_recomputed_copy_are_found_and_a_stale_holder_of_their_hash_is_replaced():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = run_to_completion(bm, [1, 2, 3, 4, 5, 6, 7, 8])
    # The same prompt again: its last block is computed again (its logits are needed), into a copy.
    b = Sequence([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams())
    bm.admit(b, bm.find_cached_prefix(b))
    assert b.block_table == a.block_table[:1]
    compute_more(bm, b, [])
    copy = b.block_table[1]
    assert copy != a.block_table[1] and bm.blocks[copy].hash is None
    compute_more(bm, b, [9, 10, 11, 12])  # b's answer fills a block
    answer_block = b.block_table[2]
    assert bm.blocks[answer_block].parent == (a.block_table[1], bm.blocks[a.block_table[1]].serial)
    assert bm.find_cached_prefix(Sequence(list(range(1, 13)) + [0], SamplingParams()))[0] == [
        *a.block_table,
        answer_block,
    ]

    # a ends, and its last block (which b's answer block names as parent) is evicted while b runs on.
    bm.free(a)
    other = run_to_completion(bm, list(range(20, 37)))  # 5 blocks: 4 empty ones, then the evicted one
    bm.free(other)
    assert bm.find_cached_prefix(Sequence(list(range(1, 13)) + [0], SamplingParams()))[0] == [0]

    # The prompt computed again registers its second block anew, and the answer block's hash, whose
    # holder hangs off the evicted block, goes to the new copy: the whole prefix hits again.
    c = Sequence(list(range(1, 13)) + [0], SamplingParams())
    bm.admit(c, bm.find_cached_prefix(c))
    compute_more(bm, c, [])
    assert bm.blocks[answer_block].hash is None
    assert bm.find_cached_prefix(Sequence(list(range(1, 13)) + [0], SamplingParams()))[0] == c.block_table[:3]


def test_a_block_whose_parent_was_evicted_is_found_after_its_prefix_is_computed_again():
    """A sliding window releases a sequence's first block while it still holds the second; the first is evicted,
    then computed again by another request. A lookup of the prefix found the new first block and then refused the
    held second one, whose recorded parent is gone: registering a block made the cache serve less (found by
    TestSlidingGroupOnlyStateful on CI)."""
    bm = BlockManager(num_blocks=4, block_size=4, group_windows=(5,))
    held = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams())
    bm.admit(held, bm.find_cached_prefix(held))
    bm.allocate(held, 9)
    held.num_computed_tokens = 9
    bm.register_full_blocks(held)
    first, second = held.block_tables[0][:2]
    bm.release_out_of_window(held)  # a query at position 9 sees positions 5..9: the first block is out
    assert held.block_tables[0][0] == NO_BLOCK
    bm.free(run_to_completion(bm, [7, 7, 7, 7, 0]))  # takes the free blocks, evicting the first one
    assert bm.blocks[first].hash is None or bm.blocks[first].token_ids != (1, 2, 3, 4)
    run_to_completion(bm, [1, 2, 3, 4, 0])
    lookup = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 0], SamplingParams())
    assert bm.find_cached_prefix(lookup) == [[NO_BLOCK, second]]
