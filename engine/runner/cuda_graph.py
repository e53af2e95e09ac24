"""CUDA graphs for decode: one graph per batch size on a ladder, replayed with padded rows.

A decode step launches hundreds of small kernels; replaying a captured graph removes their
launch cost. A graph is captured for each size of the ladder. A batch of n sequences replays
the smallest graph with at least n rows; the extra rows are padding that writes nothing (slot -1)
and attends to nothing (seq_len 0). Prefill and batches above the ladder run eagerly.
"""

import bisect

import torch

from engine.attention import AttentionMetadata
from engine.attention.metadata import DecodeStates


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and covering max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def pick_graph_size(sizes: list[int], batch_size: int) -> int | None:
    """The smallest captured size that holds `batch_size` rows, or None (run eagerly)."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    def __init__(
        self,
        forward,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_seq_len: int,
        recurrent_state: bool = False,
    ):
        """`recurrent_state`: the model has a hybrid model's recurrent layers, whose state slots the graphs read
        from buffers of their own (engine/layers/gated_deltanet.py)."""
        self.forward = forward
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_seq_len = max_seq_len
        n = self.sizes[-1]
        with torch.device(device):
            self.input_ids = torch.zeros(n, dtype=torch.int64)
            self.positions = torch.zeros(n, dtype=torch.int64)
            self.slot_mapping = torch.full((n,), -1, dtype=torch.int64)
            self.query_start_loc = torch.arange(n + 1, dtype=torch.int32)
            self.seq_lens = torch.zeros(n, dtype=torch.int32)
            self.block_tables = torch.full((n, max_blocks_per_seq), -1, dtype=torch.int32)
            self.hidden = torch.zeros(n, hidden_size, dtype=dtype)
            rows = lambda fill: torch.full((n,), fill, dtype=torch.int32)  # noqa: E731
            self.states = DecodeStates(rows(-1), rows(1), rows(-1)) if recurrent_state else None
        self.graphs: dict = {}  # size -> torch.cuda.CUDAGraph
        self.pool = None

    def _meta(self, size: int) -> AttentionMetadata:
        states = None if self.states is None else DecodeStates(*(t[:size] for t in vars(self.states).values()))
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[self.max_seq_len] * size,
            host_lens_exact=False,
            decode_state_rows=states,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        # Largest first, so the smaller graphs fit in the memory pool the largest one made.
        for size in reversed(self.sizes):
            self.graphs[size] = self._capture(size)

    def _step(self, size: int) -> None:
        self.hidden[:size] = self.forward(self.input_ids[:size], self.positions[:size], self._meta(size))

    def _capture(self, size: int):
        """A graph of one decode step over the first `size` rows of the static buffers."""
        self._step(size)  # warm-up: lazy initialisation and compilation must not happen inside capture
        graph = torch.cuda.CUDAGraph()
        # "thread_local": CUDA calls from other threads (the app's other engine or UI) during the
        # capture are theirs to make; the default would make them, and the capture, fail.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._step(size)
        if self.pool is None:
            self.pool = graph.pool()
        torch.cuda.synchronize()
        return graph

    def can_run(self, meta: AttentionMetadata) -> bool:
        # A prompt that starts from a state snapshot copies it first, in its layers: eagerly
        fits = pick_graph_size(self.sizes, meta.num_seqs) is not None
        return meta.is_decode_only and fits and not meta.state_restores and meta.state_waves_cpu is None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = meta.num_seqs
        size = pick_graph_size(self.sizes, n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.slot_mapping[n:size] = -1
        self.seq_lens[:n] = meta.seq_lens
        self.seq_lens[n:size] = 0
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width] = meta.block_tables
        self.block_tables[:n, width:] = -1
        if self.states is not None:  # padding rows: no slot, no snapshot
            rows = meta.decode_states(self.input_ids.device)
            for buffer, given in zip(vars(self.states).values(), vars(rows).values(), strict=True):
                buffer[:n] = given
                buffer[n:size] = -1
        self.graphs[size].replay()
        return self.hidden[:n]
