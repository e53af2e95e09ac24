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
"""

from collections import OrderedDict, deque
from dataclasses import dataclass

from engine.core.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()  # kept with the hash, so a hash collision never serves wrong KV
    parent: tuple[int, int] | None = None  # (block_id, serial) of the registered block before it in its chain
    serial: int = 0  # bumped at each registration, so a reused block id never passes for its old self


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}"
            )
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.empty_block_ids: deque[int] = deque(range(num_blocks))
        self.cached_free_block_ids: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self.hash_to_block_id: dict[int, int] = {}
        self.prefix_cache_queries = 0  # in tokens, as vLLM counts them
        self.prefix_cache_hits = 0

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.empty_block_ids) + len(self.cached_free_block_ids)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self.cached_free_block_ids)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add to `seq.block_table` so it can hold `num_new_tokens` more KV rows."""
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    # ---- prefix cache -------------------------------------------------------------------------
    def block_hashes(self, token_ids: list[int], num_blocks: int) -> list[int]:
        hashes, parent = [], None
        for i in range(num_blocks):
            parent = chain_hash(parent, tuple(token_ids[i * self.block_size : (i + 1) * self.block_size]))
            hashes.append(parent)
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Ids of the longest chain of cached full blocks that starts `seq`. Takes no references.

        The last token is never served from the cache: its logits must be computed. So at most
        (len - 1) // block_size blocks can match, and a fully cached prompt recomputes its last block.
        Likewise a request that wants prompt logprobs needs the logits of every prompt position it has
        no logprobs for yet (vLLM skips the cache for it): only blocks before those can match.
        """
        if not self.enable_prefix_caching:
            return []
        num_blocks = (len(seq) - 1) // self.block_size
        if seq.prompt_logprobs is not None:
            num_blocks = min(num_blocks, (len(seq.prompt_logprobs) - 1) // self.block_size)
        matched, parent = [], None
        for i, h in enumerate(self.block_hashes(seq.token_ids, num_blocks)):
            block_id = self.hash_to_block_id.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            # A hit must hold these very tokens and follow the very block matched before it, so
            # even a colliding hash can only miss, never serve another prefix's KV.
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            if block.token_ids != tokens or block.parent != parent:
                break
            matched.append(block_id)
            parent = (block_id, block.serial)
        return matched

    def can_admit(self, seq: Sequence, cached_block_ids: list[int], num_new_tokens: int) -> bool:
        # Matched blocks that sit in the free pool stop being free once taken.
        reclaimed = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        num_tokens = len(cached_block_ids) * self.block_size + num_new_tokens
        needed = -(-num_tokens // self.block_size) - len(cached_block_ids)
        return needed <= self.num_free_blocks - reclaimed

    def admit(self, seq: Sequence, cached_block_ids: list[int]) -> None:
        """Start `seq` (which holds no blocks) on its cached prefix."""
        if seq.block_table:
            raise RuntimeError(f"request {seq.request_id} already holds KV blocks")
        for block_id in cached_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.cached_free_block_ids[block_id]
            block.ref_count += 1
        seq.block_table = list(cached_block_ids)
        seq.num_computed_tokens = seq.num_cached_tokens = len(cached_block_ids) * self.block_size
        seq.num_registered_blocks = len(cached_block_ids)
        last = self.blocks[cached_block_ids[-1]] if cached_block_ids else None
        seq.chain_tail = (last.block_id, last.serial) if last else None
        self.prefix_cache_queries += len(seq)
        self.prefix_cache_hits += seq.num_cached_tokens

    # ---- allocation -------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"need {needed} KV blocks but only {self.num_free_blocks} are free")
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        if self.empty_block_ids:
            block_id = self.empty_block_ids.popleft()
        else:
            block_id, _ = self.cached_free_block_ids.popitem(last=False)  # evict least recently freed
            self._forget(self.blocks[block_id])
        self.blocks[block_id].ref_count = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Tail blocks go first in the LRU order: they are the least shareable."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than it was taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self.cached_free_block_ids[block_id] = None
                else:
                    self.empty_block_ids.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_registered_blocks = 0
        seq.chain_tail = None

    def register_full_blocks(self, seq: Sequence) -> None:
        """Register the full blocks of `seq` whose KV is computed, or is being written by the last
        step launched (every step that could read a shared block runs after that one on the
        device), and whose token ids the host knows (a pending token's block waits for it)."""
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        if not self.enable_prefix_caching or num_full <= seq.num_registered_blocks:
            return
        bs = self.block_size
        start = seq.num_registered_blocks
        parent_hash, parent_ref = self._chain_hash_upto(seq, start), seq.chain_tail
        for i in range(start, num_full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            block_hash = chain_hash(parent_hash, tokens)
            parent_ref = self._register(self.blocks[seq.block_table[i]], block_hash, tokens, parent_hash, parent_ref)
            parent_hash = block_hash
        seq.num_registered_blocks, seq.chain_tail = num_full, parent_ref

    def _register(
        self,
        block: Block,
        block_hash: int,
        tokens: tuple[int, ...],
        parent_hash: int | None,
        parent_ref: tuple[int, int] | None,
    ) -> tuple[int, int]:
        """Register `block` (just computed, after the block `parent_ref`) unless a block with the same
        KV is registered already. Returns the registered block holding that KV, the parent its
        sequence's next block registers under; or `block` itself when none can be found by a lookup."""
        own_ref = (block.block_id, block.serial)
        if parent_ref is not None and (
            self.hash_to_block_id.get(parent_hash) != parent_ref[0]
            or self.blocks[parent_ref[0]].serial != parent_ref[1]
        ):
            return own_ref  # the parent was evicted or is unregistered: no lookup reaches this block
        holder_id = self.hash_to_block_id.get(block_hash)
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
        block.hash, block.token_ids, block.parent = block_hash, tokens, parent_ref
        block.serial += 1
        self.hash_to_block_id[block_hash] = block.block_id
        return block.block_id, block.serial

    def _forget(self, block: Block) -> None:
        """Unregister `block`; the caller moves it to the empty pool if it is free."""
        del self.hash_to_block_id[block.hash]
        block.hash, block.token_ids, block.parent = None, (), None

    def _chain_hash_upto(self, seq: Sequence, num_blocks: int) -> int | None:
        if num_blocks == 0:
            return None
        last = self.blocks[seq.block_table[num_blocks - 1]]
        if last.hash is not None:
            return last.hash
        return self.block_hashes(seq.token_ids, num_blocks)[-1]
