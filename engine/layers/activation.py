import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """silu(gate) * up, for a gate_up projection laid out as [gate | up]."""

    fn = staticmethod(silu_and_mul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)
