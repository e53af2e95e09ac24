"""The CPU's KV cache takes memory as it fills, not at load (engine/runner/kv_cache.py: `zeroed`): torch.zeros wrote
every page of an 8B model's 1 GiB cache at load, 3.1 s of it on a 2-core VM, and held it all from the start."""

import sys

import pytest
import torch

from engine.runner.kv_cache import zeroed

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
CACHE_SHAPE = (1024, 16, 8, 128)  # 256 MiB in bfloat16


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_a_cpu_cache_is_zeros_and_takes_memory_only_where_written():
    before = resident_bytes()
    cache = zeroed(CACHE_SHAPE, torch.bfloat16, torch.device("cpu"))
    assert cache.shape == CACHE_SHAPE and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert not cache[::37].any()  # reads see zeros, and map no memory of their own
    assert resident_bytes() - before < 32 << 20
    slots = cache.view(-1, *CACHE_SHAPE[2:])
    slots.index_copy_(0, torch.arange(64), torch.ones(64, *CACHE_SHAPE[2:], dtype=torch.bfloat16))  # 4 blocks
    assert resident_bytes() - before < 32 << 20
    assert cache[:4].eq(1).all() and not cache[4:].any()
    view = cache[2:]
    del cache  # a view keeps the mapping alive
    assert view[:2].eq(1).all()
