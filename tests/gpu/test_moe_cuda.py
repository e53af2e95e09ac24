"""The fused Triton experts on a GPU at a real model's shapes, run by bench/device_check.sh; skipped elsewhere.
(tests/test_fused_moe_triton.py checks the kernel's sums in float32 on any machine; tests/gpu/test_cuda.py runs the
tiny MoE models through the engine against transformers.)"""

import pytest
import torch

from engine.layers.activation import silu_and_mul
from engine.layers.fused_moe import run_experts
from engine.layers.fused_moe_triton import fused_moe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("tokens", [1, 8, 512])
def test_fused_experts_at_qwen3_30b_a3b_shapes_match_the_expert_loop(tokens):
    """128 experts of 2,048 x 768, 8 a token, in bf16: within bf16's rounding of the loop's float32 sums."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    experts, top_k, hidden, inter = 128, 8, 2048, 768
    x = torch.randn(tokens, hidden, device="cuda", generator=g, dtype=torch.bfloat16)
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    down = torch.randn(experts, hidden, inter, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    scores = torch.rand(tokens, experts, device="cuda", generator=g)
    weights, ids = scores.topk(top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
    got = fused_moe(x, gate_up, down, weights, ids, silu_and_mul).float()

    def expert_mlp(expert: int, h: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(h @ gate_up[expert].float().T) @ down[expert].float().T

    expected = run_experts(x.float(), weights.float(), ids, experts, expert_mlp)
    error = (got - expected).abs().max().item()
    assert error <= 0.02 * expected.abs().max().item(), error
