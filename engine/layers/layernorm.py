"""RMSNorm, optionally fused with the residual add that precedes it."""

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension. `weight` may have more dimensions (a row per head, say):
    it broadcasts against x."""
    if x.dtype == weight.dtype and (x.device.type == "cpu") == (x.dtype == torch.float32):
        # One fused call instead of eight ops: on the CPU in float32 (bit-identical to the steps
        # below there), and off the CPU in half precision. CUDA's fused kernel sums in another
        # order, so float32 on a GPU keeps transformers' exact steps for the token-for-token tests.
        if weight.dim() == 1:
            return F.rms_norm(x, weight.shape, weight, eps)
        return F.rms_norm(x, x.shape[-1:], None, eps) * weight  # a weight per head, applied after
    # Same op order as transformers, so half-precision results match it to the last bits we can.
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    x = x + residual
    return rms_norm(x, weight, eps), x


class RMSNorm(nn.Module):
    # Plain functions, so one torch.compile of each serves every layer (see ModelRunner).
    norm_fn = staticmethod(rms_norm)
    add_norm_fn = staticmethod(add_rms_norm)

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is None:
            return self.norm_fn(x, self.weight, self.eps)
        return self.add_norm_fn(x, residual, self.weight, self.eps)
