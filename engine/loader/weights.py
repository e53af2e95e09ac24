"""Finding a model (local folder or hub repo id) and loading its safetensors weights."""

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.quantization.layout import QuantizedWeight

HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def resolve_model_path(model: str) -> Path:
    """A local folder as is; anything else is taken as a Hugging Face hub repo id and downloaded."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json; point `model` at a Hugging Face model folder")
        return path
    looks_like_repo_id = model.count("/") == 1 and not model.startswith((".", "/", "~")) and not path.exists()
    if not looks_like_repo_id:
        raise FileNotFoundError(
            f"model folder {model!r} does not exist; give a local HF model folder or a hub repo id "
            "like 'Qwen/Qwen3-0.6B'"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, allow_patterns=HUB_PATTERNS))
    except Exception as e:
        raise RuntimeError(
            f"could not get {model!r} from the Hugging Face hub ({type(e).__name__}: {e}). "
            "Check the repo id and your connection, or pass a local folder."
        ) from e


def check_not_prequantized(hf_config, path: Path, readable: tuple[str, ...] = ()) -> None:
    """Refuse a checkpoint quantized by another tool (GPTQ, AWQ, bitsandbytes...): its tensors are not
    plain weights, and reading them as such would give garbage. `readable`: the methods the model reads as they
    are (gpt-oss: mxfp4)."""
    method = getattr(hf_config, "quantization_config", None)
    if method is not None:
        name = method.get("quant_method", "unknown") if isinstance(method, dict) else type(method).__name__
        if str(name).lower() in readable:
            return
        raise ValueError(
            f"{path} holds weights already quantized with {name}, which Pagoda does not read; use the "
            "full-precision checkpoint (with quantization='int8' or 'int4' if it should be smaller) "
            "or a GGUF file"
        )


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {path}; convert the checkpoint to safetensors first")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{path} is missing weight shards {missing}; the download may be incomplete")
    return files


def load_weights(model: nn.Module, path: Path, headless: bool = False) -> None:
    """Copy every safetensors tensor of the checkpoint in `path` into `model` (see `load_tensors`). `headless`: an
    embedding model, whose head never runs: a head in the checkpoint is skipped, and a bare decoder's names
    (`layers.0...`, as sentence-transformers saves Qwen3-Embedding) are read as the full model's."""
    tensors = (item for file in safetensors_files(path) for item in read_tensors(file))
    load_tensors(model, without_head(tensors) if headless else tensors, str(path))


def without_head(tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """An embedding model's tensors: any head skipped, a bare decoder's names made the full model's."""
    for name, tensor in tensors:
        if not name.startswith("lm_head."):
            yield (name if name.startswith("model.") else f"model.{name}"), tensor


def load_tensors(
    model: nn.Module, tensors: Iterable[tuple[str, "torch.Tensor | QuantizedWeight"]], source: str
) -> None:
    """Copy each (checkpoint name, tensor) into `model`, packing q/k/v and gate/up and converting
    dtypes. Quantized layers (engine/quantization) take their weights whole or quantized."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules", {})
    tied = getattr(model, "tie_word_embeddings", False)
    # Modules that read their own checkpoint names (a mixture of experts' per-expert tensors, say)
    owners = {n: m for n, m in model.named_modules() if hasattr(m, "load_checkpoint_tensor")}
    loaded: set[str] = set()
    rename = getattr(model, "checkpoint_name", None)  # a family whose checkpoints name tensors otherwise
    split = getattr(model, "checkpoint_tensors", None)  # a family whose checkpoints fuse tensors otherwise
    if split is not None:
        tensors = (part for name, tensor in tensors for part in split(name, tensor))
    for name, tensor in tensors:
        if rename is not None:
            name = rename(name)
            if name is None:  # a part the engine does not run (a vision tower)
                continue
        if "rotary_emb.inv_freq" in name:
            continue
        if not (owners and _load_owned(owners, name, tensor, loaded)):
            _load_one(model, params, packed, name, tensor, loaded)
        if tied and name == "model.embed_tokens.weight" and hasattr(model.lm_head, "load_quantizable"):
            model.lm_head.load_quantizable(tensor, None)  # a quantized head builds its own kernel over the table
            loaded.add("lm_head.weight")
            embedding = _find_module(model, "model.embed_tokens")
            if hasattr(embedding, "finalize"):  # it may read its rows from that kernel: then its copy goes now
                embedding.finalize(model.lm_head)
        del tensor  # not held while the next one is read
    quantized = {f"{n}.weight" for n, m in model.named_modules() if hasattr(m, "load_quantizable")}
    expected = {n for n in params if not (n == "lm_head.weight" and tied)} | quantized
    missing = sorted(expected - loaded)
    missing += [f"{n}.{part}" for n, m in owners.items() if hasattr(m, "missing") for part in m.missing()]
    if missing:
        raise ValueError(f"the checkpoint in {source} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def checkpoint_numel(files: list[Path]) -> int:
    """Elements in every tensor of the safetensors files, from their headers alone."""
    from safetensors import safe_open

    total = 0
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
        except Exception as e:
            raise _unreadable(file, e) from e
    return total


def read_tensors(file: Path, prefix: str = ""):
    """(name, tensor) of each tensor in a safetensors file whose name starts with `prefix`; the others are not
    read."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    yield name, f.get_tensor(name)
    except Exception as e:
        raise _unreadable(file, e) from e


def _unreadable(file: Path, e: Exception) -> RuntimeError:
    # safetensors raises its own error type for bad headers and short files
    return RuntimeError(f"cannot read weights from {file} ({e}); the file is corrupt or incomplete, re-download it")


def _load_owned(owners: dict[str, nn.Module], name: str, tensor, loaded: set[str]) -> bool:
    """Hand `name` to the module among `owners` it lies under (a few levels up at most), if any."""
    parts = name.split(".")
    for depth in range(1, min(4, len(parts))):
        prefix = ".".join(parts[:-depth])
        owner = owners.get(prefix)
        if owner is None:
            continue
        try:
            done = owner.load_checkpoint_tensor(".".join(parts[-depth:]), tensor)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from e
        loaded.update(f"{prefix}.{p}" for p in done)
        return True
    return False


def _load_one(model, params, packed, name, tensor, loaded) -> None:
    target, shard = name, None
    for ckpt_name, (ours, index) in packed.items():
        if f".{ckpt_name}." in name:
            target, shard = name.replace(f".{ckpt_name}.", f".{ours}."), index
            break
    module_name, _, param_name = target.rpartition(".")
    module = _find_module(model, module_name)
    if module is not None and param_name == "weight" and hasattr(module, "load_quantizable"):
        try:
            module.load_quantizable(tensor, shard)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from e
        loaded.add(target)
        return
    param = params.get(target)
    if param is None:
        if name == "lm_head.weight" and getattr(model, "tie_word_embeddings", False):
            return  # some tied checkpoints store the head anyway
        raise ValueError(f"checkpoint tensor {name!r} does not match any parameter of {type(model).__name__}")
    if isinstance(tensor, QuantizedWeight):
        raise ValueError(
            f"checkpoint tensor {name!r} is quantized ({tensor.source}), but the model's "
            f"{module_name} takes full-precision weights only"
        )
    if shard is None and len(getattr(module, "slices", ())) > 1:
        # A fused projection stored fused (Phi-3's qkv_proj, gate_up_proj): each shard takes its rows
        pieces = tensor.split([rows for rows, _, _ in module.slices])
        for index, piece in enumerate(pieces):
            module.load_shard(param, piece.to(param.dtype), index)
    elif shard is not None:
        module.load_shard(param, tensor.to(param.dtype), shard)
    elif hasattr(module, "load_weight"):  # split across tensor-parallel ranks: the layer takes its slice
        try:
            module.load_weight(param, tensor)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from e
    elif param.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}"
        )
    else:
        param.data.copy_(tensor)
    loaded.add(target)


def _find_module(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def checkpoint_dtype(hf_config) -> torch.dtype:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype


def cpu_has_fast_bf16() -> bool:
    """Native bf16 dot products (AVX-512 BF16 or AMX) make bf16 about 1.8x faster than float32 on CPU."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def pick_dtype(requested: str, device: torch.device, quantized: bool = False) -> torch.dtype:
    """The activations' dtype (and full-precision weights'). On a CPU, quantized weights get float32
    activations: their kernels multiply in bf16 themselves, and around them float32's fused norm and
    attention paths decode faster than bf16's (bench/RESULTS.md, "CPU quantized")."""
    if requested != "auto":
        return getattr(torch, requested)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() and not quantized else torch.float32


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "device='cuda' was asked for but torch sees no CUDA GPU; use device='cpu' or install a CUDA build of torch"
        )
    return torch.device(requested)
