"""One host-to-device transfer for a step's small input arrays.

A decode step's inputs are a handful of tiny arrays. Copied one by one from pageable memory,
each is a synchronous transfer that waits for the GPU to drain, and on an H200 those seven
copies and their waits were a quarter of a batch-1 step (bench/RESULTS.md). Here the arrays of
one dtype are packed into a pinned host buffer, allocated once and reused, and cross in one
non-blocking copy; the device tensors handed back are views of that one copy.
"""
import numpy as np
import torch


class StagingBuffer:
    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.pinned = device.type == "cuda"
        self.host = torch.empty(0, dtype=dtype)
        self.copy_done: torch.cuda.Event | None = None

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Device copies of `arrays` (any shapes), as views of one transfer."""
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        if self.copy_done is not None:
            self.copy_done.synchronize()  # the previous step's copy may still be reading the host buffer
        if total > self.host.numel():
            self.host = torch.empty(max(total, 2 * self.host.numel(), 1024), dtype=self.dtype, pin_memory=self.pinned)
        flat = self.host.numpy()
        offsets = np.cumsum([0, *sizes])
        for a, start, end in zip(arrays, offsets[:-1], offsets[1:]):
            flat[start:end] = a.reshape(-1)
        if self.pinned:
            moved = self.host[:total].to(self.device, non_blocking=True)
            self.copy_done = torch.cuda.Event()
            self.copy_done.record()
        else:  # never hand out views of the host buffer: the next step overwrites it
            moved = self.host[:total].to(self.device, copy=True)
        return [moved[start:end].view(a.shape) for a, start, end in zip(arrays, offsets[:-1], offsets[1:])]
