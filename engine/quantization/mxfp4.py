"""MXFP4 (OCP microscaling, 4-bit floats) as gpt-oss checkpoints ship their experts.

A weight's rows are cut into groups of 32 values along the input dimension. Each group is 16 bytes of E2M1 codes,
two to a byte (the low nibble first), and one shared scale byte, an E8M0 power of two biased by 127:

    value = FP4_VALUES[code] * 2 ** (scale - 127)

transformers names such a weight `<name>_blocks` ([..., rows, groups, 16] uint8) and `<name>_scales` ([..., rows,
groups] uint8). The engine keeps them so (4.25 bits a weight) and widens only what one step multiplies.
"""

import torch

GROUP = 32  # values sharing one scale
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., rows, groups * 32] in `dtype` from [..., rows, groups, 16] codes and [..., rows, groups] scales.
    Exact in float32 and bfloat16 alike: every value is a code's value times a power of two."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 takes uint8 blocks [..., groups, 16] and scales [..., groups], got {tuple(blocks.shape)} "
            f"{blocks.dtype} and {tuple(scales.shape)} {scales.dtype}"
        )
    table = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # low nibble first
    values = table[codes]  # [..., groups, 32]
    exponents = (scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1)
    return torch.ldexp(values, exponents.to(values.dtype)).flatten(-2).to(dtype)


def checkpoint_reads_mxfp4(hf_config) -> bool:
    """Whether a config's checkpoint holds MXFP4 weights (transformers' quantization_config for them)."""
    method = getattr(hf_config, "quantization_config", None)
    if method is None:
        return False
    name = method.get("quant_method") if isinstance(method, dict) else getattr(method, "quant_method", None)
    dequantized = method.get("dequantize") if isinstance(method, dict) else getattr(method, "dequantize", False)
    return str(name).lower().removeprefix("quantizationmethod.") == "mxfp4" and not dequantized
