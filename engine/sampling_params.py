"""Per-request sampling settings, with vLLM's names and meanings."""
from dataclasses import dataclass, field

# The most top tokens `logprobs` and `prompt_logprobs` may ask for: vLLM's default max_logprobs, and
# OpenAI's top_logprobs limit. Each asked-for token costs a top-k over the vocabulary per row.
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) means the whole vocabulary
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 64
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    # Log probabilities of the model's raw distribution (before temperature, penalties, top-k/p):
    # per generated token, the sampled token and the `logprobs` most likely ones (0: the sampled one only)
    logprobs: int | None = None
    # per prompt token after the first, that token and the `prompt_logprobs` most likely ones
    prompt_logprobs: int | None = None
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"SamplingParams: {message}")

        check(self.temperature >= 0, f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        check(self.top_k == -1 or self.top_k >= 0, f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        check(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
              f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        check(self.seed is None or isinstance(self.seed, int), f"seed must be an int or None, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            check(k is None or (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_LOGPROBS),
                  f"{name} must be None (off) or an int from 0 to {MAX_LOGPROBS} (the top tokens to return "
                  f"besides the chosen one), got {k!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        check(all(isinstance(s, str) and s for s in stop), f"stop must be non-empty strings, got {self.stop!r}")
        self.stop_list = stop
        ids = list(self.stop_token_ids or [])
        check(all(isinstance(t, int) for t in ids), f"stop_token_ids must be ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = ids

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
