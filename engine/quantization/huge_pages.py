"""Host memory for weights in 2 MB pages (Linux's transparent huge pages), where the system gives them.

CPU decode streams every weight from memory once a token. In 4 KB pages each page costs a TLB walk and stops the
hardware prefetcher: the K-quant kernel read 884 KB Q4_K weights at 14.7 GB/s (two threads) in 4 KB pages and at
18.5 GB/s in 2 MB ones (bench/RESULTS.md). Linux's default mode (`madvise`) gives huge pages only to memory that asks
before it is first written; PyTorch asks only under THP_MEM_ALLOC_ENABLE=1, read once when torch starts, so the
weights' buffers ask for themselves. Where huge pages are off or unknown, the same buffers are plain memory.
"""

import ctypes
import sys

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = 2 * HUGE_PAGE  # smaller buffers hold at most one whole huge page: not worth the padding
_MADV_HUGEPAGE = 14  # linux/mman.h


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_MADVISE = _madvise()


def empty_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of `nbytes` whose whole 2 MB pages are huge pages where Linux allows: a view
    into a buffer one huge page longer, started at a huge-page boundary (the extra is never written, so never
    resident)."""
    if _MADVISE is None or nbytes < MIN_BYTES:
        return torch.empty(nbytes, dtype=torch.uint8)
    buffer = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    skip = -buffer.data_ptr() % HUGE_PAGE
    # A refusal (huge pages off, an old kernel) leaves ordinary pages: nothing to report
    _MADVISE(buffer.data_ptr() + skip, nbytes // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE)
    # Written here, by torch's threads, before a file is read into it: a huge page first touched inside a read()
    # took four times as long. Reading a Llama-8B file's 4.9 GB into fresh huge pages took 11.3 s, 2.8 s so.
    return buffer[skip : skip + nbytes].fill_(0)
