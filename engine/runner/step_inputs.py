"""One step's inputs as host arrays, built from the scheduled batch with numpy and no model.

`prepare_step` gives the forward pass's inputs (token ids, positions, slot_mapping, the attention
lengths and block tables, the rows whose logits get sampled); `logprobs_plan` the rows whose
logprobs some request asked for (None, and no work, when none did). ModelRunner uploads them to the
device. An input token that the previous step sampled and the host has not read yet
(asynchronous scheduling) is a placeholder here: its row, and the row of the previous step's
sampled tokens that holds it, tell the device where to fill it in from.
"""

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from itertools import accumulate, chain
from typing import TYPE_CHECKING

import numpy as np

from engine.core.block_manager import NO_BLOCK
from engine.core.scheduler import ScheduledSeq
from engine.core.sequence import Sequence

if TYPE_CHECKING:
    import torch


@dataclass
class StepInputs:
    """One step's inputs as host arrays: what rank 0 builds, and sends to tensor-parallel workers."""

    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    query_lens: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    logits_index: np.ndarray  # the rows whose logits get sampled
    # Input tokens the previous step sampled and the host has not read yet (asynchronous scheduling):
    pending_rows: np.ndarray  # their rows in token_ids, filled on the device
    pending_sources: np.ndarray  # their rows in the previous step's sampled tokens
    # KV-cache groups after the first (engine/runner/kv_cache.py), each with its own slots and block tables
    group_slot_mappings: list[np.ndarray] = field(default_factory=list)
    group_block_tables: list[np.ndarray] = field(default_factory=list)
    state_slots: np.ndarray = field(default_factory=lambda: _NO_ROWS)  # each sequence's, where layers keep state
    state_restores: list[tuple[int, int]] = field(default_factory=list)  # (snapshot slot, sequence's slot)
    state_snapshots: list[tuple[int, int, int]] = field(default_factory=list)  # (sequence, tokens into it, slot)
    # Checking drafts on a hybrid model: per row, the slot its state is written to (it reads `state_slots`'), and its
    # place among its request's rows, the order the recurrent layers take them in; empty when every row keeps its own
    state_writes: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    state_waves: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    # Logprobs, for the requests that asked (see LogprobsPlan); empty for all others:
    sample_logprobs_rows: np.ndarray = field(default_factory=lambda: _NO_ROWS)  # rows of logits_index
    num_logprobs: int = 0  # top tokens to keep for them: the most any of them asked for
    prompt_logits_index: np.ndarray = field(default_factory=lambda: _NO_ROWS)  # rows giving prompt logprobs
    prompt_token_ids: np.ndarray = field(default_factory=lambda: _NO_ROWS)  # the token each of those predicts
    num_prompt_logprobs: int = 0
    # Speculative decoding, where some request checks drafts: per row of logits_index, the drafted token the row
    # checks (-1 for none: the row after a request's last draft), and the row's place among its request's rows
    draft_token_ids: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    draft_offsets: np.ndarray = field(default_factory=lambda: _NO_ROWS)


_NO_ROWS = np.zeros(0, np.int64)


@dataclass
class LogprobsPlan:
    """Where a step's logprobs come from, for the requests in it that asked for some.

    A prefill row at position p predicts token p + 1: rows of the prompt before its last token give
    prompt logprobs (the last one's logits sample the first output token). `prompt_segments` says
    which request and positions the prompt rows belong to, in row order."""

    sample_rows: np.ndarray  # rows of the step's sampled tokens whose requests want logprobs
    num_logprobs: int  # the most top tokens any of them asked for
    prompt_rows: np.ndarray  # rows of the step's tokens whose logits give prompt logprobs
    prompt_token_ids: np.ndarray  # the prompt token each prompt row predicts
    num_prompt_logprobs: int  # the most top tokens any of their requests asked for
    prompt_segments: list[tuple[Sequence, int, int]]  # (sequence, first position, number of rows)


class SampledRows(Mapping[int, int]):
    """seq_id -> row of one step's sampled tokens, for the sequences that step sampled, in order.

    The dict is built on the first lookup: a synchronous engine never has a pending token to find."""

    def __init__(self, seqs: list[Sequence]):
        self.seqs = seqs
        self._rows: dict[int, int] | None = None

    def _by_id(self) -> dict[int, int]:
        if self._rows is None:
            self._rows = {s.seq_id: row for row, s in enumerate(self.seqs)}
        return self._rows

    def __getitem__(self, seq_id: int) -> int:
        return self._by_id()[seq_id]

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._by_id()

    def get(self, seq_id: int, default: int | None = None) -> int | None:  # one dict lookup, not Mapping's two calls
        return self._by_id().get(seq_id, default)

    def __iter__(self) -> Iterator[int]:
        return iter(self._by_id())

    def __len__(self) -> int:
        return len(self.seqs)


def rows_in_last_sampled(seqs: list[Sequence], sampled_rows: Mapping[int, int]) -> np.ndarray:
    """Where each of `seqs`' pending token sits in the last launched step's sampled tokens."""
    if not seqs:
        return np.zeros(0, np.int64)
    rows = [sampled_rows.get(s.seq_id) for s in seqs]
    missing = [s.request_id for s, row in zip(seqs, rows, strict=True) if row is None]
    if missing:  # the scheduler plans a pending token only as the input right after the step that sampled it
        raise RuntimeError(f"requests {missing} have a pending token that the last step did not sample")
    return np.array(rows, np.int64)


def logprobs_plan(batch: list[ScheduledSeq]) -> LogprobsPlan | None:
    """The rows of this step whose logprobs are wanted; None (after one pass) when no request asked.

    A prompt position whose logprobs the request already holds (it was preempted and is being
    recomputed) is not asked for again."""
    if not any(s.seq.wants_logprobs for s in batch):
        return None
    sample_rows, num_logprobs = [], 0
    prompt_rows: list[int] = []
    prompt_token_ids: list[int] = []
    num_prompt_logprobs, segments = 0, []
    row = sample = 0
    for s in batch:
        seq, params = s.seq, s.seq.sampling_params
        if s.samples:
            if params.logprobs is not None:
                sample_rows.append(sample)
                num_logprobs = max(num_logprobs, params.logprobs)
            sample += 1 + len(s.draft_token_ids)  # a request checking drafts has a row of logits for each
        if seq.prompt_logprobs is not None:
            start = seq.num_computed_tokens
            first = max(start, len(seq.prompt_logprobs) - 1)
            end = min(start + s.num_new_tokens, seq.num_prompt_tokens - 1)
            if first < end:
                prompt_rows += range(row + first - start, row + end - start)
                prompt_token_ids += seq.token_ids[first + 1 : end + 1]
                num_prompt_logprobs = max(num_prompt_logprobs, params.prompt_logprobs)
                segments.append((seq, first, end - first))
        row += s.num_new_tokens
    return LogprobsPlan(
        np.array(sample_rows, np.int64),
        num_logprobs,
        np.array(prompt_rows, np.int64),
        np.array(prompt_token_ids, np.int64),
        num_prompt_logprobs,
        segments,
    )


@dataclass
class HiddenStates:
    """A step's last hidden states (the final norm's output), kept for an MTP drafter (engine/spec_decode/mtp.py):
    rows rows[i] .. rows[i + 1] - 1 are those of request `seq_ids[i]`, from its position `starts[i]` on."""

    seq_ids: list[int]
    starts: list[int]
    rows: list[int]
    hidden: "torch.Tensor"

    @classmethod
    def of(cls, batch: list[ScheduledSeq], hidden: "torch.Tensor") -> "HiddenStates":
        """From the batch as it launches (before its requests' computed counts move on). A request checking drafts
        has k + 1 rows in one run, though its attention sees them as k + 1 requests."""
        rows = [0, *accumulate(item.num_new_tokens for item in batch)]
        return cls([item.seq.seq_id for item in batch], [item.seq.num_computed_tokens for item in batch], rows, hidden)


def prepare_step(
    batch: list[ScheduledSeq], block_size: int, sampled_rows: Mapping[int, int], plan: LogprobsPlan | None = None
) -> StepInputs:
    """input_ids, positions, attention inputs and the rows whose logits get sampled, on the host.

    Built with numpy (a few microseconds per array, where small torch ops cost tens). `sampled_rows`:
    where the last launched step's sampled tokens sit, by seq_id (read only for pending inputs).
    `plan`: the step's logprobs rows (`logprobs_plan`), if any request asked."""
    bs = block_size
    num_seqs = len(batch)
    starts = np.fromiter((s.seq.num_computed_tokens for s in batch), np.int64, num_seqs)
    query_lens = np.fromiter((s.num_new_tokens for s in batch), np.int64, num_seqs)
    # A pending token is always its sequence's only input this step (see Scheduler).
    pending = np.flatnonzero(np.fromiter((s.seq.num_pending_tokens for s in batch), np.int64, num_seqs))
    seq_lens = starts + query_lens
    query_start_loc = np.zeros(num_seqs + 1, np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    tables = block_tables(batch, 0)
    if int(query_lens.max()) == 1:  # one token per sequence (a decode, or a one-token prefill chunk)
        if len(pending) == num_seqs:  # steady asynchronous decoding: every input is on the device
            token_ids = np.zeros(num_seqs, np.int64)
        else:
            token_ids = [
                0 if s.seq.num_pending_tokens else s.seq.token_ids[p]
                for s, p in zip(batch, starts.tolist(), strict=True)
            ]
        positions, seq_index, pending_rows = starts, np.arange(num_seqs), pending
    else:
        token_ids = []
        for s, start, n in zip(batch, starts.tolist(), query_lens.tolist(), strict=True):
            drafts = s.draft_token_ids
            token_ids += s.seq.token_ids[start : start + n - len(drafts)] or [0]  # empty only for a pending input
            token_ids += drafts
        seq_index = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(len(token_ids)) - (query_start_loc[:-1] - starts)[seq_index]
        pending_rows = query_start_loc[pending]
    slot_mapping = tables[seq_index, positions // bs] * bs + positions % bs
    more_tables = [block_tables(batch, g) for g in range(1, len(batch[0].seq.block_tables))]
    sample_rows = [i for i, s in enumerate(batch) if s.samples]
    step = StepInputs(
        np.asarray(token_ids, np.int64),
        positions,
        slot_mapping,
        query_start_loc,
        query_lens,
        seq_lens,
        tables,
        query_start_loc[1:][sample_rows] - 1,  # widened below where requests check drafts
        pending_rows,
        rows_in_last_sampled([batch[i].seq for i in pending], sampled_rows),
    )
    step.group_block_tables = more_tables
    if batch[0].seq.state_slot is not None:
        step.state_slots = np.fromiter((s.seq.state_slot for s in batch), np.int64, num_seqs)
        step.state_restores = [(s.restore_from, s.seq.state_slot) for s in batch if s.restore_from is not None]
        step.state_snapshots = [(i, n, slot) for i, s in enumerate(batch) for n, slot in s.snapshots]
    step.group_slot_mappings = [t[seq_index, positions // bs] * bs + positions % bs for t in more_tables]
    if any(s.draft_token_ids for s in batch):
        add_draft_rows(step, batch)
    if plan is not None:
        step.sample_logprobs_rows, step.num_logprobs = plan.sample_rows, plan.num_logprobs
        step.prompt_logits_index, step.prompt_token_ids = plan.prompt_rows, plan.prompt_token_ids
        step.num_prompt_logprobs = plan.num_prompt_logprobs
    return step


def add_draft_rows(step: StepInputs, batch: list[ScheduledSeq]) -> None:
    """A request that checks k drafts gets k + 1 rows of logits, those of its last input and of its drafts; and
    to attention it is k + 1 decode rows, one query token each, reading its block table up to that token's
    position. The step then runs as a decode step does (a compiled decode graph takes it, where one serves), and
    each verified token's attention rounds as in a plain decode step (the torch backend's decode reads whole
    blocks, masked, which SDPA's CPU kernel computes the same in any batch): greedy replies stay the same."""
    num_drafts = np.fromiter((len(s.draft_token_ids) for s in batch), np.int64, len(batch))
    sampling = [s for s in batch if s.samples]
    counts = np.fromiter((1 + len(s.draft_token_ids) for s in sampling), np.int64, len(sampling))
    first_rows = np.repeat(step.logits_index - counts + 1, counts)
    step.draft_offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    step.logits_index = first_rows + step.draft_offsets
    step.draft_token_ids = np.fromiter(
        chain.from_iterable([*s.draft_token_ids, -1] for s in sampling), np.int64, len(step.draft_offsets)
    )
    # each checking request's tokens as sequences of one token
    rows = np.where(num_drafts > 0, step.query_lens, 1)
    splits = np.repeat(num_drafts > 0, rows)
    offsets = np.arange(int(rows.sum())) - np.repeat(np.cumsum(rows) - rows, rows)  # row within its request
    seq_lens, query_lens = np.repeat(step.seq_lens, rows), np.repeat(step.query_lens, rows)
    step.seq_lens = np.where(splits, seq_lens - query_lens + offsets + 1, seq_lens)
    step.query_lens = query_lens = np.where(splits, 1, query_lens)
    step.query_start_loc = np.zeros(len(query_lens) + 1, np.int64)
    np.cumsum(query_lens, out=step.query_start_loc[1:])
    step.block_tables = np.repeat(step.block_tables, rows, axis=0)
    step.group_block_tables = [np.repeat(t, rows, axis=0) for t in step.group_block_tables]
    if step.state_slots.size:
        chain_state_rows(step, batch, rows, offsets)


def chain_state_rows(step: StepInputs, batch: list[ScheduledSeq], rows: np.ndarray, offsets: np.ndarray) -> None:
    """A hybrid model's rows of a request checking k drafts, for its recurrent layers: row 0 reads the request's
    slot and row i the state row i - 1 left; each row but the last writes to a verify slot of its own, the last to
    the request's slot. So after the step its slot holds the state after every row, and verify slot i the state
    after row i, which the engine restores where only i drafts were accepted."""
    reads, writes = [], []
    for item in batch:
        slot, kept = item.seq.state_slot, item.verify_slots
        reads += [slot, *kept]
        writes += [*kept, slot]
    first_rows = np.cumsum(rows) - rows  # each sequence's first row: where its snapshots now point
    step.state_snapshots = [(int(first_rows[i]), n, slot) for i, n, slot in step.state_snapshots]
    step.state_slots, step.state_writes = np.asarray(reads, np.int64), np.asarray(writes, np.int64)
    step.state_waves = offsets


def block_tables(batch: list[ScheduledSeq], group: int) -> np.ndarray:
    """[num_seqs, longest table] of KV-cache group `group`'s block ids, -1 past each table's end. A block a
    sliding window released (NO_BLOCK) reads as block 0: no query sees it, and a kernel that loads a whole tile
    around the window's start still reads memory that is there."""
    lens = np.fromiter((len(s.seq.block_tables[group]) for s in batch), np.int64, len(batch))
    ids = np.fromiter(chain.from_iterable(s.seq.block_tables[group] for s in batch), np.int64, int(lens.sum()))
    ids[ids == NO_BLOCK] = 0
    tables = np.full((len(batch), int(lens.max())), -1, np.int64)
    # Row-major boolean indexing fills each row's leading entries, in the order chain() lists them.
    tables[np.arange(tables.shape[1]) < lens[:, None]] = ids
    return tables
