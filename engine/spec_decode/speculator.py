"""Between two steps, the drafts each running request will have checked in the next one, and what came of them.

Which requests speculate: those whose next token depends only on the logits of its own row, so that the step's
sampler can check k drafted tokens in k + 1 rows at once (engine/sample/rejection.py). A request with a structured
output, a repetition/presence/frequency penalty or logprobs decodes plainly, one token a step, exactly as
without speculation.

How many tokens to propose adapts to what gets accepted: after a step that accepted a of k drafts, the next
proposal is a + 1 long (the full length again once a draft is accepted whole), and a request whose drafts all
fail proposes nothing for 1, 2, 4, ... 32 steps, so a request that gains nothing costs almost nothing.

A request whose drafts are accepted less often than `min_acceptance_rate` (a moving average) sits out likewise: a
checked draft token costs a share of a decode step, and below that share checking drafts costs more than it gains.
On a CPU a step of k + 1 rows costs about 1 + 0.45 k decode steps (bench/speculative.py: the bundled model's
kernels, and PyTorch's int4 kernel at a 7B model's shapes, take 3.5x a row's time for 5 rows), so the CPU's default
is 0.5; on a GPU, where the rows come nearly free, 0.1.
"""

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine.core.sequence import Sequence
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    from engine.runner.model_runner import ModelRunner

MAX_BACKOFF_STEPS = 32
ACCEPTANCE_WEIGHT = 0.5  # of the latest step in the moving average of a request's acceptance
DEFAULT_MIN_ACCEPTANCE = {"cpu": 0.5, "cuda": 0.1}
log = logging.getLogger("engine")


@dataclass
class DraftState:
    """A request's speculation: how many tokens to propose next, and the steps it sits out after a miss."""

    length: int
    skip_steps: int = 0
    misses: int = 0
    # What came of its drafts so far, for its reply's stats line: steps that checked drafts, drafted, accepted
    steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance: float = 1.0  # moving average of the share of its drafts accepted


@dataclass
class SpeculationStats:
    steps: int = 0  # request-steps that checked drafts
    draft_tokens: int = 0  # tokens proposed
    accepted_tokens: int = 0  # of those, accepted


def speculates(seq: Sequence) -> bool:
    params = seq.sampling_params
    return (
        seq.grammar is None
        and not seq.wants_logprobs
        and params.repetition_penalty == 1.0
        and not params.presence_penalty
        and not params.frequency_penalty
    )


class Proposer(Protocol):
    runner: "ModelRunner | None"  # a draft model's, whose background compile must wait for the engine too

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to `length` drafted tokens for each (request, length)."""

    def retain(self, seqs: list[Sequence]) -> None:
        """Drop what is kept for requests other than these (the running ones)."""

    def release(self) -> None:
        """Let go of the memory it holds (a draft model's weights and cache)."""


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, min_acceptance: float = 0.0):
        self.config = config
        self.proposer = proposer
        self.min_acceptance = min_acceptance
        self.stats = SpeculationStats()
        self.failed = False  # proposing raised once: no more drafts (the engine serves on without them)

    def propose(self, seqs: list[Sequence]) -> None:
        """Set each running request's `draft_token_ids` for its next step: empty for one that prefills, has a token
        in flight, sits out, or may not speculate."""
        if not self.failed:
            self.proposer.retain(seqs)
        wanted = []
        for seq in seqs:
            seq.draft_token_ids = []
            if seq.num_uncomputed_tokens != 1 or seq.num_pending_tokens or not speculates(seq):
                continue
            state = seq.draft_state or DraftState(self.config.num_speculative_tokens)
            seq.draft_state = state
            if state.skip_steps:
                state.skip_steps -= 1
                continue
            # the step samples one token after the drafts: all of them must fit under the request's length limit
            room = seq.max_len - len(seq) - 1
            if min(state.length, room) > 0:
                wanted.append((seq, min(state.length, room)))
        if self.failed:  # else even with none wanted: an MTP head reads every step's new tokens (spec_decode/mtp.py)
            return
        try:
            proposals = self.proposer.propose(wanted)
        except Exception:  # a draft model's step: the replies go on without drafts rather than end
            log.exception("speculative decoding stopped: proposing drafts failed; replies go on without it")
            self.failed = True
            self.proposer.release()
            return
        for (seq, _), drafts in zip(wanted, proposals, strict=True):
            seq.draft_token_ids = drafts

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """What a step made of `seq`'s drafts, for the next proposal's length and for stats()."""
        self.stats.steps += 1
        self.stats.draft_tokens += num_drafted
        self.stats.accepted_tokens += num_accepted
        state = seq.draft_state
        state.steps, state.draft_tokens = state.steps + 1, state.draft_tokens + num_drafted
        state.accepted_tokens += num_accepted
        if num_drafted:
            state.acceptance += ACCEPTANCE_WEIGHT * (num_accepted / num_drafted - state.acceptance)
        if not num_accepted or state.acceptance < self.min_acceptance:
            state.length = 1
            state.skip_steps = min(MAX_BACKOFF_STEPS, 1 << state.misses)
            state.misses += 1
        elif num_accepted == num_drafted:
            state.length, state.misses = self.config.num_speculative_tokens, 0
        else:
            state.length, state.misses = num_accepted + 1, 0


def make_speculator(config: SpeculativeConfig | None, target) -> "Speculator | None":
    """The engine's Speculator for `config` (None: no speculation), refused for a model it cannot serve yet.
    `target`: the engine being loaded; a draft model is loaded beside its runner."""
    if config is None:
        return None
    if target.model_runner.state_slots[0] and target.device.type != "cpu":
        raise ValueError(
            "speculative decoding with a model whose layers keep a recurrent state (Qwen3.5, Qwen3-Next) runs on the "
            "CPU only for now (its GPU kernels do not yet keep the state after each checked draft); load without "
            "speculative_config, or on the CPU"
        )
    least = config.min_acceptance_rate
    if least is None:
        least = DEFAULT_MIN_ACCEPTANCE.get(target.device.type, 0.0)
    if config.method == "ngram":
        return Speculator(config, NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max), least)
    if config.method == "mtp":
        from engine.spec_decode.mtp import load_mtp_proposer

        return Speculator(config, load_mtp_proposer(target), least)
    from engine.spec_decode.draft_loader import load_draft_model

    return Speculator(config, load_draft_model(config.model, target), least)
