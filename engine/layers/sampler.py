"""Sampling with per-request parameters, vectorised over the batch.

Sampling uses the exponential race (argmax of probs / Exponential(1) noise), which draws from
`probs` exactly and lets seeded requests draw their noise from their own generator.
"""
from dataclasses import dataclass

import torch
from torch import nn


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


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalties: torch.Tensor) -> torch.Tensor:
    """As in transformers and vLLM: divide positive logits of seen tokens, multiply negative ones."""
    p = penalties[:, None]
    penalized = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalized, logits)


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


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        logits = logits.float()
        if batch.repetition_penalties is not None:
            logits = apply_repetition_penalty(logits, batch.seen_tokens, batch.repetition_penalties)
        greedy = logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy
        temps = batch.temperatures
        logits = logits / torch.where(temps > 0, temps, 1.0)[:, None]
        if batch.top_k is not None or batch.top_p is not None:
            logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = logits.softmax(dim=-1)
        if batch.min_p is not None:
            threshold = batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        noise = torch.empty_like(probs).exponential_()
        for row, generator in enumerate(batch.generators):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(temps > 0, sampled, greedy)
