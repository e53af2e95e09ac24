"""A step's host inputs and the KV cache's size, built from hand-made batches without a model.

Every expected array is written out by hand from the block tables and token counts, so a change
to how positions, slots or rows are derived shows up as a wrong number.
"""

import pytest
import torch

from engine import SamplingParams
from engine.config import EngineConfig
from engine.core.scheduler import ScheduledSeq
from engine.core.sequence import Sequence
from engine.runner.distributed import SINGLE, TPGroup
from engine.runner.kv_cache import CPU_KV_CACHE_BYTES, KVCacheLayout, blocks_for_budget, choose_num_blocks
from engine.runner.step_inputs import SampledRows, StepInputs, prepare_step

BS = 4  # block size: small, so a few tokens span several blocks
GREEDY = SamplingParams(temperature=0)


def make_seq(
    token_ids: list[int],
    block_table: list[int],
    num_computed: int,
    num_pending: int = 0,
    params: SamplingParams = GREEDY,
) -> Sequence:
    seq = Sequence(token_ids, params)
    seq.block_table = list(block_table)
    seq.num_computed_tokens = num_computed
    seq.num_pending_tokens = num_pending
    return seq


def assert_arrays(step: StepInputs, **expected) -> None:
    for name, want in expected.items():
        got = getattr(step, name)
        assert got.tolist() == want, f"{name}: got {got.tolist()}, want {want}"


def test_prefill_chunks_with_a_cached_prefix():
    # a: 10 prompt tokens, the first block (4 tokens) served by the prefix cache, the rest this step.
    a = make_seq(list(range(10, 20)), [7, 2, 9], num_computed=4)
    # b: the first chunk of a 7-token prompt, which does not reach the end: nothing sampled.
    b = make_seq(list(range(30, 37)), [5], num_computed=0)
    # c: the last chunk of a 5-token prompt, crossing from block 1 into block 3.
    c = make_seq(list(range(40, 45)), [1, 3], num_computed=3)
    batch = [ScheduledSeq(a, 6), ScheduledSeq(b, 3), ScheduledSeq(c, 2)]
    assert [s.samples for s in batch] == [True, False, True]

    step = prepare_step(batch, BS, {})

    assert_arrays(
        step,
        token_ids=[14, 15, 16, 17, 18, 19, 30, 31, 32, 43, 44],
        positions=[4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4],
        # slot = block_table[position // 4] * 4 + position % 4
        slot_mapping=[8, 9, 10, 11, 36, 37, 20, 21, 22, 7, 12],
        query_start_loc=[0, 6, 9, 11],
        query_lens=[6, 3, 2],
        seq_lens=[10, 3, 5],
        block_tables=[[7, 2, 9], [5, -1, -1], [1, 3, -1]],
        logits_index=[5, 10],  # the last token of each chunk that samples
        pending_rows=[],
        pending_sources=[],
    )


def test_decode_batch():
    # a: 8 prompt tokens and 2 outputs, the newest (position 9) not yet in the cache.
    a = make_seq([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [4, 6, 8], num_computed=9)
    b = make_seq([7, 7, 7, 7, 8], [2, 0], num_computed=4)  # position 4 opens its second block
    c = make_seq([11, 12], [13], num_computed=1)
    batch = [ScheduledSeq(a, 1), ScheduledSeq(b, 1), ScheduledSeq(c, 1)]

    step = prepare_step(batch, BS, {})

    assert_arrays(
        step,
        token_ids=[3, 8, 12],
        positions=[9, 4, 1],
        slot_mapping=[33, 0, 53],
        query_start_loc=[0, 1, 2, 3],
        query_lens=[1, 1, 1],
        seq_lens=[10, 5, 2],
        block_tables=[[4, 6, 8], [2, 0, -1], [13, -1, -1]],
        logits_index=[0, 1, 2],
        pending_rows=[],
        pending_sources=[],
    )


def test_pending_tokens_are_placeholders_filled_from_the_last_sampled_rows():
    # p: 5 tokens read back, a sixth sampled by the last step (its row 2) and still on the device.
    p = make_seq([21, 22, 23, 24, 25], [6, 1], num_computed=5, num_pending=1)
    d = make_seq([31, 32, 33], [9], num_computed=2)  # a decode whose input the host has
    step = prepare_step([ScheduledSeq(d, 1), ScheduledSeq(p, 1)], BS, {d.seq_id: 0, p.seq_id: 2})
    assert_arrays(
        step,
        token_ids=[33, 0],
        positions=[2, 5],
        slot_mapping=[38, 5],
        seq_lens=[3, 6],
        logits_index=[0, 1],
        pending_rows=[1],
        pending_sources=[2],
    )

    # Beside a prefill, the pending token's row in token_ids is where its sequence starts.
    f = make_seq([50, 51, 52], [3], num_computed=0)
    step = prepare_step([ScheduledSeq(f, 3), ScheduledSeq(p, 1)], BS, {p.seq_id: 2})
    assert_arrays(
        step,
        token_ids=[50, 51, 52, 0],
        positions=[0, 1, 2, 5],
        slot_mapping=[12, 13, 14, 5],
        query_start_loc=[0, 3, 4],
        logits_index=[2, 3],
        pending_rows=[3],
        pending_sources=[2],
    )

    # Steady asynchronous decoding: every input is on the device.
    q = make_seq([41, 42], [8], num_computed=2, num_pending=1)
    step = prepare_step([ScheduledSeq(p, 1), ScheduledSeq(q, 1)], BS, SampledRows([q, d, p]))
    assert_arrays(
        step, token_ids=[0, 0], positions=[5, 2], slot_mapping=[5, 34], pending_rows=[0, 1], pending_sources=[2, 0]
    )


def test_a_pending_token_the_last_step_did_not_sample_is_an_error():
    p = make_seq([1, 2, 3], [0], num_computed=3, num_pending=1)
    p.request_id = "chat-7"
    with pytest.raises(RuntimeError, match=r"\['chat-7'\] have a pending token that the last step did not sample"):
        prepare_step([ScheduledSeq(p, 1)], BS, SampledRows([make_seq([1], [1], 1)]))


VOCAB = 100


# ---- KV cache sizing ----------------------------------------------------------------------------
LAYOUT = KVCacheLayout(slot_widths=(16, 16), block_size=16, dtype=torch.float32)  # 2 layers of 2 heads x 8
BLOCK_BYTES = 2 * 2 * 16 * 2 * 8 * 4  # keys and values, layers, tokens, heads, head_dim, bytes


class FakeRanks(TPGroup):
    """Two ranks whose smallest block count is `other`: no process group needed."""

    def __init__(self, other: int):
        super().__init__(rank=0, size=2)
        self.other = other

    def min(self, value: int) -> int:
        return min(value, self.other)


def never_measured() -> int:
    raise AssertionError("the GPU budget was measured though the size was given")


def test_kv_cache_layout():
    assert LAYOUT.bytes_per_block == BLOCK_BYTES == 4096
    assert LAYOUT.layer_shape(10) == (10, 16, 16)  # the keys (or values) of one of the 2 layers


def test_blocks_from_a_byte_budget():
    assert blocks_for_budget(10 * BLOCK_BYTES + BLOCK_BYTES - 1, BLOCK_BYTES) == 10
    assert blocks_for_budget(BLOCK_BYTES, BLOCK_BYTES) == 1
    with pytest.raises(RuntimeError, match=r"no memory is left for the KV cache \(budget 0 MiB\); lower the context"):
        blocks_for_budget(BLOCK_BYTES - 1, BLOCK_BYTES)


def test_number_of_blocks_from_the_settings(monkeypatch):
    checked = []  # the host-memory checks, recorded instead of reading this machine's free memory
    monkeypatch.setattr(
        "engine.runner.kv_cache.check_host_memory", lambda needed, what, _: checked.append((needed, what))
    )
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # naming a device allocates nothing
    config = EngineConfig(model="m", num_kvcache_blocks=12)
    assert choose_num_blocks(config, LAYOUT, cpu, SINGLE, never_measured) == 12
    assert choose_num_blocks(config, LAYOUT, cpu, FakeRanks(other=9), never_measured) == 9  # the smallest rank's

    config = EngineConfig(model="m", kv_cache_memory_bytes=20 * BLOCK_BYTES)
    assert choose_num_blocks(config, LAYOUT, cpu, SINGLE, never_measured) == 20
    # An explicit budget is the whole engine's: two ranks get half each.
    assert choose_num_blocks(config, LAYOUT, cpu, FakeRanks(other=99), never_measured) == 10

    config = EngineConfig(model="m")
    assert choose_num_blocks(config, LAYOUT, cpu, SINGLE, never_measured) == CPU_KV_CACHE_BYTES // BLOCK_BYTES
    assert choose_num_blocks(config, LAYOUT, cuda, SINGLE, lambda: 7 * BLOCK_BYTES + 5) == 7
    # Every CPU answer was checked against host memory at its full size; the GPU's was not.
    assert checked == [(n * BLOCK_BYTES, "the KV cache") for n in (12, 9, 20, 10, CPU_KV_CACHE_BYTES // BLOCK_BYTES)]
    with pytest.raises(RuntimeError, match="no memory is left for the KV cache"):
        choose_num_blocks(EngineConfig(model="m", kv_cache_memory_bytes=100), LAYOUT, cpu, SINGLE, never_measured)


def test_gpu_memory_is_what_the_process_may_use(monkeypatch):
    """KV sizing reads the GPU through process_memory_info: within a set_per_process_memory_fraction cap (an
    8 GiB laptop modelled on a big GPU) the cap is the total, and free is what is left under it."""
    from engine.runner.kv_cache import process_memory_info

    gib, cuda = 2**30, torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (120 * gib, 128 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 3 * gib)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)
    assert process_memory_info(cuda) == (120 * gib, 128 * gib)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.125)
    assert process_memory_info(cuda) == (13 * gib, 16 * gib)  # a 16 GiB cap, 3 of them held already
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2 * gib, 128 * gib))  # others use the rest
    assert process_memory_info(cuda) == (2 * gib, 16 * gib)
