"""Logprobs of chosen tokens and of each row's top tokens, from the raw logits (vLLM's "raw_logprobs")."""

from collections.abc import Callable
from dataclasses import dataclass

import torch


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


# Prompt logprobs need the logits of every prompt row: taken this many floats at a time, so a long chunk's
# [rows, vocab] logits never sit in memory whole (the KV cache was sized without them).
PROMPT_LOGITS_FLOATS = 1 << 25


def prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
    hidden: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    k: int,
    vocab_size: int,
) -> LogprobsTensors | None:
    """The logprobs of `targets` (and the top `k`) from the logits of `hidden`'s `rows`, a slice of rows at a time.
    Every tensor-parallel rank computes the logits with rank 0 (the head gathers across ranks), which alone gets
    them (`compute_logits` gives the others None)."""
    per_slice = max(1, PROMPT_LOGITS_FLOATS // vocab_size)
    parts = []
    for i in range(0, len(rows), per_slice):
        logits = compute_logits(hidden[rows[i : i + per_slice]])
        if logits is not None:
            parts.append(gather_logprobs(logits, targets[i : i + per_slice], k))
    return LogprobsTensors.cat(parts) if parts else None
