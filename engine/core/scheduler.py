"""Continuous batching with chunked prefill and preemption by recompute.

Every step builds one batch under a token budget (`max_num_batched_tokens`). Running requests
come first, oldest first: a decode costs one token, an unfinished prefill takes what the budget
leaves. Then waiting requests are admitted first come, first served, starting on their cached
prefix. When KV blocks run out, the newest running request is preempted: its blocks are freed
and it goes back to the front of the queue, to be recomputed later. Nothing is ever dropped.

Requests carry a priority (vLLM's `priority`: lower is more urgent, 0 by default), and the
order above is by priority first. Priority is strict: a step serves only the most
urgent priority among the requests present. Less urgent running requests keep their blocks but get
no tokens, are the first to be preempted, and are preempted to admit a more urgent request. So a
background job (a title, a summary) can never slow a chat that is streaming: on a CPU even one
long-context decode row in the batch would. With every priority equal, this is plain FCFS.

With asynchronous scheduling a step is planned while the previous one still runs, so some
sampled tokens are pending (see `Sequence`). A pending token is planned as the next step's
input; a request whose pending tokens reach its length limit gets no further step; and a
preempted request is readmitted only once its pending token has been read back, because a
prefill's inputs come from the host.
"""

import bisect
from dataclasses import dataclass, field

from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence, SequenceStatus


def _priority(seq: Sequence) -> int:
    return seq.priority


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # KV rows to compute this step: tokens num_computed .. num_computed + n - 1
    # Speculative decoding: proposed tokens after the sequence's last one, the last of the new tokens
    draft_token_ids: list[int] = field(default_factory=list)
    samples: bool = field(init=False)  # the chunk reaches the end of the sequence, so a token gets sampled
    # A hybrid model's recurrent state (engine/core/state_slots.py): the snapshot the sequence's slot starts as,
    # and the snapshots this step writes, (tokens into the step, slot)
    restore_from: int | None = None
    snapshots: list[tuple[int, int]] = field(default_factory=list)
    # Checking drafts on a hybrid model: the slot its state goes to after each row but the last (StateSlots.verify_slot)
    verify_slots: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.samples = self.seq.num_computed_tokens + self.num_new_tokens - len(self.draft_token_ids) == len(self.seq)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Both by priority; within one, the order FCFS gives (preempted requests first in `waiting`, and
        # last admitted last in `running`, where the last is the first to be preempted).
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        bisect.insort_right(self.waiting, seq, key=_priority)

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
        # The most urgent priority present: only its requests get tokens this step.
        level = min(seq.priority for seq in (*self.running[:1], *self.waiting[:1])) if self.has_unfinished() else 0

        i = 0
        while i < len(self.running) and budget > 0 and self.running[i].priority == level:
            seq = self.running[i]
            # Its last token is pending: it finishes once read back.
            if seq.num_pending_tokens and len(seq) >= seq.max_len:
                i += 1
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            # A decode checks its drafts (speculative decoding) in the same step, as far as the budget allows.
            drafts = seq.draft_token_ids[: budget - 1] if seq.num_uncomputed_tokens == 1 else []
            n += len(drafts)
            bm.release_out_of_window(seq)
            needed = bm.blocks_needed(seq, n)
            if drafts and needed > bm.num_free_blocks:  # speculation never preempts: the decode goes without
                n, drafts = n - len(drafts), []
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
                batch.append(self._scheduled(seq, n, drafts))
                budget -= n
                i += 1

        # Admitting new work right after a preemption would only preempt again.
        while self.waiting and budget > 0 and not preempted and self.waiting[0].priority == level:
            seq = self.waiting[0]
            # Preempted with a token in flight: its prefill needs that token's value. (Today a step that
            # preempts admits nothing anyway, and the token is read back before the next one.)
            if seq.num_pending_tokens:
                break
            cached = bm.find_cached_prefix(seq)
            n = min(len(seq) - len(cached[0]) * bm.block_size, budget)
            if len(self.running) >= self.max_num_seqs or not bm.can_admit(seq, cached, n):
                # Room is made only by less urgent requests, which wait for this one anyway.
                if not self.running or self.running[-1].priority <= seq.priority:
                    break
                victim = self.running.pop()
                if victim.num_pending_tokens:  # its token in flight must be read back first: next step
                    self.running.append(victim)
                    break
                self._preempt(victim)
                continue
            self.waiting.pop(0)
            bm.admit(seq, cached)
            bm.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            bisect.insort_right(self.running, seq, key=_priority)
            batch.append(self._scheduled(seq, n))
            budget -= n
        return batch

    def _scheduled(self, seq: Sequence, n: int, drafts: list[int] | None = None) -> ScheduledSeq:
        item = ScheduledSeq(seq, n, drafts or [])
        if self.block_manager.states is not None:
            item.restore_from, seq.restore_slot = seq.restore_slot, None
            item.snapshots = self.block_manager.plan_snapshots(seq, n)
            states = self.block_manager.states
            item.verify_slots = [states.verify_slot(seq.state_slot, i) for i in range(len(item.draft_token_ids))]
        return item

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        bisect.insort_left(self.waiting, seq, key=_priority)  # first of its priority, as it is the oldest
        self.num_preemptions += 1
