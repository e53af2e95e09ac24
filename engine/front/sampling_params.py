"""Per-request sampling settings, with vLLM's names and meanings."""

import json
from dataclasses import dataclass, field

# OpenAI's ranges: penalties in [-2, 2] (negative ones encourage repeats), logit biases in [-100, 100].
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
# The most top tokens `logprobs` and `prompt_logprobs` may ask for: vLLM's default max_logprobs, and
# OpenAI's top_logprobs limit. Each asked-for token costs a top-k over the vocabulary per row.
MAX_LOGPROBS = 20


@dataclass
class StructuredOutputsParams:
    """vLLM's structured-output constraint: the reply must match exactly one of these
    (engine/sample/structured_output.py compiles it to a token mask with llguidance)."""

    json: dict | str | None = None  # a JSON schema (a dict, or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None  # the reply is one of these strings
    grammar: str | None = None  # a Lark grammar (llguidance's dialect) or a GBNF one (llama.cpp's)
    json_object: bool = False  # any JSON object

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams: give exactly one of json, regex, choice, grammar or "
                f"json_object, got {', '.join(given) or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"StructuredOutputsParams: json is not valid JSON text ({e})") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"StructuredOutputsParams: json must be a JSON schema (an object), got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputsParams: {name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                f"StructuredOutputsParams: choice must be a list of non-empty strings, got {self.choice!r}"
            )

    def key(self) -> str:
        """The constraint as one string, the same for equal constraints (compiled grammars are cached by it)."""
        return json.dumps([self.json, self.regex, self.choice, self.grammar, self.json_object], sort_keys=True)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) means the whole vocabulary
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # Subtracted from a token's logit if it appears in the output so far (presence), and once per time it
    # appears (frequency): OpenAI's and vLLM's meanings. The prompt does not count.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Added to the logits of the given token ids before anything else: -100 all but bans a token, 100
    # all but forces it
    logit_bias: dict[int, float] | None = None
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
    # The reply must match a JSON schema, regex, choice or grammar (constrained decoding)
    structured_outputs: StructuredOutputsParams | None = None
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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            check(
                number and -MAX_PENALTY <= value <= MAX_PENALTY,
                f"{name} must be a number from -{MAX_PENALTY:g} to {MAX_PENALTY:g}, got {value!r}",
            )
        bias = dict(self.logit_bias or {})
        for token, value in bias.items():
            check(
                isinstance(token, int) and not isinstance(token, bool) and token >= 0,
                f"logit_bias keys must be token ids (ints >= 0), got {token!r}",
            )
            check(
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS,
                f"logit_bias values must be numbers from -{MAX_LOGIT_BIAS:g} to {MAX_LOGIT_BIAS:g}, got {value!r} "
                f"for token {token}",
            )
        self.logit_bias = bias or None
        check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            f"max_tokens must be an int >= 1, got {self.max_tokens!r}",
        )
        check(
            self.seed is None
            or (isinstance(self.seed, int) and not isinstance(self.seed, bool) and -(2**63) <= self.seed < 2**64),
            f"seed must be None or an int from -2**63 to 2**64 - 1 (what torch's generators take), got {self.seed!r}",
        )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            check(
                k is None or (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_LOGPROBS),
                f"{name} must be None (off) or an int from 0 to {MAX_LOGPROBS} (the top tokens to return "
                f"besides the chosen one), got {k!r}",
            )
        check(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}",
        )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        check(all(isinstance(s, str) and s for s in stop), f"stop must be non-empty strings, got {self.stop!r}")
        self.stop_list = stop
        ids = list(self.stop_token_ids or [])
        check(all(isinstance(t, int) for t in ids), f"stop_token_ids must be ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = ids

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
