"""Finding the GGUF file a model string names: a `.gguf` path, a folder holding one, `owner/repo/file.gguf` on
the Hugging Face hub, or `owner/repo:Q4_K_M` (a quant tag, as llama.cpp and Ollama write it)."""

from __future__ import annotations

import re
from pathlib import Path

_SPLIT_FILE = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


def resolve_gguf(model: str) -> Path | None:
    """The local GGUF file a model string names, downloading it from the hub if needed; None when the
    model is not a GGUF (a Hugging Face folder or repo id, for the safetensors path).

    - `path/to/model.gguf`
    - a folder with exactly one `.gguf` and no config.json
    - `owner/repo/file.gguf` (the file may sit in a folder of the repo: `owner/repo/Q4/file.gguf`)
    - `owner/repo:Q4_K_M`: the repo's one GGUF with that quant tag in its name, as llama.cpp (`-hf`) and
      Ollama (`hf.co/owner/repo:Q4_K_M`) spell it
    - `owner/repo-GGUF` with no tag: the repo's GGUF if it holds just one
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return _gguf_in_folder(path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            return None
        _refuse_split(path.name)
        return path
    local = model.startswith((".", "/", "~")) or "\\" in model or re.match(r"[A-Za-z]:[\\/]", model) is not None
    if local:
        if model.lower().endswith(".gguf"):
            raise FileNotFoundError(f"GGUF file {model!r} does not exist; check the path")
        return None
    parts = model.split("/")
    if len(parts) >= 3 and model.lower().endswith(".gguf"):
        repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
        _refuse_split(filename)
        return _download(repo, filename)
    if len(parts) == 2 and ":" in parts[1]:
        repo, _, tag = model.rpartition(":")
        return _download(repo, _pick_by_tag(repo, tag))
    if len(parts) == 2 and parts[1].lower().endswith("-gguf"):
        return _download(model, _pick_by_tag(model, None))
    if model.lower().endswith(".gguf"):
        raise FileNotFoundError(
            f"GGUF file {model!r} does not exist; give a local .gguf path or a hub file as 'owner/repo/file.gguf'"
        )
    return None


def _gguf_in_folder(folder: Path) -> Path | None:
    if (folder / "config.json").is_file():
        return None
    found = sorted(folder.glob("*.gguf"))
    if len(found) > 1:
        raise ValueError(
            f"{folder} holds {len(found)} GGUF files ({', '.join(f.name for f in found)}); pass the one "
            "to load as the model path"
        )
    if found:
        _refuse_split(found[0].name)
        return found[0]
    return None


def _refuse_split(name: str) -> None:
    if _SPLIT_FILE.search(name):
        raise ValueError(
            f"{name} is one part of a split GGUF; Pagoda reads single files. Merge the parts with "
            "llama.cpp's `llama-gguf-split --merge`, or pick a smaller quantization that is one file."
        )


def _pick_by_tag(repo: str, tag: str | None) -> str:
    import huggingface_hub

    try:
        files = [f for f in huggingface_hub.HfApi().list_repo_files(repo) if f.lower().endswith(".gguf")]
    except Exception as e:
        raise RuntimeError(
            f"could not list the files of {repo!r} on the Hugging Face hub ({type(e).__name__}: {e}). "
            "Check the repo id and your connection."
        ) from e
    files = [f for f in files if "mmproj" not in f.lower()]  # vision projectors, not language models
    if tag is not None:
        pattern = re.compile(rf"(?:^|[-._/]){re.escape(tag)}(?:[-./]|$)", re.IGNORECASE)
        matches = [f for f in files if pattern.search(f[: -len(".gguf")])]
    else:
        matches = files
    if len(matches) == 1:
        _refuse_split(matches[0])
        return matches[0]
    tags = sorted({_quant_tag(f) for f in files} - {None})
    if not matches:
        wanted = f"with quant tag {tag!r}" if tag else "at all"
        raise FileNotFoundError(
            f"{repo!r} has no GGUF file {wanted}; available: {', '.join(tags) or 'none'}. Pass "
            f"'{repo}:<tag>' or '{repo}/<file>.gguf'."
        )
    raise ValueError(
        f"{repo!r} has {len(matches)} GGUF files{f' matching {tag!r}' if tag else ''} "
        f"({', '.join(matches[:8])}{', ...' if len(matches) > 8 else ''}); pass one as "
        f"'{repo}/<file>.gguf'"
        + (f" or pick a quant tag: '{repo}:{tags[0]}' ({', '.join(tags)})" if tags and not tag else "")
    )


def _quant_tag(filename: str) -> str | None:
    match = re.search(r"(?:^|[-._])((?:I?Q\d\w*?)|F16|BF16|F32)$", Path(filename).stem, re.IGNORECASE)
    return match[1].upper() if match else None


def _download(repo: str, filename: str) -> Path:
    import huggingface_hub

    try:
        return Path(huggingface_hub.hf_hub_download(repo_id=repo, filename=filename))
    except Exception as e:
        raise RuntimeError(
            f"could not get {filename!r} from {repo!r} on the Hugging Face hub "
            f"({type(e).__name__}: {e}). Check the repo id, the file name and your connection, or pass "
            "a local .gguf file."
        ) from e
