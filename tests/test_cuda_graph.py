"""The decode-graph ladder without a GPU: size selection, padding, and static-buffer replay.

`_capture` is replaced by an eager replay of the same static buffers, so everything around the
graph (which graph serves which batch, copying inputs in, padding rows) runs here for real."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.runner.cuda_graph import DecodeGraphs, graph_batch_sizes, pick_graph_size


def test_ladder_sizes_cover_max_num_seqs():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(256)[-3:] == [224, 240, 256]


@pytest.mark.parametrize("batch,expected", [(1, 1), (3, 4), (8, 8), (9, 16), (33, 40), (40, 40), (41, None)])
def test_smallest_graph_that_fits(batch, expected):
    assert pick_graph_size(graph_batch_sizes(40), batch) == expected


class EagerReplay:
    def __init__(self, graphs: DecodeGraphs, size: int):
        self.graphs, self.size, self.replays = graphs, size, 0

    def replay(self):
        self.replays += 1
        self.graphs._step(self.size)


def test_graph_replay_with_padding_matches_eager(tiny_llama, monkeypatch):
    monkeypatch.setattr(DecodeGraphs, "_capture", lambda self, size: EagerReplay(self, size))
    prompts = [[5 + i, 17, 33, 100 + i, 7][: 2 + i] for i in range(3)]  # 3 rows: replays the 4-row graph
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    eager = LLM(str(tiny_llama), dtype="float32", num_kvcache_blocks=32, max_num_seqs=5)
    expected = [o["token_ids"] for o in eager.generate(prompts, params, use_tqdm=False)]

    llm = LLM(str(tiny_llama), dtype="float32", num_kvcache_blocks=32, max_num_seqs=5)
    runner = llm.model_runner
    runner.graphs = DecodeGraphs(runner.model, 64, torch.float32, torch.device("cpu"), 5, 2, llm.max_model_len)
    runner.graphs.capture()
    # Stale rows from an earlier, larger batch must not leak into a smaller one.
    runner.graphs.block_tables.fill_(0)
    runner.graphs.seq_lens.fill_(7)
    runner.graphs.slot_mapping.fill_(31 * 16)  # the last block, which this load never allocates
    got = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert runner.graphs.graphs[4].replays > 0
    # Padded rows wrote nothing, though their stale slot pointed at block 31.
    assert all(cache[31].abs().sum() == 0 for cache in runner.kv_cache)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_a_hybrid_models_graphs_carry_each_rows_state_slot(kernels, tiny_models, hf_model, random_prompt, monkeypatch):
    """The tiny Qwen3.5's decode graphs read the state slots from their own buffers: 3 rows replay the 4-row
    graph, a padding row's state goes to the scratch slot, and a reply that passes position 128 keeps a snapshot
    from inside the graph, which the next turn starts from. On the Triton kernels too (the interpreter here)."""
    from engine.layers import gated_deltanet
    from tests.test_parity import hf_greedy

    if kernels == "triton":
        pytest.importorskip("triton")
        monkeypatch.setattr(gated_deltanet, "uses_triton", lambda x: True)
    monkeypatch.setattr(DecodeGraphs, "_capture", lambda self, size: EagerReplay(self, size))
    path = tiny_models["qwen3_5"]
    llm = LLM(str(path), dtype="float32", num_kvcache_blocks=64, max_num_seqs=5)
    runner = llm.model_runner
    runner.graphs = DecodeGraphs(
        runner.model, 64, torch.float32, torch.device("cpu"), 5, 16, llm.max_model_len, recurrent_state=True
    )
    runner.graphs.capture()
    runner.graphs.states.slots.fill_(0)  # stale rows from an earlier, larger batch
    runner.graphs.states.keep.fill_(1)
    prompts = [random_prompt(120, 150), random_prompt(9, 151), random_prompt(30, 152)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    results = llm.generate(prompts, params, use_tqdm=False)
    assert runner.graphs.graphs[4].replays > 0
    for prompt, result in zip(prompts, results):
        assert result["token_ids"] == hf_greedy(hf_model(path), prompt, 20)
    turn2 = prompts[0] + results[0]["token_ids"] + [5, 6]
    again = llm.generate([turn2], params, use_tqdm=False)[0]
    assert again["num_cached_tokens"] == 128  # the snapshot the graph kept at 128 tokens
    assert again["token_ids"] == hf_greedy(hf_model(path), turn2, 20)
