"""Loading: finding a model (a local folder or a hub repo id) and reading its weights (`weights`), reading
GGUF files as they are, quantized blocks and all (`gguf`, `gguf_blocks`; `gguf_files` finds the file),
and preparing the bundled offline model from its GGUF file (`bundled`)."""

from engine.loader.gguf import GGUFCheckpoint
from engine.loader.gguf_blocks import SUPPORTED_TYPES as GGUF_SUPPORTED_TYPES
from engine.loader.gguf_files import resolve_gguf
from engine.loader.weights import (
    HUB_PATTERNS,
    check_not_prequantized,
    checkpoint_dtype,
    checkpoint_numel,
    cpu_has_fast_bf16,
    load_tensors,
    load_weights,
    pick_device,
    pick_dtype,
    resolve_model_path,
    safetensors_files,
    without_head,
)

__all__ = [
    "GGUF_SUPPORTED_TYPES",
    "GGUFCheckpoint",
    "HUB_PATTERNS",
    "check_not_prequantized",
    "checkpoint_dtype",
    "checkpoint_numel",
    "cpu_has_fast_bf16",
    "load_tensors",
    "without_head",
    "load_weights",
    "pick_device",
    "pick_dtype",
    "resolve_gguf",
    "resolve_model_path",
    "safetensors_files",
]
