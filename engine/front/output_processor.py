"""What a request's sampled token makes: whether the request finishes (eos, a stop token id, a finished grammar,
its length, a stop string), the text it may release, and its RequestOutput; and the logprobs a step computed,
shared out to the requests that asked. LLMEngine removes a finished request from its queues itself."""

from engine.core.sequence import Sequence
from engine.front.detokenizer import Detokenizer
from engine.front.outputs import RequestOutput
from engine.runner.model_runner import LaunchedStep


def take_logprobs(launched: LaunchedStep, tokens: list[int]) -> list[dict[int, float]]:
    """The sampled tokens' logprobs, for the rows that asked (in order), and each request's prompt
    logprobs from this step's rows, appended to its list (a position it already has, computed again
    after a preemption, is skipped)."""
    plan = launched.logprobs_plan
    if launched.prompt_logprobs is not None:
        ks = [seq.sampling_params.prompt_logprobs for seq, _, n in plan.prompt_segments for _ in range(n)]
        rows = iter(launched.prompt_logprobs.dicts(plan.prompt_token_ids.tolist(), ks))
        for seq, first, n in plan.prompt_segments:
            for position in range(first, first + n):
                row = next(rows)
                if position + 1 == len(seq.prompt_logprobs):  # the entry for token position + 1
                    seq.prompt_logprobs.append(row)
    if launched.sample_logprobs is None:
        return []
    # a sequence per row of sampled tokens: one per draft a request checked, and one more
    launched_seqs = [item.seq for item in launched.batch if item.samples for _ in range(1 + len(item.draft_token_ids))]
    rows = plan.sample_rows.tolist()
    return launched.sample_logprobs.dicts(
        [tokens[r] for r in rows], [launched_seqs[r].sampling_params.logprobs for r in rows]
    )


def finish_reason(seq: Sequence, token: int, eos_token_ids: set[int], detokenizer: Detokenizer) -> str | None:
    """Why `seq` ends with `token` (its last token id): "stop", "length", "error" (its constraint failed:
    `Grammar.failure` says why), or None while it goes on. Its text
    is brought up to date on the way (trimmed at a stop string), or decoded once at the end if nobody reads
    it before."""
    params = seq.sampling_params
    reason = None
    if seq.grammar is not None and seq.grammar.failure:  # before the end token a failed constraint forces
        reason = "error"
    elif token in params.stop_token_ids:
        reason, seq.stop_reason = "stop", token
    elif token in eos_token_ids and not params.ignore_eos:
        reason = "stop"
    elif seq.grammar is not None and seq.grammar.finished:  # the reply is complete: nothing more may follow
        reason = "stop"
    elif len(seq.token_ids) >= seq.max_len:  # max_tokens, or the context is full
        reason = "length"
    if seq.stream_text or params.stop_list:
        detokenizer.update(seq, final=reason is not None)
    elif reason is not None:  # nobody reads text before the end: decode once, not per token
        seq.output_text = detokenizer.decode(seq.output_token_ids)
    if params.stop_list:
        reason = apply_stop_strings(seq) or reason
    return reason


def request_output(
    seq: Sequence, token: int, reason: str | None, token_logprobs: dict[int, float] | None
) -> RequestOutput:
    """`seq`'s output for its new `token`: the text released since the last one, and at the end the whole reply."""
    params = seq.sampling_params
    # Hold back text that may turn out to be the start of a stop string.
    hold = max(len(s) for s in params.stop_list) - 1 if params.stop_list and not reason else 0
    upto = max(seq.num_emitted_chars, len(seq.output_text) - hold)
    new_text = seq.output_text[seq.num_emitted_chars : upto]
    seq.num_emitted_chars = upto
    first = len(seq.token_ids) == seq.num_prompt_tokens + 1
    return RequestOutput(
        seq.request_id,
        new_text,
        [token],
        reason is not None,
        reason,
        seq.num_prompt_tokens,
        seq.num_cached_tokens,
        seq.output_token_ids if reason else [],
        None if token_logprobs is None else [token_logprobs],
        seq.prompt_logprobs if first else None,
        seq.grammar.failure if reason == "error" else None,
        seq.stop_reason if reason == "stop" else None,
        speculation_of(seq) if reason else None,
    )


def speculation_of(seq: Sequence) -> tuple[int, int, int] | None:
    """What came of `seq`'s drafts: (steps that checked them, drafted, accepted); None if it checked none."""
    state = seq.draft_state
    if state is None or not state.steps:
        return None
    return state.steps, state.draft_tokens, state.accepted_tokens


def apply_stop_strings(seq: Sequence) -> str | None:
    """Trim the output at the first stop string, if one has appeared."""
    text = seq.output_text
    # Only the new text and what precedes it by a stop string's length can hold a new match.
    window = max(len(s) for s in seq.sampling_params.stop_list) + 16
    start = max(0, seq.num_emitted_chars - window)
    hits = [i for i in (text.find(s, start) for s in seq.sampling_params.stop_list) if i >= 0]
    if not hits:
        return None
    first = min(hits)
    seq.output_text = text[:first]
    seq.stop_reason = next(s for s in seq.sampling_params.stop_list if text.find(s, start) == first)
    return "stop"
