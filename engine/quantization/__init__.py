"""Weight-only quantization: int8/int4 layouts and the pass that swaps a built model's linear
layers for quantized ones."""
from engine.quantization.layout import QuantizedWeight, quantize_int4, quantize_int8

__all__ = ["QuantizedWeight", "quantize_int4", "quantize_int8"]
