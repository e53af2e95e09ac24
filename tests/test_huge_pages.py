"""Weight buffers in 2 MB pages (engine/quantization/huge_pages.py): the right bytes, the whole huge pages inside
them advised, small buffers left alone."""

import sys
from pathlib import Path

import pytest
import torch

from engine.quantization import huge_pages
from engine.quantization.blocks import BlockWeight

HUGE = huge_pages.HUGE_PAGE


def test_a_large_buffer_advises_every_whole_huge_page_inside_it(monkeypatch):
    calls = []
    monkeypatch.setattr(huge_pages, "_MADVISE", lambda address, length, advice: calls.append((address, length)) or 0)
    nbytes = 5 * HUGE + 12345
    buffer = huge_pages.empty_bytes(nbytes)
    assert buffer.dtype == torch.uint8 and buffer.shape == (nbytes,) and buffer.is_contiguous()
    assert buffer.data_ptr() % HUGE == 0  # starts on a huge page, so its pages are whole
    assert calls == [(buffer.data_ptr(), 5 * HUGE)]  # never past the buffer's end
    buffer.fill_(7)  # every byte writable
    assert int(buffer.sum()) == 7 * nbytes


def test_small_buffers_are_plain(monkeypatch):
    calls = []
    monkeypatch.setattr(huge_pages, "_MADVISE", lambda *args: calls.append(args) or 0)
    assert huge_pages.empty_bytes(huge_pages.MIN_BYTES - 1).shape == (huge_pages.MIN_BYTES - 1,)
    assert calls == []


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
    reason="the kernel has no transparent huge pages",
)
def test_linux_accepts_the_advice():
    buffer = huge_pages.empty_bytes(2 * HUGE)
    assert huge_pages._MADVISE(buffer.data_ptr(), 2 * HUGE, huge_pages._MADV_HUGEPAGE) == 0


def test_fused_k_quant_blocks_keep_their_rows_in_order():
    rows = [torch.randint(0, 256, (n, 32 * 144), dtype=torch.uint8) for n in (1000, 500, 700)]  # Q4_K, K = 8192
    parts = [BlockWeight(r, "Q4_K", (r.shape[0], 8192), 4, 32, None) for r in rows]
    fused = BlockWeight.concat(parts)
    assert torch.equal(fused.blocks, torch.cat(rows)) and fused.blocks.data_ptr() % HUGE == 0
