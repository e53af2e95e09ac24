"""Checking drafted tokens (speculative decoding) against the target model's own distribution, in one pass.

A request that drafted k tokens has k + 1 rows of logits: row j is the model's distribution for the token after
the j-th draft (row 0: after its last real token), and checks draft j + 1 (the last row checks none). The
drafts come from deterministic proposers (a draft's probability under the proposer is 1), so vLLM's rejection
sampler reduces to this, row by row:

- a greedy row accepts its draft when the draft is the row's argmax;
- a sampled row accepts its draft d with probability p(d) (p: the row's distribution after penalties,
  temperature, top-k/top-p and min-p); when it rejects, it samples from p with d taken out (renormalised).

The first row that rejects (or the last row, whose "draft" is none) gives the request one more token: the
row's resampled token (a greedy row's argmax). So every request gets its accepted drafts and one token more,
and the tokens are distributed exactly as the target samples them one at a time: P(d) = p(d), and
P(t) = (1 - p(d)) * p(t) / (1 - p(d)) = p(t) for t != d. Greedy requests get exactly the tokens that plain
decoding gives.
"""

import torch

from engine.sample.sampler import (
    SamplingBatch,
    adjust_logits,
    apply_grammar_mask,
    exponential_noise,
    greedy_tokens,
    sampling_probs,
    uniform_draws,
)


def verify_drafts(
    logits: torch.Tensor, batch: SamplingBatch, draft_token_ids: torch.Tensor, draft_offsets: torch.Tensor
) -> torch.Tensor:
    """Per row, the token that the row's request gets at that place: its accepted draft, then one sampled token
    at the first rejecting row, then -1. `batch`: the sampling parameters per row (a request's repeated over its
    rows); `draft_token_ids`: the token each row checks, -1 for none; `draft_offsets`: each row's place among
    its request's rows (0, 1, ..., k). Rows of one request are consecutive. A request with a structured output
    or a penalty that looks at earlier tokens never drafts (engine/spec_decode/speculator.py): its row would need
    the drafts before it; it may share the batch, with one row and no draft, sampled as the sampler would."""
    if batch.grammar_rows is not None:  # a constrained request beside the speculating ones: one row, no draft
        logits = apply_grammar_mask(logits, batch.grammar_rows, batch.grammar_allowed)
    # Penalties apply to the rows of requests that do not speculate (a speculating request's are neutral).
    logits = adjust_logits(
        logits,
        batch.logit_bias,
        batch.repetition_penalties,
        batch.seen_tokens,
        batch.presence_penalties,
        batch.frequency_penalties,
        batch.output_counts,
    )
    greedy = greedy_tokens(logits)
    has_draft = draft_token_ids >= 0
    drafts = draft_token_ids.clamp(min=0)[:, None]
    if batch.all_greedy:
        accepted, resampled = has_draft & (greedy == draft_token_ids), greedy
    else:
        probs = sampling_probs(logits, batch.temperatures, batch.top_k, batch.top_p, batch.min_p)
        draft_probs = probs.gather(1, drafts)[:, 0]
        uniform = uniform_draws((len(logits),), logits.device, batch.generators)
        sampled_row = batch.temperatures > 0
        accepted = has_draft & torch.where(sampled_row, uniform < draft_probs, greedy == draft_token_ids)
        residual = probs.scatter(1, drafts, torch.where(has_draft, 0.0, draft_probs)[:, None])
        noise = exponential_noise(probs.shape, logits.device, batch.generators)
        resampled = torch.where(sampled_row, (residual / noise).argmax(dim=-1), greedy)
    # Each request's first rejecting row: its rows start where the offset is 0.
    request = torch.cumsum(draft_offsets == 0, 0) - 1
    rows = len(logits)
    first_rejected = torch.full_like(draft_offsets, rows)  # by request: no more requests than rows
    first_rejected.scatter_reduce_(0, request, torch.where(accepted, rows, draft_offsets), "amin")
    cut = first_rejected[request]
    return torch.where(draft_offsets < cut, draft_token_ids, torch.where(draft_offsets == cut, resampled, -1))
