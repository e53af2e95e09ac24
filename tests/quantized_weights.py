"""Helpers shared by the quantization tests: random quantized weights, the float32 kernel alone, and comparing
logprob rows."""

import torch

from engine.quantization.kernels import DequantMatmul
from engine.quantization.layout import QuantizedWeight


def random_quantized_weight(
    bits: int, n: int, k: int, group: int | str, with_offset: bool, seed: int = 0
) -> QuantizedWeight:
    """Codes over the whole range, scales across two decades, offsets of either sign (like GGUF's).
    `group` is a group size, or "channel" for one scale per row."""
    gen = torch.Generator().manual_seed(seed)
    group_size = k if group == "channel" else group
    groups = -(-k // group_size)
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    else:
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = 10 ** (torch.rand(n, groups, generator=gen) * 2 - 3)
    offset = torch.randn(n, groups, generator=gen) * 8 * scale if with_offset else None
    return QuantizedWeight(bits, q, scale, offset, group_size, "test")


def logprob_differences(got: list[dict], want: list[dict], min_common: int) -> list[float]:
    """|got - want| on the tokens both rows list (a top-k may swap members that tie), row by row;
    each pair of rows must share at least `min_common` tokens."""
    assert len(got) == len(want)
    diffs = []
    for i, (g, w) in enumerate(zip(got, want)):
        common = g.keys() & w.keys()
        assert len(common) >= min_common, f"position {i}: top tokens {sorted(g)} vs {sorted(w)}"
        diffs += [abs(g[t] - w[t]) for t in common]
    return diffs


def only_dequant(qw, device, dtype):
    """A `chooser.candidates` offering the float32 DequantMatmul alone: the engine then computes with exactly the
    dequantized weights."""
    return {"DequantMatmul": lambda w: DequantMatmul(w, dtype)}
