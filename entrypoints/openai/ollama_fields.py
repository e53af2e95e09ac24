"""Ollama's names for fields of OpenAI's API, as Open WebUI sends them when a user sets them: the ones with a
counterpart here are taken under it, runtime options are ignored (and the response says so), and sampler options
Pagoda does not have are refused by name."""

from typing import TYPE_CHECKING

from entrypoints.openai.errors import APIError

if TYPE_CHECKING:
    from entrypoints.openai.protocol import RequestBody

# Ollama's sampling options that Pagoda's sampler does not have: refused by name (protocol.REFUSED_FIELDS)
OLLAMA_SAMPLER_FIELDS = {
    name: f"{name} (Ollama's sampler option) is not supported; leave it out"
    for name in (
        "mirostat",
        "mirostat_eta",
        "mirostat_tau",
        "tfs_z",
        "typical_p",
        "repeat_last_n",
        "penalize_newline",
    )
}
# Ollama's runtime options, as Open WebUI sends them: they do not change a reply, and here the server's own settings
# decide them, so they are ignored and the response says so (X-Pagoda-Ignored)
OLLAMA_RUNTIME_FIELDS = {
    "num_ctx": "the context is set when the model loads (--max-model-len)",
    "keep_alive": "the server decides how long a model stays loaded (its --ttl)",
    "num_thread": "the server sets its threads",
    "num_gpu": "the server places the model",
    "num_batch": "the server batches requests itself",
    "num_keep": "Pagoda never drops the start of a prompt",
    "use_mmap": "the server loads the model",
    "use_mlock": "the server loads the model",
}


def adopt_ollama_fields(body: "RequestBody") -> None:
    """Ollama's names for fields this API has (Open WebUI sends them as a user set them): `repeat_penalty`,
    `num_predict`, `format` ("json" or a schema) and `think`. Sent under both names, they are refused."""
    extra = body.model_extra or {}

    def adopt(ollama: str, ours: str, value) -> None:
        if ours in body.model_fields_set or (ours == "response_format" and body.structured_outputs):
            raise APIError(400, f"{ollama} is Ollama's name for {ours}: send one of them", param=ollama)
        setattr(body, ours, value)

    if "repeat_penalty" in extra:
        value = extra["repeat_penalty"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise APIError(400, f"repeat_penalty must be a number above 0, got {value!r}", param="repeat_penalty")
        adopt("repeat_penalty", "repetition_penalty", float(value))
    if extra.get("num_predict") not in (None, -1):  # -1: Ollama's "no limit"
        value = extra["num_predict"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise APIError(400, f"num_predict must be a positive integer, got {value!r}", param="num_predict")
        adopt("num_predict", "max_tokens", value)
    if extra.get("format") not in (None, ""):
        value = extra["format"]
        if value == "json":
            adopt("format", "response_format", {"type": "json_object"})
        elif isinstance(value, dict):
            adopt("format", "response_format", {"type": "json_schema", "json_schema": {"schema": value}})
        else:
            raise APIError(400, f'format must be "json" or a JSON schema, got {value!r}', param="format")
    if extra.get("think") is not None:
        value = extra["think"]
        levels = {True: "medium", False: "none", "low": "low", "medium": "medium", "high": "high"}
        if not isinstance(value, (bool, str)) or value not in levels:
            raise APIError(400, f'think must be true, false, "low", "medium" or "high", got {value!r}', param="think")
        adopt("think", "reasoning_effort", levels[value])
    body.ignored.extend(f"{name}: {why}" for name, why in OLLAMA_RUNTIME_FIELDS.items() if name in extra)
