"""What a model string opens for the engine: its checkpoint (a GGUF file, or a folder or hub repo), the model's
config and tokenizer, and the token ids that end a reply. Nothing here loads weights: the runner does."""

import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from engine.config import EngineConfig
from engine.loader import GGUFCheckpoint, check_not_prequantized, resolve_gguf, resolve_model_path
from engine.quantization.methods import refuse_requantizing

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "tiktoken.model")


def load_tokenizer(path: str):
    """The folder's tokenizer. A folder without one ended in transformers' advice to install
    sentencepiece or tiktoken, which would not help: say what is missing."""
    from transformers import AutoTokenizer

    folder = Path(path)
    if folder.is_dir() and not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{folder} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...): copy the model's "
            "tokenizer files into it, or load the model from its hub repo"
        )
    return AutoTokenizer.from_pretrained(path)


def built_meanwhile(build: Callable[[], object]) -> Future:
    """`build()` run in a thread of its own. A GGUF file's tokenizer is a second or more of Python (a 150k-token
    vocabulary and its merges), which the runner's weight reads, page faults and kernels, all outside the GIL, leave
    room for: building it beside them took a Qwen3-4B file's time to first token from 11.5 to 10.5 s on 2 cores."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(build())
        except BaseException as e:  # raised where the engine takes the result
            future.set_exception(e)

    threading.Thread(target=run, name="pagoda-tokenizer", daemon=True).start()
    return future


def open_model(config: EngineConfig) -> tuple[Path | GGUFCheckpoint, object, Future]:
    """(checkpoint, Hugging Face config, tokenizer) of the model `config` names; the tokenizer as a Future, which a
    GGUF file's builds while the weights load. What the checkpoint cannot serve (a GGUF file requantized or split
    across devices, another tool's quantization, an unsupported architecture) is refused here, before any weight is
    read."""
    from transformers import AutoConfig

    gguf_path = resolve_gguf(config.model)
    if gguf_path is not None:
        # A GGUF file holds config, tokenizer and weights; the runner reads its tensors as they are.
        path = gguf = GGUFCheckpoint.open(gguf_path)
        if config.quantization is not None:
            refuse_requantizing(
                config.quantization, ", ".join(sorted(set(gguf.tensor_types().values()))), gguf_path.name
            )
        if config.tensor_parallel_size > 1:
            raise ValueError("GGUF files do not work with tensor_parallel_size > 1 yet; use one device")
        hf_config = gguf.hf_config()
        gguf.tokenizer_class()  # its imports here: two threads importing one package's modules can deadlock
        tokenizer = built_meanwhile(gguf.tokenizer)
    else:
        path = resolve_model_path(config.model)
        hf_config = AutoConfig.from_pretrained(path)
        tokenizer = None
    from engine.models import language_config, model_class

    outer, hf_config = hf_config, language_config(hf_config)
    cls = model_class(hf_config)  # fail on an unsupported architecture before loading anything
    if gguf_path is None:
        check_not_prequantized(outer, path, getattr(cls, "checkpoint_quantizations", ()))
    if tokenizer is None:
        tokenizer = Future()
        tokenizer.set_result(load_tokenizer(path))
    return path, hf_config, tokenizer


def eos_token_ids(path: Path | GGUFCheckpoint, hf_config, tokenizer) -> set[int]:
    """Every token id that ends a reply: the generation config's (or the model config's) and the tokenizer's."""
    from transformers import GenerationConfig

    if isinstance(path, GGUFCheckpoint):
        return set(path.generation_eos_ids())
    ids = set()
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = getattr(hf_config, "eos_token_id", None)
    for value in (eos, tokenizer.eos_token_id):
        ids.update(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
    # Gemma 4 ends a turn at <turn|>, and after tool calls at <|tool_response>, where the tool's result goes: as
    # llama.cpp does, both end a reply whatever the generation config lists
    added = tokenizer.get_added_vocab()
    ids.update(added[text] for text in TURN_END_TOKENS if text in added)
    return ids


TURN_END_TOKENS = ("<turn|>", "<|tool_response>")
