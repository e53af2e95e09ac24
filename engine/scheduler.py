"""Continuous batching with chunked prefill and preemption by recompute.

Every step builds one batch under a token budget (`max_num_batched_tokens`). Running requests
come first, oldest first: a decode costs one token, an unfinished prefill takes what the budget
leaves. Then waiting requests are admitted first come, first served, starting on their cached
prefix. When KV blocks run out, the newest running request is preempted: its blocks are freed
and it goes back to the front of the queue, to be recomputed later. Nothing is ever dropped.

With asynchronous scheduling a step is planned while the previous one still runs, so some
sampled tokens are pending (see `Sequence`). A pending token is planned as the next step's
input; a request whose pending tokens reach its length limit gets no further step; and a
preempted request is readmitted only once its pending token has been read back, because a
prefill's inputs come from the host.
"""
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # KV rows to compute this step: tokens num_computed .. num_computed + n - 1
    samples: bool = field(init=False)  # the chunk reaches the end of the sequence, so a token gets sampled

    def __post_init__(self) -> None:
        self.samples = self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted request out and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def schedule(self) -> list[ScheduledSeq]:
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # Its last token is pending: it finishes once read back.
            if seq.num_pending_tokens and len(seq) >= seq.max_len:
                i += 1
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            needed = bm.blocks_needed(seq, n)
            while needed > bm.num_free_blocks:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                if needed:
                    bm.allocate(seq, n)
                batch.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1

        # Admitting new work right after a preemption would only preempt again.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # Preempted with a token in flight: its prefill needs that token's value. (Today a step that
            # preempts admits nothing anyway, and the token is read back before the next one.)
            if seq.num_pending_tokens:
                break
            cached = bm.find_cached_prefix(seq)
            n = min(len(seq) - len(cached) * bm.block_size, budget)
            if not bm.can_admit(seq, cached, n):
                break
            self.waiting.popleft()
            bm.admit(seq, cached)
            bm.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
