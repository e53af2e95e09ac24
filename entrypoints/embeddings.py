"""Embeddings over HTTP: the embedding model served beside the chat model, found by the name a request gives, and
the one path into it that OpenAI's /v1/embeddings and Ollama's /api/embed share."""

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from engine import LLM
from engine.front.engine_thread import in_a_passing_thread
from entrypoints.openai.errors import APIError
from entrypoints.openai.serving import ModelSource, refuse_what_cannot_fit

log = logging.getLogger("pagoda.api")

# OpenAI's own bound on the inputs of one request
MAX_INPUTS = 2048


@dataclass
class ServedEmbedder:
    """The embedding model the API serves and the name clients ask for it by."""

    llm: LLM
    name: str
    # LLM.embed runs the engine's steps itself: one call at a time
    lock: threading.Lock = field(default_factory=threading.Lock)


# None: no embedding model is loaded
EmbedderSource = Callable[[], ServedEmbedder | None]


# The chat model's settings that the embedding model shares: the rest (its KV cache, batch) are a chat's
SHARED_SETTINGS = ("device", "dtype", "attention_backend", "seed")


def load_embedder(model: str, chat_settings: dict) -> ServedEmbedder:
    """The embedding model `model` names (a folder, GGUF file or hub repo id), on the chat model's device,
    served by its folder or repo name."""
    settings = {k: v for k, v in chat_settings.items() if k in SHARED_SETTINGS}
    llm = in_a_passing_thread(lambda: LLM(model, runner="pooling", **settings), "pagoda-embedding-load")
    return ServedEmbedder(llm, Path(model.rstrip("/")).name or model)


def no_embeddings(model: str) -> APIError:
    """What a request for embeddings from a chat model gets."""
    return APIError(
        400,
        f"{model!r} is a chat model, which makes no embeddings: embeddings need an embedding model (such as "
        "Qwen/Qwen3-Embedding-0.6B) served beside it: start the server with --embedding-model",
        code="model_not_embedding",
        param="model",
    )


def find_embedder(embedders: EmbedderSource | None, models: ModelSource, asked: str | None) -> ServedEmbedder:
    """The embedding model a request names (None or empty: the one there is), or a 400/404/503 that says what to
    do. `embedders` may raise APIError to say why there is none yet (still loading, say)."""
    unavailable = None
    try:
        embedder = embedders() if embedders is not None else None
    except APIError as e:
        embedder, unavailable = None, e
    if embedder is not None and (not asked or asked == embedder.name):
        return embedder
    try:
        chat = models()
    except APIError:
        chat = None
    if chat is not None and (asked == chat.name or (not asked and unavailable is None)):
        raise no_embeddings(chat.name)
    if unavailable is not None:
        raise unavailable
    if embedder is None:
        raise APIError(
            404,
            f"the model {asked!r} does not exist, and no embedding model is loaded: start Pagoda with "
            "--embedding-model (such as Qwen/Qwen3-Embedding-0.6B)",
            code="model_not_found",
            param="model",
        )
    raise APIError(
        404,
        f"the model {asked!r} does not exist; this server's embedding model is {embedder.name!r}",
        code="model_not_found",
        param="model",
    )


def listed_embedder(embedders: EmbedderSource | None) -> ServedEmbedder | None:
    """The embedding model to list among the served ones: None while there is none, or it is loading."""
    try:
        return embedders() if embedders is not None else None
    except APIError:
        return None


class EmbedderLoad:
    """An embedding model loading in a thread of its own while the app's pages already answer: the API's
    EmbedderSource, which says "loading" (or why it did not load) with a 503 until it is ready."""

    def __init__(self, model: str, chat_settings: dict):
        self.model, self.embedder, self.error = model, None, None
        self.thread = threading.Thread(target=self._load, args=(chat_settings,), name="pagoda-embedding", daemon=True)
        self.thread.start()

    def _load(self, chat_settings: dict) -> None:
        try:
            self.embedder = load_embedder(self.model, chat_settings)
            log.info("embedding model %s is ready for /v1/embeddings", self.model)
        except Exception as e:  # said to every request for embeddings, and in the log
            log.exception("the embedding model %s did not load", self.model)
            self.error = e

    def __call__(self) -> ServedEmbedder | None:
        if self.embedder is not None:
            return self.embedder
        if self.error is not None:
            message = f"the embedding model {self.model} did not load ({self.error}); start Pagoda with another one"
        else:
            message = f"Loading the embedding model {self.model}; try again when it is ready"
        raise APIError(503, message, type="server_error", code="model_not_loaded")


async def embed(
    embedder: ServedEmbedder, inputs: list[str | list[int]], dimensions: int | None, truncate: bool = False
) -> tuple[list[list[float]], int]:
    """Each input's embedding, in order, and the tokens read; a 400 naming the field for what the model cannot do."""
    if not inputs:
        raise APIError(400, "input is empty: send a string or a list of them", param="input")
    if len(inputs) > MAX_INPUTS:
        raise APIError(400, f"input has {len(inputs)} items; send at most {MAX_INPUTS} a request", param="input")
    try:
        embedder.llm.pooling.check_dimensions(dimensions)
    except ValueError as e:
        raise APIError(400, str(e), param="dimensions") from None
    if not truncate:
        for item in inputs:
            if isinstance(item, str):
                refuse_what_cannot_fit(embedder.llm, len(item), "input")

    def run():
        with embedder.lock:
            return in_a_passing_thread(
                lambda: embedder.llm.embed(inputs, dimensions, truncate=truncate), "pagoda-embed"
            )

    try:
        outputs = await anyio.to_thread.run_sync(run)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param="input") from None
    return [o.embedding for o in outputs], sum(len(o.prompt_token_ids) for o in outputs)
