"""One host-to-device transfer for a step's small input arrays.

A decode step's inputs are a handful of tiny arrays. Copied one by one from pageable memory,
each is a synchronous transfer that waits for the GPU to drain; on an H200 seven of them sat in
the 0.47 ms a batch-1 step spent outside its graph (bench/RESULTS.md). Here the arrays of one
dtype are packed into a pinned host buffer, allocated once and reused, and cross in one
non-blocking copy; the device tensors handed back are views of that one copy.
"""
import numpy as np
import torch


class StagingBuffer:
    """Uploads a step's arrays of one dtype to `device`. On a GPU through a pinned buffer; elsewhere
    (tests) by a plain copy, so that nothing handed out aliases the reused host buffer."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.pinned = device.type == "cuda"
        self.host = torch.empty(0, dtype=dtype)
        self.copy_done = torch.cuda.Event() if self.pinned else None
        # Each array starts on a 16-byte boundary: Triton specialises kernels on pointer alignment, and
        # a view at an odd offset would compile (and later run) a second, slower variant.
        self.align = max(1, 16 // dtype.itemsize)

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Device copies of `arrays` (any shapes), as views of one transfer."""
        starts, total = [], 0
        for a in arrays:
            starts.append(total)
            total += -(-a.size // self.align) * self.align
        if self.pinned:
            self.copy_done.synchronize()  # the previous step's copy may still be reading the host buffer
        if total > self.host.numel():
            self.host = torch.empty(max(total, 2 * self.host.numel(), 1024), dtype=self.dtype, pin_memory=self.pinned)
        flat = self.host.numpy()
        for a, start in zip(arrays, starts):
            flat[start : start + a.size] = a.reshape(-1)
        if self.pinned:
            moved = self.host[:total].to(self.device, non_blocking=True)
            self.copy_done.record(torch.cuda.current_stream(self.device))
        else:  # never hand out views of the host buffer: the next step overwrites it
            moved = self.host[:total].to(self.device, copy=True)
        return [moved[start : start + a.size].view(a.shape) for a, start in zip(arrays, starts)]
