"""`speculative_config`, with vLLM's names: {"method": "ngram", "num_speculative_tokens": k, ...}, or
{"method": "draft", "model": <a smaller model with the same tokenizer>, "num_speculative_tokens": k}, or
{"method": "mtp", "num_speculative_tokens": k} for a model that ships a multi-token-prediction head."""

from dataclasses import dataclass, fields

METHODS = ("ngram", "draft", "mtp")
ALIASES = {"draft_model": "draft", "qwen3_next_mtp": "mtp"}  # vLLM's names, old and new
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4  # the most tokens proposed per request and step
    # n-gram (prompt lookup): the longest and shortest suffix of the request's tokens searched for earlier in them
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # draft: the draft model, a GGUF file, a folder or a hub repo, as `model` is given
    model: str | None = None
    # Pagoda's: a request whose drafts are accepted less often than this sits out for a while (default: 0.5 on a
    # CPU, where a checked draft costs about half a decode step; 0.1 on a GPU; 0 never sits out)
    min_acceptance_rate: float | None = None

    @classmethod
    def parse(cls, value: "dict | SpeculativeConfig") -> "SpeculativeConfig":
        """A SpeculativeConfig from what a user gives: a dict with vLLM's keys, or one already made."""
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise TypeError(
                "speculative_config is a dict such as {'method': 'ngram', 'num_speculative_tokens': 4}, "
                f"got {type(value).__name__}"
            )
        value = dict(value)
        if "method" not in value and value.get("model"):  # vLLM reads a draft model's config without a method
            value["method"] = "draft"
        if "method" not in value:
            raise ValueError(f"speculative_config needs a 'method', one of {METHODS}")
        value["method"] = ALIASES.get(value["method"], value["method"])
        check_method(value["method"])  # first: vLLM's keys of a method not served yet are not "unknown"
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; known keys are {sorted(known)}")
        return cls(**value)

    def __post_init__(self) -> None:
        check_method(self.method)
        for name, low, high in (
            ("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS),
            ("prompt_lookup_max", 1, 64),
            ("prompt_lookup_min", 1, 64),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"speculative_config {name} must be a whole number in {low}..{high}, got {value!r}")
        rate = self.min_acceptance_rate
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1):
            raise ValueError(f"speculative_config min_acceptance_rate must be a number in 0..1, got {rate!r}")
        if self.method == "draft" and not (isinstance(self.model, str) and self.model.strip()):
            raise ValueError(
                'speculative_config method "draft" needs a "model": a smaller model with the same tokenizer, '
                "as a GGUF file, a folder or a hub repo"
            )
        if self.method != "draft" and self.model is not None:
            raise ValueError(f'speculative_config "model" is the draft model of method "draft", not {self.method!r}')
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )


def check_method(method: object) -> None:
    if method not in METHODS:
        raise ValueError(f"speculative_config method must be one of {METHODS}, got {method!r}")
