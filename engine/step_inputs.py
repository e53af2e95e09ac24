"""One step's inputs as host arrays, built from the scheduled batch with numpy and no model.

`prepare_step` gives the forward pass's inputs (token ids, positions, slot_mapping, the attention
lengths and block tables, the rows whose logits get sampled); `sampling_columns` gives each
sampling parameter as a column, only where some row uses it. ModelRunner uploads both to the
device. An input token that the previous step sampled and the host has not read yet
(asynchronous scheduling) is a placeholder here: its row, and the row of the previous step's
sampled tokens that holds it, tell the device where to fill it in from.
"""
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import chain

import numpy as np

from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence


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


@dataclass
class SamplingColumns:
    """Each row's sampling parameters as host columns, only those some row uses."""

    all_greedy: bool
    floats: dict[str, np.ndarray]  # repetition_penalties, temperatures, top_p, min_p
    # top_k; and with a repetition penalty, the (row, token) pairs each penalised row has seen
    # (seen_rows, seen_ids) and its pending input token (pending_rows, pending_sources), still on the device
    ints: dict[str, np.ndarray]


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


def prepare_step(batch: list[ScheduledSeq], block_size: int, sampled_rows: Mapping[int, int]) -> StepInputs:
    """input_ids, positions, attention inputs and the rows whose logits get sampled, on the host.

    Built with numpy (a few microseconds per array, where small torch ops cost tens). `sampled_rows`:
    where the last launched step's sampled tokens sit, by seq_id (read only for pending inputs)."""
    bs = block_size
    num_seqs = len(batch)
    starts = np.fromiter((s.seq.num_computed_tokens for s in batch), np.int64, num_seqs)
    query_lens = np.fromiter((s.num_new_tokens for s in batch), np.int64, num_seqs)
    # A pending token is always its sequence's only input this step (see Scheduler).
    pending = np.flatnonzero(np.fromiter((s.seq.num_pending_tokens for s in batch), np.int64, num_seqs))
    seq_lens = starts + query_lens
    query_start_loc = np.zeros(num_seqs + 1, np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    table_lens = np.fromiter((len(s.seq.block_table) for s in batch), np.int64, num_seqs)
    tables = np.full((num_seqs, int(table_lens.max())), -1, np.int64)
    # Row-major boolean indexing fills each row's leading entries, in the order chain() lists them.
    tables[np.arange(tables.shape[1]) < table_lens[:, None]] = np.fromiter(
        chain.from_iterable(s.seq.block_table for s in batch), np.int64, int(table_lens.sum()))
    if int(query_lens.max()) == 1:  # one token per sequence (a decode, or a one-token prefill chunk)
        if len(pending) == num_seqs:  # steady asynchronous decoding: every input is on the device
            token_ids = np.zeros(num_seqs, np.int64)
        else:
            token_ids = [0 if s.seq.num_pending_tokens else s.seq.token_ids[p]
                         for s, p in zip(batch, starts.tolist(), strict=True)]
        positions, seq_index, pending_rows = starts, np.arange(num_seqs), pending
    else:
        token_ids = []
        for s, start, n in zip(batch, starts.tolist(), query_lens.tolist(), strict=True):
            token_ids += s.seq.token_ids[start : start + n] or [0]  # empty only for a pending input
        seq_index = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(len(token_ids)) - (query_start_loc[:-1] - starts)[seq_index]
        pending_rows = query_start_loc[pending]
    slot_mapping = tables[seq_index, positions // bs] * bs + positions % bs
    sample_rows = [i for i, s in enumerate(batch) if s.samples]
    return StepInputs(np.asarray(token_ids, np.int64), positions, slot_mapping, query_start_loc, query_lens,
                      seq_lens, tables, query_start_loc[1:][sample_rows] - 1, pending_rows,
                      rows_in_last_sampled([batch[i].seq for i in pending], sampled_rows))


def sampling_columns(batch: list[ScheduledSeq], vocab_size: int, sampled_rows: Mapping[int, int]) -> SamplingColumns:
    """The sampling parameters of `batch` (the rows that sample, in order) as columns.

    A column no row needs is left out, so the sampler skips its work: top_k only where some row
    limits it below the vocabulary (the others get the whole vocabulary), top_p and min_p only where
    set, and nothing but the repetition penalty when every row is greedy."""
    params = [s.seq.sampling_params for s in batch]
    vocab = vocab_size
    all_greedy = all(p.temperature == 0 for p in params)
    floats: dict[str, np.ndarray] = {}
    if any(p.repetition_penalty != 1.0 for p in params):
        floats["repetition_penalties"] = np.array([p.repetition_penalty for p in params], np.float32)
    if not all_greedy:
        floats["temperatures"] = np.array([p.temperature for p in params], np.float32)
        if any(p.top_p != 1.0 for p in params):
            floats["top_p"] = np.array([p.top_p for p in params], np.float32)
        if any(p.min_p != 0.0 for p in params):
            floats["min_p"] = np.array([p.min_p for p in params], np.float32)
    ints: dict[str, np.ndarray] = {}
    if not all_greedy and any(0 < p.top_k < vocab for p in params):
        ints["top_k"] = np.array([p.top_k if 0 < p.top_k < vocab else vocab for p in params], np.int64)
    if "repetition_penalties" in floats:  # the tokens each penalised row has seen, as (row, token) pairs
        seqs = [s.seq if p.repetition_penalty != 1.0 else None for s, p in zip(batch, params, strict=True)]
        counts = [len(s.token_ids) if s else 0 for s in seqs]
        ints["seen_rows"] = np.repeat(np.arange(len(batch)), counts)
        ints["seen_ids"] = np.fromiter(chain.from_iterable(s.token_ids for s in seqs if s), np.int64, sum(counts))
        pending = [row for row, s in enumerate(seqs) if s and s.num_pending_tokens]  # its input, still on the device
        ints["pending_rows"] = np.array(pending, np.int64)
        ints["pending_sources"] = rows_in_last_sampled([seqs[row] for row in pending], sampled_rows)
    return SamplingColumns(all_greedy, floats, ints)
