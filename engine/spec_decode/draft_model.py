"""Draft-model proposals: a smaller model with the same tokenizer runs ahead of the target, greedily, k tokens a
step, and the target checks them all in its next step.

The draft keeps its own paged KV cache and prefix cache (a ModelRunner and a BlockManager of its own, sized to
the target's number of blocks). Each target request has a mirror `Sequence` here whose tokens are the target's
plus the drafts the mirror has computed. Before proposing, a mirror is cut back to what it shares with the
target's tokens (the rejected drafts' KV is written over, as the target's is), so one catch-up row computes
the target's new tokens, usually the last accepted draft and the token the target sampled after it, and samples
the first draft; k - 1 decode steps of the whole batch sample the rest. Blocks are registered in the draft's
prefix cache only for the target's tokens, never for drafts. A mirror that finds no free block proposes
nothing for that step: drafting never takes memory from the target.

Proposals are greedy (the draft's most likely token), which engine/sample/rejection.py treats as a proposal
that is certain: sampled requests keep the target's distribution exactly.
"""

from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.core.block_manager import BlockManager
from engine.core.scheduler import ScheduledSeq
from engine.core.sequence import Sequence, SequenceStatus
from engine.front.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 30)


@dataclass
class Mirror:
    target_id: int  # the target request's seq_id
    seq: Sequence  # the draft's copy of a target request: its tokens, then the drafts it has computed
    synced: int = 0  # leading tokens known to equal the target's
    drafts: list[int] = field(default_factory=list)  # proposed in this call


class DraftModelProposer:
    mirror_type = Mirror

    def __init__(self, runner, block_manager: BlockManager, max_num_batched_tokens: int, target_vocab_size: int):
        self.runner, self.block_manager = runner, block_manager
        self.budget = max_num_batched_tokens
        self.target_vocab_size = target_vocab_size  # a bigger draft vocabulary's extra ids mean nothing to the target
        self.max_model_len = runner.max_model_len
        self.mirrors: dict[int, Mirror] = {}  # by the target sequence's seq_id

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to `length` drafted tokens for each (request, length); none past the draft's own context, whose
        positions it was not trained for or its cache cannot hold."""
        # the last draft is sampled at position len + length - 1, from a row at len + length - 2
        requests = [(seq, min(length, self.max_model_len - len(seq))) for seq, length in requests]
        mirrors = [self._synced(seq) if length > 0 else None for seq, length in requests]
        self._catch_up([m for m in mirrors if m is not None], self._followers(requests))
        lengths = {id(m): length for m, (_, length) in zip(mirrors, requests, strict=True) if m is not None}
        while True:
            going = [m for m in mirrors if m is not None and 0 < len(m.drafts) < lengths[id(m)] and m.drafts[-1] >= 0]
            if not going:
                break
            self._extend(going)
        return [[] if m is None else self._usable(m.drafts) for m in mirrors]

    def retain(self, seqs: list[Sequence]) -> None:
        """Free the mirrors of requests that are no longer running (finished, aborted or preempted); their
        registered blocks stay in the draft's prefix cache for when they come back."""
        live = {seq.seq_id for seq in seqs}
        for seq_id in [s for s in self.mirrors if s not in live]:
            self.block_manager.free(self.mirrors.pop(seq_id).seq)

    def release(self) -> None:
        self.mirrors.clear()
        self.runner.release()

    def _synced(self, target: Sequence) -> Mirror | None:
        """The request's mirror, its tokens set to the target's and its KV cut back to what they share; None if the
        draft's cache has no room to start it."""
        mirror = self.mirrors.get(target.seq_id)
        bm = self.block_manager
        tokens = self._tokens(target)
        if mirror is None:
            seq = Sequence(tokens, GREEDY, request_id=f"draft-{target.request_id}")
            cached = bm.find_cached_prefix(seq)
            if not bm.can_admit(seq, cached, len(seq) - len(cached[0]) * bm.block_size):
                return None
            bm.admit(seq, cached)
            seq.status = SequenceStatus.RUNNING
            mirror = self.mirrors[target.seq_id] = self.mirror_type(target.seq_id, seq, synced=len(seq))
        seq, shared = mirror.seq, mirror.synced
        end = min(self._reusable(mirror), len(tokens))
        while shared < end and seq.token_ids[shared] == tokens[shared]:
            shared += 1
        del seq.token_ids[mirror.synced :]  # the tokens before are the target's already
        seq.token_ids.extend(tokens[mirror.synced :])
        seq.num_computed_tokens = min(seq.num_computed_tokens, shared)
        mirror.synced, mirror.drafts = len(tokens), []
        return mirror

    def _followers(self, requests: list[tuple[Sequence, int]]) -> list[Mirror]:
        """Mirrors of requests not drafting this step that the catch-up step computes too: none (a draft model
        catches a request up when it next drafts)."""
        return []

    def _tokens(self, target: Sequence) -> list[int]:
        """What the mirror of `target` reads: the target's tokens."""
        return target.token_ids

    def _reusable(self, mirror: Mirror) -> int:
        """The mirror's leading positions whose KV holds while their tokens stay the target's: all it computed."""
        return mirror.seq.num_computed_tokens

    def _catch_up(self, mirrors: list[Mirror], followers: list[Mirror] = ()) -> None:
        """One step that computes each mirror's tokens the draft has not seen (a new request's whole prompt, in
        chunks over later calls when it is long) and samples the first draft of those it reaches the end of;
        `followers`' tokens too, after theirs, sampling nothing."""
        bm, budget, batch = self.block_manager, self.budget, []
        following = {id(mirror) for mirror in followers}
        for mirror in [*mirrors, *followers]:
            seq = mirror.seq
            n = min(len(seq) - seq.num_computed_tokens, budget)
            if n <= 0:
                continue
            bm.release_out_of_window(seq)
            if bm.blocks_needed(seq, n) > bm.num_free_blocks:
                self._drop(mirror)  # holding its blocks while behind would starve it: it starts again later
                continue
            bm.allocate(seq, n)
            item = ScheduledSeq(seq, n)
            item.samples = item.samples and id(mirror) not in following
            batch.append((mirror, item))
            budget -= n
        tokens = self._run(batch)
        for mirror, item in batch:
            bm.register_full_blocks(item.seq)  # its tokens are the target's: its full blocks may be shared
            if item.samples:
                mirror.drafts.append(next(tokens))

    def _extend(self, mirrors: list[Mirror]) -> None:
        """One decode step that feeds each mirror its last draft and samples the next."""
        bm, batch = self.block_manager, []
        for mirror in mirrors:
            seq = mirror.seq
            seq.token_ids.append(mirror.drafts[-1])
            if bm.blocks_needed(seq, 1) > bm.num_free_blocks:
                mirror.drafts.append(-1)  # no room: it stops here (cut off by _usable), and starts again later
                self._drop(mirror)
                continue
            bm.allocate(seq, 1)
            batch.append((mirror, ScheduledSeq(seq, 1)))
        tokens = self._run(batch)
        for mirror, _ in batch:
            mirror.drafts.append(next(tokens))

    def _drop(self, mirror: Mirror) -> None:
        """Free a mirror's blocks (its registered ones stay in the prefix cache for when it is made again)."""
        self.block_manager.free(self.mirrors.pop(mirror.target_id).seq)

    def _run(self, batch: list[tuple[Mirror, ScheduledSeq]]) -> Iterator[int]:
        """Run one draft step; its sampled tokens, one per item that samples."""
        if not batch:
            return iter(())
        items = [item for _, item in batch]
        tokens = self.runner.collect(self.runner.launch(items))
        for item in items:
            item.seq.num_computed_tokens += item.num_new_tokens
        return iter(tokens)

    def _usable(self, drafts: list[int]) -> list[int]:
        """The drafts up to the first the target cannot check (a stop marker, or an id outside its vocabulary)."""
        for i, token in enumerate(drafts):
            if not 0 <= token < self.target_vocab_size:
                return drafts[:i]
        return drafts
