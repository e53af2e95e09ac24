"""Sampling with per-request parameters, vectorised over the batch.

Sampling uses the exponential race (argmax of probs / Exponential(1) noise), which draws from
`probs` exactly and lets seeded requests draw their noise from their own generator. The noise is
drawn eagerly (generators cannot enter a compiled function); the rest is `pick_tokens`.
"""
import logging
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger("engine")


@dataclass
class SamplingBatch:
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
        return (self.repetition_penalties is not None or self.logit_bias is not None
                or self.presence_penalties is not None)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalties: torch.Tensor) -> torch.Tensor:
    """As in transformers and vLLM: divide positive logits of seen tokens, multiply negative ones."""
    p = penalties[:, None]
    penalized = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalized, logits)


def apply_output_penalties(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                           frequency: torch.Tensor) -> torch.Tensor:
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


def pick_tokens(logits: torch.Tensor, temperatures: torch.Tensor | None, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None, min_p: torch.Tensor | None, repetition_penalties: torch.Tensor | None,
                seen_tokens: torch.Tensor | None, noise: torch.Tensor | None, logit_bias: torch.Tensor | None = None,
                presence_penalties: torch.Tensor | None = None, frequency_penalties: torch.Tensor | None = None,
                output_counts: torch.Tensor | None = None) -> torch.Tensor:
    """Everything in sampling but drawing the noise: a pure function of tensors, so that one
    torch.compile of it fuses its passes over the [batch, vocab] logits. `temperatures` None:
    every row is greedy (and `noise` is None). The logits change in vLLM's order: logit bias,
    repetition penalty, presence and frequency penalties; then temperature, top-k/top-p, min-p."""
    logits = logits.float()
    if logit_bias is not None:
        logits = logits + logit_bias
    if repetition_penalties is not None:
        logits = apply_repetition_penalty(logits, seen_tokens, repetition_penalties)
    if presence_penalties is not None:
        logits = apply_output_penalties(logits, output_counts, presence_penalties, frequency_penalties)
    greedy = logits.argmax(dim=-1)
    if temperatures is None:
        return greedy
    logits = logits / torch.where(temperatures > 0, temperatures, 1.0)[:, None]
    if top_k is not None or top_p is not None:
        logits = apply_top_k_top_p(logits, top_k, top_p)
    probs = logits.softmax(dim=-1)
    if min_p is not None:
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(temperatures > 0, sampled, greedy)


def exponential_noise(shape: torch.Size, device: torch.device,
                      generators: list[torch.Generator | None]) -> torch.Tensor:
    """Exponential(1) draws as -log(U), U uniform: on a CPU 5x faster than `exponential_` (0.16 against
    0.9 ms per 49k-token row, some 30 ms of a 100 ms batch-32 step). A U of exactly 0 (2^-24 per token)
    gives an infinite draw, which only takes that token out of the race. Seeded rows draw their own."""
    uniform = torch.rand(shape, dtype=torch.float32, device=device)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniform[row] = torch.rand(shape[1:], dtype=torch.float32, device=device, generator=generator)
    return uniform.log_().neg_()


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
                log.warning("torch.compile of the sampler failed; sampling eagerly from now on: %s: %s",
                            type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return pick_tokens(logits, *args)


class Sampler(nn.Module):
    def __init__(self, compiled: bool = False):
        """`compiled`: large batches go through torch.compile (the GPU's choice, off with enforce_eager)."""
        super().__init__()
        self.pick = CompiledPick() if compiled else pick_tokens

    @property
    def kind(self) -> str:
        """How sampling runs, for stats(): compiled (large batches), eager, or eager (compile failed)."""
        if isinstance(self.pick, CompiledPick):
            return "eager (compile failed)" if self.pick.failed else "compiled"
        return "eager"

    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.grammar_rows is not None:
            logits = apply_grammar_mask(logits, batch.grammar_rows, batch.grammar_allowed)
        if batch.all_greedy and not batch.changes_logits:
            return logits.argmax(dim=-1)  # exact in half precision too: no float32 copy of the logits needed
        noise = None
        if not batch.all_greedy:
            noise = exponential_noise(logits.shape, logits.device, batch.generators)
        return self.pick(logits, None if batch.all_greedy else batch.temperatures, batch.top_k, batch.top_p,
                         batch.min_p, batch.repetition_penalties, batch.seen_tokens, noise, batch.logit_bias,
                         batch.presence_penalties, batch.frequency_penalties, batch.output_counts)


@dataclass
class LogprobsTensors:
    """vLLM's LogprobsTensors: for each row, the log probability of one chosen token (the sampled one, or
    the prompt's next one) and the `k` most likely tokens with theirs, in float32."""

    token_logprobs: torch.Tensor  # [rows] float32
    topk_ids: torch.Tensor  # [rows, k] int64, most likely first
    topk_logprobs: torch.Tensor  # [rows, k] float32

    def fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.token_logprobs, self.topk_ids, self.topk_logprobs

    @staticmethod
    def cat(parts: list["LogprobsTensors"]) -> "LogprobsTensors":
        if len(parts) == 1:
            return parts[0]
        return LogprobsTensors(*(torch.cat(ts) for ts in zip(*(p.fields() for p in parts), strict=True)))

    def to_host(self) -> "LogprobsTensors":
        """Copies in pinned memory, arriving without making the host wait: valid once the device has
        reached this point (the step's readback event)."""
        def pinned(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

        return LogprobsTensors(*(pinned(t) for t in self.fields()))

    def dicts(self, token_ids: list[int], ks: list[int]) -> list[dict[int, float]]:
        """One `{token_id: logprob}` per row, as vLLM gives them: the chosen token first, then the row's
        own top `ks[i]` (fewer entries when the chosen token is among them)."""
        chosen, ids, values = self.token_logprobs.tolist(), self.topk_ids.tolist(), self.topk_logprobs.tolist()
        out = []
        for i, (token, k) in enumerate(zip(token_ids, ks, strict=True)):
            row = {token: chosen[i]}
            row.update(zip(ids[i][:k], values[i][:k]))
            out.append(row)
        return out


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """The raw distribution's logprobs of `token_ids` (one per row of `logits`) and of each row's top `k`
    (vLLM's "raw_logprobs": the logits as the model gave them, before any sampling parameter)."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None].long())[:, 0]
    if k:
        top_values, top_ids = logprobs.topk(k, dim=-1)
    else:
        top_values = logprobs.new_empty(logprobs.shape[0], 0)
        top_ids = torch.empty(logprobs.shape[0], 0, dtype=torch.int64, device=logprobs.device)
    return LogprobsTensors(chosen, top_ids, top_values)
