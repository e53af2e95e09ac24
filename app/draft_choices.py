"""Which models on this machine can draft for another (speculative decoding with a draft model): those smaller
than it whose tokenizer is its own, so that a token id means the same text in both. And whether a model drafts for
itself: a checkpoint that ships a multi-token-prediction head (`mtp.*` tensors, Qwen3.5 and Qwen3-Next).

The engine compares whole vocabularies when it loads a draft and refuses one that differs (with a message that
says so). Here the Models tab only narrows its list, cheaply and without loading a tokenizer: the first
`SAMPLE_TOKENS` token strings, read from a GGUF file's header or a folder's tokenizer.json, must be equal. The
leading ids are the ones two families never share by chance (their first merges), and a GGUF file pads its
vocabulary's tail where the folder does not, which a whole-vocabulary comparison would count as different.
"""

import json
from functools import lru_cache
from pathlib import Path

SAMPLE_TOKENS = 8192


def tokenizer_sample(source: str | Path) -> tuple[str, ...] | None:
    """The first token strings of a GGUF file's or a model folder's vocabulary, by id; None where unreadable."""
    path = Path(source)
    try:
        return _sample(str(path.resolve()), path.stat().st_mtime_ns)
    except OSError:
        return None


@lru_cache(maxsize=64)
def _sample(path: str, mtime_ns: int) -> tuple[str, ...] | None:
    source = Path(path)
    if source.is_file() and source.suffix.lower() == ".gguf":
        from engine.loader.gguf_header import read_header

        try:
            tokens = read_header(source).metadata.get("tokenizer.ggml.tokens") or []
        except ValueError:
            return None
        return tuple(tokens[:SAMPLE_TOKENS]) or None
    tokenizer = source / "tokenizer.json"
    if not tokenizer.is_file():
        return None
    try:
        data = json.loads(tokenizer.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    vocab = data.get("model", {}).get("vocab") or {}
    # BPE and WordPiece: {token: id}; Unigram (SentencePiece): [[piece, score], ...] in id order
    by_id = {i: v[0] for i, v in enumerate(vocab)} if isinstance(vocab, list) else {i: t for t, i in vocab.items()}
    by_id.update({t["id"]: t["content"] for t in data.get("added_tokens", [])})
    sample = tuple(by_id.get(i, "") for i in range(min(SAMPLE_TOKENS, len(by_id))))
    return sample or None


def model_bytes(source: str | Path) -> int:
    """A model's size on disk: its file, or its folder's weight files."""
    path = Path(source)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.glob("*") if f.suffix in (".safetensors", ".gguf", ".bin"))


def draft_candidates(target: str | Path, models: dict[str, str | Path]) -> list[str]:
    """The names among `models` (name -> file or folder) that can draft for `target`: smaller, with the same
    tokenizer; smallest first."""
    wanted = tokenizer_sample(target)
    if wanted is None:
        return []
    size, target_path = model_bytes(target), Path(target).resolve()
    fitting = []
    for name, source in models.items():
        path = Path(source)
        if not path.exists() or path.resolve() == target_path:
            continue
        drafted = model_bytes(path)
        sample = tokenizer_sample(path)
        if sample is not None and drafted < size and sample[: len(wanted)] == wanted[: len(sample)]:
            fitting.append((drafted, name))
    return [name for _, name in sorted(fitting)]


MTP_PREFIX = "mtp."


def ships_mtp_head(source: str | Path) -> bool:
    """Whether a model folder's safetensors files, or a GGUF file, hold a multi-token-prediction head (read from
    their headers: `mtp.*` tensors, or blocks after the model's that the GGUF metadata counts)."""
    path = Path(source)
    try:
        return _has_mtp(str(path.resolve()), path.stat().st_mtime_ns)
    except OSError:
        return False


@lru_cache(maxsize=64)
def _has_mtp(source: str, mtime_ns: int) -> bool:
    from safetensors import SafetensorError, safe_open

    path = Path(source)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from engine.loader.gguf_header import read_header

        try:
            metadata = read_header(path).metadata
        except ValueError:
            return False
        return bool(metadata.get(f"{metadata.get('general.architecture')}.nextn_predict_layers"))
    for file in sorted(path.glob("*.safetensors")) if path.is_dir() else ():
        try:
            with safe_open(str(file), framework="numpy") as tensors:
                if any(name.startswith(MTP_PREFIX) for name in tensors.keys()):
                    return True
        except (OSError, SafetensorError):  # a file being written, or not safetensors: no head to offer from it
            continue
    return False
