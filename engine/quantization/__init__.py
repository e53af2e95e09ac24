"""Weight-only quantization: the layout quantized weights travel in (layout.py), the kernels that
multiply by them (kernels.py), the modules that hold them (modules.py), and the pass that swaps a
built model's layers for those modules (passes.py)."""
from engine.quantization.layout import QuantizedWeight, quantize_int4, quantize_int8
from engine.quantization.modules import KernelTarget
from engine.quantization.passes import (
    DEFAULT_GROUP_SIZE,
    finalize,
    kernel_summary,
    quantize,
    weight_tensors,
    weight_types,
)

__all__ = ["DEFAULT_GROUP_SIZE", "KernelTarget", "QuantizedWeight", "finalize", "kernel_summary",
           "quantize", "quantize_int4", "quantize_int8", "weight_tensors", "weight_types"]
