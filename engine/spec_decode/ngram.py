"""N-gram (prompt lookup) proposals, as vLLM's `ngram` method makes them: find the request's last few tokens
earlier in its own prompt and output, and propose what followed them there. Free to compute, and right exactly
where a reply repeats its context: an edited file, quoted code, a summary that cites."""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.core.sequence import Sequence


class NgramProposer:
    runner = None  # no model of its own

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to `length` drafted tokens for each (request, length), from its own tokens."""
        return [self.lookup(seq.token_ids, length) for seq, length in requests]

    def retain(self, seqs: list[Sequence]) -> None:
        """Nothing is kept between steps."""

    def release(self) -> None:
        pass

    def lookup(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the latest earlier occurrence of the longest suffix of
        `token_ids` (of `prompt_lookup_max` down to `prompt_lookup_min` tokens) that occurs earlier; none if none."""
        if max_tokens <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # windows start at 0 .. len - n - 1: each has a following token, and none is the suffix itself
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + max_tokens].tolist()
        return []
