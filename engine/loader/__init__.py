"""Loading: finding a model (a local folder or a hub repo id) and reading its weights (`weights`), and
preparing the bundled offline model from its GGUF file (`bundled`)."""
from engine.loader.weights import (
    HUB_PATTERNS,
    checkpoint_dtype,
    checkpoint_numel,
    cpu_has_fast_bf16,
    load_tensors,
    load_weights,
    pick_device,
    pick_dtype,
    resolve_model_path,
    safetensors_files,
)

__all__ = ["HUB_PATTERNS", "checkpoint_dtype", "checkpoint_numel", "cpu_has_fast_bf16", "load_tensors", "load_weights",
           "pick_device", "pick_dtype", "resolve_model_path", "safetensors_files"]
