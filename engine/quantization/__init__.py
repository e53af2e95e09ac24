"""Weight-only quantization: the facts of the methods offered (methods.py), the layout quantized weights
travel in (layout.py), the kernels that multiply by them (kernels.py, kquant.py, triton_matmul.py with its
measured tiles in triton_tiles.py, tinygemm.py), the chooser that measures those (chooser.py), the modules that
hold them (modules.py), and the pass that swaps a built model's layers for those modules (passes.py).

The names load on first use (PEP 562), so engine/config.py reads methods.py without PyTorch."""

import importlib
from typing import TYPE_CHECKING

_HOMES = {
    "DEFAULT_GROUP_SIZE": "engine.quantization.methods",
    "METHODS": "engine.quantization.methods",
    "bytes_per_weight": "engine.quantization.methods",
    "describe": "engine.quantization.methods",
    "QuantizedWeight": "engine.quantization.layout",
    "quantize_int4": "engine.quantization.layout",
    "quantize_int8": "engine.quantization.layout",
    "KernelTarget": "engine.quantization.modules",
    "finalize": "engine.quantization.passes",
    "kernel_summary": "engine.quantization.passes",
    "quantize": "engine.quantization.passes",
    "weight_tensors": "engine.quantization.passes",
    "weight_types": "engine.quantization.passes",
}
__all__ = [
    "DEFAULT_GROUP_SIZE",
    "METHODS",
    "KernelTarget",
    "QuantizedWeight",
    "bytes_per_weight",
    "describe",
    "finalize",
    "kernel_summary",
    "quantize",
    "quantize_int4",
    "quantize_int8",
    "weight_tensors",
    "weight_types",
]

if TYPE_CHECKING:
    from engine.quantization.layout import QuantizedWeight, quantize_int4, quantize_int8
    from engine.quantization.methods import DEFAULT_GROUP_SIZE, METHODS, bytes_per_weight, describe
    from engine.quantization.modules import KernelTarget
    from engine.quantization.passes import finalize, kernel_summary, quantize, weight_tensors, weight_types


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'engine.quantization' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
