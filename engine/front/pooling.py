"""Embeddings: each input's final hidden states pooled into one vector, for `LLM.embed` and /v1/embeddings.

An embedding model is a decoder whose head never runs. Its inputs are prefilled through the engine's own
scheduler, block manager and runner, chunked and preempted as any prompt, and each one's hidden states are
pooled as the checkpoint's sentence-transformers files say: the last token's (Qwen3-Embedding), their mean,
or the first token's; then scaled to unit length where its modules end in a Normalize.
"""

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.core.sequence import Sequence, SequenceStatus
from engine.front.outputs import EmbeddingOutput
from engine.front.sampling_params import SamplingParams

log = logging.getLogger("pagoda.engine")

POOLING_KINDS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
# sentence-transformers 3+ names the mode in one field
POOLING_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
# GGUF's `{arch}.pooling_type`, as llama.cpp numbers them
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
# Qwen3-Embedding is trained for any output size from 32 up (its model card's "MRL support"), and its config
# does not say so: a Qwen3 network pooled at its last token is taken to be one.
QWEN3_MIN_DIMENSIONS = 32


@dataclass(frozen=True)
class PoolingConfig:
    """How an embedding model makes one vector of an input's hidden states."""

    kind: str  # "last" (the last token's state), "mean" (of every token's) or "cls" (the first token's)
    normalize: bool  # scaled to unit length (after any truncation to `dimensions`)
    hidden_size: int  # the vector's full length
    # The lengths it may be truncated to (Matryoshka representation learning); empty: only its full length
    dimensions: tuple[int, ...] = ()

    def check_dimensions(self, dimensions: int | None) -> int:
        """The vector length a request asking for `dimensions` (None: the full one) gets, or a ValueError."""
        if dimensions is None or dimensions == self.hidden_size:
            return self.hidden_size
        if not self.dimensions:
            raise ValueError(
                f"this model gives {self.hidden_size}-dimensional embeddings and was not trained to be truncated; "
                "leave `dimensions` out"
            )
        if dimensions not in self.dimensions:
            allowed = self.dimensions
            said = (
                f"{allowed[0]} to {allowed[-1]}"
                if list(allowed) == list(range(allowed[0], allowed[-1] + 1))
                else ", ".join(map(str, allowed))
            )
            raise ValueError(f"`dimensions` must be one of {said} for this model, got {dimensions}")
        return dimensions


def sentence_transformers_pooling(folder: Path) -> tuple[str, bool] | None:
    """(kind, normalize) from a sentence-transformers checkpoint's modules.json, or None if it has none."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    types = [m.get("type", "") for m in modules]
    normalize = any(t.endswith(".Normalize") for t in types)
    pooling = next((m for m in modules if m.get("type", "").endswith(".Pooling")), None)
    if pooling is None:
        return None
    settings = json.loads((folder / pooling.get("path", "1_Pooling") / "config.json").read_text())
    mode = settings.get("pooling_mode")
    kinds = [POOLING_MODES.get(mode, mode)] if mode else [k for key, k in POOLING_KINDS.items() if settings.get(key)]
    others = [
        key for key, on in settings.items() if key.startswith("pooling_mode_") and on and key not in POOLING_KINDS
    ]
    if others or len(kinds) != 1 or kinds[0] not in POOLING_KINDS.values():
        raise ValueError(
            f"{folder.name} pools its tokens by {others or kinds or 'nothing'}; Pagoda pools by the last token, "
            "the mean or the first token"
        )
    return kinds[0], normalize


def is_embedding_checkpoint(checkpoint, hf_config) -> bool:
    """Whether a checkpoint is an embedding model: a sentence-transformers pooling module, a GGUF that says it
    pools, or a bare decoder (`Qwen3Model` and the like) with no head to generate with."""
    if isinstance(checkpoint, Path):
        if (checkpoint / "modules.json").is_file() and sentence_transformers_pooling(checkpoint) is not None:
            return True
    elif int(checkpoint.metadata(f"{checkpoint.architecture}.pooling_type", 0) or 0) in GGUF_POOLING:
        return True
    return any(a.endswith("Model") for a in (getattr(hf_config, "architectures", None) or []))


def pooling_config(checkpoint, hf_config) -> PoolingConfig:
    """How the checkpoint (a folder or a GGUFCheckpoint) pools. Without a word on it: the last token, normalized,
    as vLLM pools a decoder."""
    found = None
    if isinstance(checkpoint, Path):
        found = sentence_transformers_pooling(checkpoint)
    else:
        kind = GGUF_POOLING.get(int(checkpoint.metadata(f"{checkpoint.architecture}.pooling_type", 0) or 0))
        found = (kind, True) if kind else None  # llama.cpp's server normalizes embeddings by default
    if found is None:
        log.info("the checkpoint does not say how it pools: the last token's hidden state, normalized")
        found = ("last", True)
    kind, normalize = found
    hidden = hf_config.hidden_size
    listed = getattr(hf_config, "matryoshka_dimensions", None)
    if listed:
        dimensions = tuple(sorted(int(d) for d in listed if 0 < int(d) <= hidden))
    elif getattr(hf_config, "is_matryoshka", False):
        dimensions = tuple(range(1, hidden + 1))
    elif getattr(hf_config, "model_type", None) == "qwen3" and kind == "last":
        dimensions = tuple(range(min(QWEN3_MIN_DIMENSIONS, hidden), hidden + 1))
    else:
        dimensions = ()
    return PoolingConfig(kind, normalize, hidden, dimensions)


def resolve_runner(requested: str, checkpoint, hf_config) -> str:
    """What the engine does with this checkpoint: "generate" or "pooling" ("auto": what the checkpoint is)."""
    embedding = is_embedding_checkpoint(checkpoint, hf_config)
    if requested == "auto":
        return "pooling" if embedding else "generate"
    if requested == "generate" and embedding:
        raise ValueError(
            "this checkpoint is an embedding model (it pools its hidden states and has no head to generate with), "
            "not a chat model: serve it beside one with --embedding-model, or load it with runner='pooling' and "
            "call embed()"
        )
    return requested


class PoolingAccumulator:
    """One input's pooled state while its prefill runs chunk by chunk."""

    def __init__(self, kind: str):
        self.kind = kind
        self.total: torch.Tensor | None = None

    def add(self, rows: torch.Tensor, first_position: int) -> None:
        if first_position == 0:  # a fresh start, or a restart after preemption
            self.total = None
        if self.kind == "mean":
            chunk = rows.float().sum(dim=0)
            self.total = chunk if self.total is None else self.total + chunk
        elif self.kind == "last":
            self.total = rows[-1].float()
        elif first_position == 0:
            self.total = rows[0].float()

    def vector(self, num_tokens: int) -> torch.Tensor:
        return self.total / num_tokens if self.kind == "mean" else self.total


def finish_vector(vector: torch.Tensor, pooling: PoolingConfig, dimensions: int) -> torch.Tensor:
    """The pooled vector truncated to `dimensions` and, where the model normalizes, scaled to unit length."""
    vector = vector[:dimensions]
    return torch.nn.functional.normalize(vector, dim=0) if pooling.normalize else vector


@torch.inference_mode()
def pool_prompts(engine, token_lists: list[list[int]], pooling: PoolingConfig) -> list[torch.Tensor]:
    """The pooled (untruncated, unnormalized) final hidden state of each token list, in order, on the host in
    float32. Runs the engine's steps itself: the engine must have no other request in flight."""
    if engine.scheduler.has_unfinished():
        raise RuntimeError("this engine is running other requests; an embedding model serves embed() alone")
    runner = engine.model_runner
    seqs = [Sequence(ids, SamplingParams(max_tokens=1), max_model_len=engine.max_model_len) for ids in token_lists]
    pooled: dict[int, PoolingAccumulator] = {seq.seq_id: PoolingAccumulator(pooling.kind) for seq in seqs}
    for seq in seqs:
        engine.scheduler.add(seq)
    try:
        while engine.scheduler.has_unfinished():
            batch = engine.scheduler.schedule()
            if not batch:
                raise RuntimeError("the KV cache cannot hold the next input; give the model a larger kv_cache")
            step = runner.prepare(batch)
            input_ids, positions, meta, _, _ = runner.to_device(step)
            hidden = runner.forward(input_ids, positions, meta)
            start = 0
            for item in batch:
                seq, n = item.seq, item.num_new_tokens
                pooled[seq.seq_id].add(hidden[start : start + n], seq.num_computed_tokens)
                start += n
                seq.num_computed_tokens += n
                if item.samples:  # its last token is in: its vector is whole
                    seq.status = SequenceStatus.FINISHED
                    engine.scheduler.remove(seq)
    except BaseException:
        for seq in seqs:  # leave the engine clean for the next call
            if not seq.is_finished:
                engine.scheduler.remove(seq)
        raise
    return [pooled[seq.seq_id].vector(len(seq)).cpu() for seq in seqs]


def set_up_pooling(config, hf_config) -> None:
    """Settings an embedding model runs under, before anything is built. It never decodes, so it captures and
    compiles no decode steps; its vectors need every token's hidden state, so no prefix comes from the cache;
    its head never runs, so it is tied to the embedding table (no memory, and the checkpoints that
    sentence-transformers saves without one load)."""
    if config.tensor_parallel_size > 1:
        raise ValueError("embedding models run on one device; leave tensor_parallel_size at 1")
    config.enforce_eager, config.enable_prefix_caching = True, False
    hf_config.tie_word_embeddings = True


def encode_input(engine, text: str | list[int], truncate: bool = False) -> list[int]:
    """An input's token ids, with the special tokens its tokenizer adds (Qwen3-Embedding's closing
    <|endoftext|>, whose state is its embedding), refused with a ValueError where the model cannot read it.
    `truncate`: one longer than the model reads is cut to its first tokens instead (as Ollama does)."""
    if isinstance(text, str):
        ids = engine.tokenizer.encode(text)
    elif isinstance(text, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in text):
        ids = list(text)
    else:
        raise TypeError(f"an input is a string or a list of token ids, got {type(text).__name__}")
    if not ids:
        raise ValueError("an input is empty; give at least one token")
    vocab = engine.model_runner.vocab_size
    outside = [t for t in ids if not 0 <= t < vocab]
    if outside:
        raise ValueError(f"token ids {outside[:5]} are outside the vocabulary (0..{vocab - 1})")
    most = min(engine.max_model_len, engine.block_manager.num_blocks * engine.block_manager.block_size)
    if truncate:
        ids = ids[:most]
    if len(ids) > most:
        raise ValueError(f"an input has {len(ids)} tokens, and this model reads at most {most}; shorten it")
    return ids


def embed_prompts(engine, prompts, dimensions: int | None = None, truncate: bool = False) -> list[EmbeddingOutput]:
    """`LLM.embed`: one EmbeddingOutput per input, in order. Every input is checked before any runs."""
    if engine.pooling is None:
        raise ValueError(
            f"{engine.config.model} is a chat model, which makes no embeddings; load an embedding model (such as "
            "Qwen/Qwen3-Embedding-0.6B) with runner='pooling'"
        )
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(
            f"inputs must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}"
        )
    size = engine.pooling.check_dimensions(dimensions)
    token_lists = [encode_input(engine, p, truncate) for p in prompts]
    vectors = pool_prompts(engine, token_lists, engine.pooling)
    return [
        EmbeddingOutput(finish_vector(v, engine.pooling, size).tolist(), ids)
        for v, ids in zip(vectors, token_lists, strict=True)
    ]
