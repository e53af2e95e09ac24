"""The GPU's fused mixture of experts (engine/layers/fused_moe_triton.py): the same sums as the expert-by-expert
loop FusedMoE runs on the CPU, for decode and prefill sizes, every token on one expert, experts no token chose,
and both activations (SwiGLU, Gemma 4's GELU). On a GPU (bench/device_check.sh runs this file there) the kernel
runs compiled; without one, under Triton's interpreter (tests/conftest.py sets it)."""

import pytest

pytest.importorskip("triton")
import torch  # noqa: E402

from engine.layers.activation import silu_and_mul  # noqa: E402
from engine.layers.fused_moe import run_experts  # noqa: E402
from engine.layers.fused_moe_triton import align_by_expert, fused_moe  # noqa: E402
from engine.models.gemma4 import gelu_and_mul  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x, gate_up, down, weights, ids, act):
    def expert_mlp(expert: int, h: torch.Tensor) -> torch.Tensor:
        return act(h @ gate_up[expert].T) @ down[expert].T

    return run_experts(x, weights, ids, gate_up.shape[0], expert_mlp)


@pytest.mark.parametrize("tokens", [1, 5, 37])
@pytest.mark.parametrize("act", [silu_and_mul, gelu_and_mul], ids=["swiglu", "gelu"])
def test_the_grouped_matmuls_give_the_expert_loops_sums(tokens, act):
    g = torch.Generator().manual_seed(tokens)
    experts, top_k, hidden, inter = 8, 2, 64, 48  # an intermediate size that is no multiple of the tiles
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(DEVICE)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(DEVICE)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=g).to(DEVICE)
    expected = reference(x, gate_up, down, weights, ids, act)
    torch.testing.assert_close(fused_moe(x, gate_up, down, weights, ids, act), expected, rtol=1e-4, atol=1e-5)
    crowded = torch.zeros_like(ids)
    crowded[:, 1] = 3  # every token on experts 0 and 3: the others are never read
    expected = reference(x, gate_up, down, weights, crowded, act)
    torch.testing.assert_close(fused_moe(x, gate_up, down, weights, crowded, act), expected, rtol=1e-4, atol=1e-5)


def test_pairs_are_sorted_by_expert_in_padded_blocks():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])  # pairs 0..5: experts 2, 0, 2, 1, 0, 2
    sorted_pairs, block_experts, num_padded = align_by_expert(ids, num_experts=4, block_m=4)
    pad = 6
    assert sorted_pairs.tolist()[:12] == [1, 4, pad, pad, 3, pad, pad, pad, 0, 2, 5, pad]
    assert block_experts.tolist()[:3] == [0, 1, 2] and num_padded.tolist() == [12]
    assert len(sorted_pairs) == 20 and set(sorted_pairs.tolist()[12:]) == {pad}  # 6 + 4 x 3, in whole blocks
