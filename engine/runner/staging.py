"""Host-to-device transfers of a step's small input arrays: one per dtype, never waiting.

A decode step's inputs are a handful of tiny arrays. Copied one by one from pageable memory,
each is a synchronous transfer that waits for the GPU to drain; on an H200 seven of them sat in
the 0.47 ms a batch-1 step spent outside its graph (bench/RESULTS.md). Here the arrays of one
dtype are packed into a pinned host buffer, allocated once and reused, and cross in one
non-blocking copy; the device tensors handed back are views of that copy.

Uploads take turns over a few host buffers. Reusing one means waiting until the device has
copied it, and with asynchronous scheduling the copy just enqueued sits behind the step the GPU
is still running: waiting on it would stall the host for that whole step. A buffer last used two
steps ago was copied long since.
"""

import numpy as np
import torch


class StagingBuffer:
    """Uploads a step's arrays of one dtype to `device`. On a GPU through a pinned buffer; elsewhere
    (tests) by a plain copy, so that nothing handed out aliases the reused host buffer."""

    # Four: a step makes up to two uploads of one dtype (its inputs, its sampling columns), so a
    # buffer comes back two steps after its last use.
    def __init__(self, device: torch.device, dtype: torch.dtype, num_buffers: int = 4):
        self.device, self.dtype = device, dtype
        self.pinned = device.type == "cuda"
        self.hosts = [torch.empty(0, dtype=dtype) for _ in range(num_buffers)]
        self.copies_done = [torch.cuda.Event() for _ in range(num_buffers)] if self.pinned else None
        self.turn = 0
        # Each array starts on a 16-byte boundary: Triton specialises kernels on pointer alignment, and
        # a view at an odd offset would compile (and later run) a second, slower variant.
        self.align = max(1, 16 // dtype.itemsize)

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Device copies of `arrays` (any shapes), as views of one transfer."""
        starts, total = [], 0
        for a in arrays:
            starts.append(total)
            total += -(-a.size // self.align) * self.align
        turn = self.turn
        self.turn = (turn + 1) % len(self.hosts)
        if self.pinned:
            self.copies_done[turn].synchronize()  # its last copy may still be reading this buffer
        host = self.hosts[turn]
        if total > host.numel():
            host = self.hosts[turn] = torch.empty(
                max(total, 2 * host.numel(), 1024), dtype=self.dtype, pin_memory=self.pinned
            )
        flat = host.numpy()
        for a, start in zip(arrays, starts):
            flat[start : start + a.size] = a.reshape(-1)
        if self.pinned:
            moved = host[:total].to(self.device, non_blocking=True)
            self.copies_done[turn].record(torch.cuda.current_stream(self.device))
        else:  # never hand out views of the host buffer: a later step overwrites it
            moved = host[:total].to(self.device, copy=True)
        return [moved[start : start + a.size].view(a.shape) for a, start in zip(arrays, starts)]
