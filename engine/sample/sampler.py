"""Sampling with per-request parameters, vectorised over the batch.

`Sampler.prepare` turns the rows' `SamplingParams` into a `SamplingBatch`: one device column per
parameter, only where some row uses it, so the sampler skips the work nobody asked for. The columns
cross to the device in one upload per dtype, without waiting for the steps in flight.

Sampling uses the exponential race (argmax of probs / Exponential(1) noise), which draws from
`probs` exactly and lets seeded requests draw their noise from their own generator. The noise is
drawn eagerly (generators cannot enter a compiled function); the rest is `pick_tokens`.
"""

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
from torch import nn

from engine.core.sequence import Sequence
from engine.runner.step_inputs import rows_in_last_sampled
from engine.sample.structured_output import fill_bitmask

log = logging.getLogger("engine")

# (host arrays, dtype) -> device tensors, as one transfer (ModelRunner.upload)
Upload = Callable[[list[np.ndarray], torch.dtype], list[torch.Tensor]]


@dataclass
class SamplingBatch:
    """The sampling parameters of one step's sampling rows, as device columns; None where no row uses one."""

    temperatures: torch.Tensor | None  # [B] float32, 0 = greedy; None when all_greedy
    top_k: torch.Tensor | None  # [B] int64, vocab size = off; None when no row uses it
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    repetition_penalties: torch.Tensor | None  # [B] float32
    seen_tokens: torch.Tensor | None  # [B, V] bool, prompt and output tokens, for the penalty
    generators: list[torch.Generator | None]
    all_greedy: bool
    logit_bias: torch.Tensor | None = None  # [B, V] float32, added to the logits first
    presence_penalties: torch.Tensor | None = None  # [B] float32; with frequency_penalties, both or neither
    frequency_penalties: torch.Tensor | None = None  # [B] float32
    output_counts: torch.Tensor | None = None  # [B, V] float32: how often each token is in the row's output
    # Constrained rows (structured outputs): their indices, and a bitmask of the tokens each may sample
    grammar_rows: torch.Tensor | None = None  # [R] int64
    grammar_allowed: torch.Tensor | None = None  # [R, V] bool: the tokens each may sample

    @property
    def changes_logits(self) -> bool:
        """Whether anything but temperature and truncation applies: greedy rows then need it too."""
        return (
            self.repetition_penalties is not None or self.logit_bias is not None or self.presence_penalties is not None
        )


class Columns:
    """Host arrays of one dtype on their way to the device in one upload. `add` hands back a `Column`
    whose `tensor` is filled in by `send`."""

    NUMPY_DTYPES = {torch.float32: np.float32, torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_}

    def __init__(self, dtype: torch.dtype):
        if dtype not in self.NUMPY_DTYPES:
            raise ValueError(f"sampling columns are {', '.join(map(str, self.NUMPY_DTYPES))}, not {dtype}")
        self.dtype, self.np_dtype, self.columns = dtype, self.NUMPY_DTYPES[dtype], []

    def add(self, values) -> "Column":
        column = Column(np.asarray(values, self.np_dtype))
        self.columns.append(column)
        return column

    def send(self, upload: Upload) -> None:
        tensors = upload([c.host for c in self.columns], self.dtype)
        for column, tensor in zip(self.columns, tensors, strict=True):
            column.tensor = tensor


@dataclass
class Column:
    host: np.ndarray
    tensor: torch.Tensor | None = None


def on_device(column: Column | None) -> torch.Tensor | None:
    return None if column is None else column.tensor


def token_pairs(seqs: list[Sequence | None], tokens: Callable[[Sequence], list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(rows, ids): each row's `tokens(seq)` as (row, token) pairs; rows whose seq is None have none."""
    lists = [tokens(s) if s else [] for s in seqs]
    rows = np.repeat(np.arange(len(seqs)), [len(t) for t in lists])
    return rows, np.fromiter(chain.from_iterable(lists), np.int64, len(rows))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest logit, as argmax picks it (NaN included): torch.max's indices, which the CPU
    computes 3-5x faster than argmax over a 150k vocabulary (0.4 ms a decode step there)."""
    return logits.max(dim=-1).indices


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalties: torch.Tensor) -> torch.Tensor:
    """As in transformers and vLLM: divide positive logits of seen tokens, multiply negative ones."""
    p = penalties[:, None]
    penalized = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalized, logits)


def apply_output_penalties(
    logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """OpenAI's presence and frequency penalties, as vLLM applies them: subtract `frequency` for each time
    a token is in the output so far, and `presence` once if it is there at all."""
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, ceil(V / 32)] int32 words -> [R, V] bool, bit t of a row (little-endian) for token t."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab_size].bool()


def apply_grammar_mask(logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The logits with -inf for each token a constrained row may not sample (out of place: the raw logits
    stay as they are for logprobs). `allowed`: [len(rows), V] bool."""
    if len(rows) == logits.shape[0]:  # every row constrained (rows are in order): one pass
        return torch.where(allowed, logits, float("-inf"))
    return logits.index_copy(0, rows, logits[rows].masked_fill(~allowed, float("-inf")))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1)  # ascending: the kept tokens are at the end
    vocab = logits.shape[-1]
    if top_k is not None:
        kth_largest = sorted_logits.gather(1, (vocab - top_k).clamp(0, vocab - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p[:, None]
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def adjust_logits(
    logits: torch.Tensor,
    logit_bias: torch.Tensor | None = None,
    repetition_penalties: torch.Tensor | None = None,
    seen_tokens: torch.Tensor | None = None,
    presence_penalties: torch.Tensor | None = None,
    frequency_penalties: torch.Tensor | None = None,
    output_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The float32 logits a row samples from, before temperature, in vLLM's order: logit bias, repetition
    penalty, presence and frequency penalties."""
    logits = logits.float()
    if logit_bias is not None:
        logits = logits + logit_bias
    if repetition_penalties is not None:
        logits = apply_repetition_penalty(logits, seen_tokens, repetition_penalties)
    if presence_penalties is not None:
        logits = apply_output_penalties(logits, output_counts, presence_penalties, frequency_penalties)
    return logits


def sampling_probs(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """The distribution each row samples from: adjusted logits (`adjust_logits`) through temperature (a greedy
    row's 0 taken as 1: it never samples), top-k/top-p, softmax and min-p. Rows need not sum to 1."""
    logits = logits / torch.where(temperatures > 0, temperatures, 1.0)[:, None]
    if top_k is not None or top_p is not None:
        logits = apply_top_k_top_p(logits, top_k, top_p)
    probs = logits.softmax(dim=-1)
    if min_p is not None:
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def pick_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor | None,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    repetition_penalties: torch.Tensor | None,
    seen_tokens: torch.Tensor | None,
    noise: torch.Tensor | None,
    logit_bias: torch.Tensor | None = None,
    presence_penalties: torch.Tensor | None = None,
    frequency_penalties: torch.Tensor | None = None,
    output_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Everything in sampling but drawing the noise: a pure function of tensors, so that one
    torch.compile of it fuses its passes over the [batch, vocab] logits. `temperatures` None:
    every row is greedy (and `noise` is None)."""
    logits = adjust_logits(
        logits, logit_bias, repetition_penalties, seen_tokens, presence_penalties, frequency_penalties, output_counts
    )
    greedy = greedy_tokens(logits)
    if temperatures is None:
        return greedy
    sampled = (sampling_probs(logits, temperatures, top_k, top_p, min_p) / noise).argmax(dim=-1)
    return torch.where(temperatures > 0, sampled, greedy)


def uniform_draws(
    shape: torch.Size | tuple[int, ...], device: torch.device, generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Uniform [0, 1) draws, a row (the first dimension) per generator; seeded rows draw from their own."""
    uniform = torch.rand(shape, dtype=torch.float32, device=device)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniform[row] = torch.rand(shape[1:], dtype=torch.float32, device=device, generator=generator)
    return uniform


def exponential_noise(
    shape: torch.Size, device: torch.device, generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Exponential(1) draws as -log(U), U uniform: on a CPU 5x faster than `exponential_` (0.16 against
    0.9 ms per 49k-token row, some 30 ms of a 100 ms batch-32 step). A U of exactly 0 (2^-24 per token)
    gives an infinite draw, which only takes that token out of the race. Seeded rows draw their own."""
    return uniform_draws(shape, device, generators).log_().neg_()


class CompiledPick:
    """`pick_tokens` through torch.compile, for batches of at least `min_rows` rows.

    Eagerly, each step of `pick_tokens` is a kernel that reads and writes the whole [batch, vocab]
    float32 logits: at 256 rows of a 152k vocabulary that is about a dozen passes over 155 MB,
    some 0.5 ms of an H200's bandwidth a step; compiled, a few. Below `min_rows` the logits are
    small, the passes cost microseconds, and not compiling spares the seconds each new parameter
    combination costs on first use. Batches with top-k or top-p stay eager too: their sort dominates
    and compiles to nothing better, and inductor (torch 2.11, CUDA) fails to generate their cumsum
    with dynamic shapes (bench/RESULTS.md, 2026-11-30). If compiling fails, sampling goes on
    eagerly, with a warning."""

    def __init__(self, min_rows: int = 64):
        self.min_rows = min_rows
        self.compiled = torch.compile(pick_tokens, dynamic=True)
        self.failed = False

    def __call__(self, logits: torch.Tensor, temperatures, top_k, top_p, *args) -> torch.Tensor:
        args = (temperatures, top_k, top_p, *args)
        if logits.shape[0] >= self.min_rows and not self.failed and top_k is None and top_p is None:
            try:
                return self.compiled(logits, *args)
            except Exception as e:  # noqa: BLE001 - any compiler failure; eager sampling still works
                self.failed = True
                log.warning(
                    "torch.compile of the sampler failed; sampling eagerly from now on: %s: %s",
                    type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "",
                )
        return pick_tokens(logits, *args)


class Sampler(nn.Module):
    def __init__(self, vocab_size: int = 0, device: torch.device | str = "cpu", compiled: bool = False):
        """`compiled`: large batches go through torch.compile (the GPU's choice, off with enforce_eager).
        `vocab_size` and `device`: for `prepare`; a sampler given ready batches needs neither."""
        super().__init__()
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.pick = CompiledPick() if compiled else pick_tokens
        # Values assigned through tensor indices must already be on the device: a Python scalar is
        # staged through a blocking copy that waits for every step in flight.
        self.true_on_device = torch.ones((), dtype=torch.bool, device=self.device)
        self.one_on_device = torch.ones((), dtype=torch.float32, device=self.device)

    @property
    def kind(self) -> str:
        """How sampling runs, for stats(): compiled (large batches), eager, or eager (compile failed)."""
        if isinstance(self.pick, CompiledPick):
            return "eager (compile failed)" if self.pick.failed else "compiled"
        return "eager"

    def prepare(
        self,
        seqs: list[Sequence],
        upload: Upload,
        last_sampled: torch.Tensor | None = None,
        last_sampled_rows: Mapping[int, int] | None = None,
    ) -> SamplingBatch:
        """The sampling parameters of `seqs` (the rows that sample, in order) as device columns.

        A column no row needs is left out: top_k only where some row limits it below the vocabulary (the
        others get the whole vocabulary), top_p and min_p only where set, and only what changes the logits
        (penalties, logit biases) when every row is greedy. A row whose newest token is still only on the
        device (asynchronous scheduling) finds it in `last_sampled`, at its row in `last_sampled_rows`."""
        params = [s.sampling_params for s in seqs]
        vocab = self.vocab_size
        floats, ints = Columns(torch.float32), Columns(torch.int64)
        all_greedy = all(p.temperature == 0 for p in params)
        temperatures = top_k = top_p = min_p = repetition = presence = frequency = None
        if not all_greedy:
            temperatures = floats.add([p.temperature for p in params])
            if any(0 < p.top_k < vocab for p in params):
                top_k = ints.add([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
            if any(p.top_p != 1.0 for p in params):
                top_p = floats.add([p.top_p for p in params])
            if any(p.min_p != 0.0 for p in params):
                min_p = floats.add([p.min_p for p in params])
        seen = outputs = bias = pending = None
        if any(p.repetition_penalty != 1.0 for p in params):
            repetition = floats.add([p.repetition_penalty for p in params])
            # the tokens each penalised row has seen: prompt and output
            seen = [
                ints.add(a)
                for a in token_pairs(
                    [s if p.repetition_penalty != 1.0 else None for s, p in zip(seqs, params, strict=True)],
                    lambda seq: seq.token_ids,
                )
            ]
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            presence = floats.add([p.presence_penalty for p in params])
            frequency = floats.add([p.frequency_penalty for p in params])
            # the output only, as OpenAI defines these two
            outputs = [
                ints.add(a)
                for a in token_pairs(
                    [
                        s if p.presence_penalty or p.frequency_penalty else None
                        for s, p in zip(seqs, params, strict=True)
                    ],
                    lambda seq: seq.output_token_ids,
                )
            ]
        if seen or outputs:
            # A pending input token is a sampled one, so it is in the output too. Rows penalised by neither
            # kind may be listed: a penalty of 1 (repetition) or 0 (presence, frequency) changes nothing.
            waiting = [row for row, s in enumerate(seqs) if s.num_pending_tokens]
            if waiting:
                sources = rows_in_last_sampled([seqs[row] for row in waiting], last_sampled_rows or {})
                pending = (ints.add(waiting), ints.add(sources))
        if any(p.logit_bias for p in params):
            biases = [p.logit_bias or {} for p in params]
            bias = (
                ints.add(np.repeat(np.arange(len(seqs)), [len(b) for b in biases])),
                ints.add(np.fromiter(chain.from_iterable(biases), np.int64)),
                floats.add(np.fromiter(chain.from_iterable(b.values() for b in biases), np.float32)),
            )
        constrained = [row for row, s in enumerate(seqs) if s.grammar is not None]
        grammar_rows = ints.add(constrained) if constrained else None
        floats.send(upload)
        ints.send(upload)

        device_pending = None
        if pending is not None:
            device_pending = (pending[0].tensor, last_sampled[pending[1].tensor])
        return SamplingBatch(
            temperatures=on_device(temperatures),
            top_k=on_device(top_k),
            top_p=on_device(top_p),
            min_p=on_device(min_p),
            repetition_penalties=on_device(repetition),
            seen_tokens=self._token_mask(len(seqs), seen, device_pending, torch.bool),
            generators=[s.generator for s in seqs],
            all_greedy=all_greedy,
            logit_bias=self._bias(len(seqs), bias),
            presence_penalties=on_device(presence),
            frequency_penalties=on_device(frequency),
            output_counts=self._token_mask(len(seqs), outputs, device_pending, torch.float32),
            grammar_rows=on_device(grammar_rows),
            grammar_allowed=self._grammar_allowed([seqs[row].grammar for row in constrained], upload),
        )

    def _token_mask(self, num_rows: int, pairs: list[Column] | None, pending, dtype: torch.dtype):
        """[rows, vocab]: which tokens each row holds (bool), or how often (float32), from (row, token) pairs
        and the rows' pending tokens."""
        if pairs is None:
            return None
        mask = torch.zeros(num_rows, self.vocab_size, dtype=dtype, device=self.device)
        one = self.true_on_device if dtype == torch.bool else self.one_on_device
        rows, ids = pairs[0].tensor, pairs[1].tensor
        mask.index_put_((rows, ids), one.expand(len(ids)), accumulate=dtype != torch.bool)
        if pending is not None:
            mask.index_put_(pending, one.expand(len(pending[0])), accumulate=dtype != torch.bool)
        return mask

    def _bias(self, num_rows: int, bias: tuple[Column, Column, Column] | None) -> torch.Tensor | None:
        if bias is None:
            return None
        table = torch.zeros(num_rows, self.vocab_size, dtype=torch.float32, device=self.device)
        table.index_put_((bias[0].tensor, bias[1].tensor), bias[2].tensor)
        return table

    def _grammar_allowed(self, grammars: list, upload: Upload) -> torch.Tensor | None:
        """[rows, vocab] bool: the tokens each constrained row may sample, filled on the host while the
        device runs this step's forward pass."""
        if not grammars:
            return None
        mask = fill_bitmask(grammars, self.vocab_size, parallel=self.device.type != "cpu")
        if self.device.type == "cpu":  # numpy unpacks the bits in one C pass
            bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size]
            return torch.from_numpy(bits.view(np.bool_))
        (words,) = upload([mask], torch.int32)  # a 32x smaller transfer, unpacked on the device
        return unpack_bitmask(words, self.vocab_size)

    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.grammar_rows is not None:
            logits = apply_grammar_mask(logits, batch.grammar_rows, batch.grammar_allowed)
        if batch.all_greedy and not batch.changes_logits:
            return greedy_tokens(logits)  # exact in half precision too: no float32 copy of the logits needed
        noise = None
        if not batch.all_greedy:
            noise = exponential_noise(logits.shape, logits.device, batch.generators)
        return self.pick(
            logits,
            None if batch.all_greedy else batch.temperatures,
            batch.top_k,
            batch.top_p,
            batch.min_p,
            batch.repetition_penalties,
            batch.seen_tokens,
            noise,
            batch.logit_bias,
            batch.presence_penalties,
            batch.frequency_penalties,
            batch.output_counts,
        )
