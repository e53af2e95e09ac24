"""Host-memory checks on the CPU path: refuse up front what would otherwise end in the OOM killer.

On a GPU, KV sizing measures free device memory (kv_cache). On the CPU nothing stops a
too-large weight load or KV cache until the kernel kills the process, taking the app with it.
"""

import ctypes
import gc
import os

import torch

from engine import quantization
from engine.config import EngineConfig
from engine.layers.linear import OneDNNMatmul
from engine.loader import GGUFCheckpoint, checkpoint_numel, safetensors_files

HEADROOM = 0.9  # leave a tenth of what is available to the rest of the process and the system


def available_host_memory() -> int | None:
    """Bytes the system can still give out (Linux MemAvailable; elsewhere free pages), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def give_back_freed_memory(device: torch.device) -> None:
    """Let a closed engine's memory go now: modules and graphs can sit in reference cycles, a GPU's caching
    allocator keeps what it freed, and glibc keeps freed heap pages for reuse (90 MiB of the bundled model's
    220 MiB stayed in the process, not free to the rest of the machine)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc: nothing to hand back this way
        pass


def check_host_memory(needed: int, what: str, advice: str) -> None:
    available = available_host_memory()
    if available is not None and needed > available * HEADROOM:
        raise MemoryError(
            f"{what} would take {needed / 2**30:.1f} GiB, but only {available / 2**30:.1f} GiB "
            f"of memory is available; {advice}"
        )


def check_weights_fit(
    model_path, config: EngineConfig, hf_config, itemsize: int, packed: bool, tp_size: int = 1
) -> None:
    """Refuse up front weights that would not fit in memory (nothing else would stop the load before the OOM
    killer). `packed`: the CPU's packed matmul weights, whose head is a second copy of a tied embedding."""
    if isinstance(model_path, GGUFCheckpoint):
        # 4-bit codes sit one per byte between reading and packing, one tensor at a time
        check_host_memory(model_path.path.stat().st_size, "the model's weights", "use a smaller model or file")
        return
    files = safetensors_files(model_path)
    if getattr(hf_config, "quantization_config", None) is not None:  # read as stored (gpt-oss's MXFP4 experts)
        weights = sum(f.stat().st_size for f in files) // tp_size
        check_host_memory(weights, "the model's weights", "use a smaller model")
        return
    bytes_per_weight = quantization.bytes_per_weight(config.quantization, itemsize, config.quantization_group_size)
    weights = int(checkpoint_numel(files) * bytes_per_weight) // tp_size
    if (packed or config.quantization) and getattr(hf_config, "tie_word_embeddings", False):
        # the packed (or quantized) head is a second copy of the embedding
        weights += int(hf_config.vocab_size * hf_config.hidden_size * bytes_per_weight) // tp_size
    check_host_memory(weights, "the model's weights", "use a smaller model or a lower precision")


def held_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights `model` holds: parameters, oneDNN-packed copies and quantized tensors (a tied table
    counted once, unless packed apart)."""
    packed = [m.packed for m in model.modules() if isinstance(m, OneDNNMatmul)]
    held = [*model.parameters(), *packed, *quantization.weight_tensors(model)]
    tensors = {id(t): t for t in held}  # a tied table is counted once
    return sum(t.numel() * t.element_size() for t in tensors.values())
