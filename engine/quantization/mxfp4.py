"""MXFP4 (OCP microscaling, 4-bit floats) as gpt-oss checkpoints ship their experts.

A weight's rows are cut into groups of 32 values along the input dimension. Each group is 16 bytes of E2M1 codes,
two to a byte (the low nibble first), and one shared scale byte, an E8M0 power of two biased by 127:

    value = FP4_VALUES[code] * 2 ** (scale - 127)

transformers names such a weight `<name>_blocks` ([..., rows, groups, 16] uint8) and `<name>_scales` ([..., rows,
groups] uint8). GGUF's MXFP4 type holds the same codes and scales (17 bytes a group: the scale, then value j in the
low nibble of byte j and value j + 16 in its high nibble); the engine keeps a checkpoint's experts in that layout,
which the CPU kernel reads (quantization/kquant.cpp), at the same 4.25 bits a weight.
"""

import torch

from engine.quantization.blocks import BlockWeight

GROUP = 32  # values sharing one scale
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# The values doubled, all integers (llama.cpp's kvalues_mxfp4): a GGUF block is int8 codes times 2^(scale - 128)
GGML_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
GGML_BLOCK_BYTES = 1 + GROUP // 2


def checkpoint_reads_mxfp4(hf_config) -> bool:
    """Whether a config's checkpoint holds MXFP4 weights (transformers' quantization_config for them)."""
    method = getattr(hf_config, "quantization_config", None)
    if method is None:
        return False
    name = method.get("quant_method") if isinstance(method, dict) else getattr(method, "quant_method", None)
    dequantized = method.get("dequantize") if isinstance(method, dict) else getattr(method, "dequantize", False)
    return str(name).lower().removeprefix("quantizationmethod.") == "mxfp4" and not dequantized


def ggml_blocks(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[..., rows, groups * 17] in GGUF's MXFP4 layout (into `out` if given) from transformers' [..., rows, groups,
    16] codes and [..., rows, groups] scales: the same codes and scales, lossless (convert_hf_to_gguf's repacking).

    transformers' byte i holds values 2i and 2i + 1, GGUF's byte j values j and j + 16: GGUF's byte 2m takes the low
    nibbles of transformers' bytes m and 8 + m, its byte 2m + 1 their high nibbles. Computed on half-bytes of the
    input, not on a byte a value, so that a large expert's temporaries stay small."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 takes uint8 blocks [..., groups, 16] and scales [..., groups], got {tuple(blocks.shape)} "
            f"{blocks.dtype} and {tuple(scales.shape)} {scales.dtype}"
        )
    if out is None:
        out = torch.empty(*scales.shape[:-1], scales.shape[-1] * GGML_BLOCK_BYTES, dtype=torch.uint8)
    grouped = out.view(*scales.shape, GGML_BLOCK_BYTES)
    first, second = blocks[..., :8], blocks[..., 8:]  # values 0..15 and 16..31
    grouped[..., 0] = scales
    grouped[..., 1::2] = (first & 0x0F) | (second << 4)
    grouped[..., 2::2] = (first >> 4) | (second & 0xF0)
    return out


def decode_ggml_mxfp4(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """GGUF's MXFP4 blocks [n, 17] as (int8 codes [n, 32], float32 scales [n, 1], no offset), the layout
    QuantizedWeight describes."""
    nibbles = torch.cat((blocks[:, 1:] & 0x0F, blocks[:, 1:] >> 4), dim=1).long()  # values 0..15, then 16..31
    codes = torch.tensor(GGML_VALUES, dtype=torch.int8)[nibbles]
    return codes, torch.ldexp(torch.ones(len(blocks), 1), blocks[:, :1].float() - 128), None


def ggml_weight(stored: torch.Tensor, cols: int) -> BlockWeight:
    """Rows of GGUF's MXFP4 blocks [rows, cols / 32 * 17] as a weight of `cols` columns, kept as they are."""

    def decode(rows: torch.Tensor, k: int):
        codes, scale, _ = decode_ggml_mxfp4(rows.reshape(-1, GGML_BLOCK_BYTES))
        return codes.view(len(rows), k), scale.view(len(rows), k // GROUP), None

    return BlockWeight(stored, "MXFP4", (stored.shape[0], cols), 8, GROUP, decode)
