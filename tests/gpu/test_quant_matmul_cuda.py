"""The quantized-weight kernels on a CUDA GPU at Qwen3-8B's layer shapes, against the float32
reference; skipped elsewhere (the CPU tests run them in Triton's interpreter at tiny shapes)."""

import pytest
import torch

if not torch.cuda.is_available():
    # Skip before importing the kernels: Triton decides at decoration time whether a kernel is
    # interpreted, and the CPU tests that import them later set TRITON_INTERPRET first.
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine.quantization.layout import quantize_int4, quantize_int8  # noqa: E402
from engine.quantization.tinygemm import tinygemm_applies, tinygemm_matmul, tinygemm_pack  # noqa: E402
from engine.quantization.triton_matmul import pack_for_triton, quant_gemv, quant_matmul  # noqa: E402
from engine.quantization.triton_tiles import choose_quant_tiles, reference, run_tile, tile_candidates  # noqa: E402

# Qwen3-8B: fused q/k/v (32 + 2 * 8 heads of 128), fused gate/up, and down.
SHAPES = [(6144, 4096), (24576, 4096), (4096, 12288)]


def close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return bool((got.float() - expected).norm() <= 1e-2 * expected.norm())


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_match_reference_at_real_sizes(n, k, bits, dtype):
    gen = torch.Generator("cuda").manual_seed(0)
    weight = torch.randn(n, k, generator=gen, device="cuda") * 0.02
    qw = quantize_int4(weight, 32) if bits == 4 else quantize_int8(weight)
    w = pack_for_triton(qw, dtype)
    bias = torch.randn(n, generator=gen, device="cuda").to(dtype)
    for rows in (1, 3, 8):
        x = torch.randn(rows, k, generator=gen, device="cuda").to(dtype)
        expected = reference(x, qw, bias)
        for tile in tile_candidates(rows if rows != 3 else 4, w):
            assert close(run_tile(x, w, bias, tile), expected), tile
    for rows in (40, 512):
        x = torch.randn(rows, k, generator=gen, device="cuda").to(dtype)
        assert close(quant_matmul(x, w, bias), reference(x, qw, bias))
    x = torch.randn(1, k, generator=gen, device="cuda").to(dtype)
    assert close(quant_gemv(x, w, None, 4, 1024), reference(x, qw, None))


def test_choice_and_tinygemm_agree():
    weight = torch.randn(6144, 4096, device="cuda") * 0.02
    qw = quantize_int4(weight, 128)
    assert tinygemm_applies(qw, torch.bfloat16)
    x = torch.randn(2, 4096, device="cuda").bfloat16()
    assert close(tinygemm_matmul(x, tinygemm_pack(qw), None), reference(x, qw, None))
    w = pack_for_triton(qw, torch.bfloat16)
    choice = choose_quant_tiles(qw, w, None, torch.bfloat16, buckets=(1, 8, 64))
    assert set(choice.tiles) == {1, 8, 64}
    for rows, tile in choice.tiles.items():
        x = torch.randn(rows, 4096, device="cuda").bfloat16()
        assert close(run_tile(x, w, None, tile), reference(x, qw, None)), tile
