"""Runs the model for one scheduled batch: builds its inputs, owns the KV cache, samples."""
import logging

import torch

from engine.attention import AttentionMetadata, select_backend
from engine.config import EngineConfig
from engine.layers.attention import Attention
from engine.layers.sampler import Sampler, SamplingBatch
from engine.loader import load_weights
from engine.models import model_class
from engine.scheduler import ScheduledSeq

log = logging.getLogger("engine")

CPU_KV_CACHE_BYTES = 1 << 30


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, model_path, device: torch.device, dtype: torch.dtype):
        self.config, self.hf_config, self.device, self.dtype = config, hf_config, device, dtype
        self.block_size = config.kvcache_block_size
        self.vocab_size = hf_config.vocab_size
        max_position = config.max_model_len or hf_config.max_position_embeddings
        torch.manual_seed(config.seed)
        with torch.device(device):
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                self.model = model_class(hf_config)(hf_config, max_position)
            finally:
                torch.set_default_dtype(default_dtype)
        load_weights(self.model, model_path)
        self.model.eval()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.backend = select_backend(config.attention_backend, device)
        for layer in self.attention_layers:
            layer.backend = self.backend
        self.sampler = Sampler()
        self.num_blocks = self._allocate_kv_cache()

    # ---- KV cache -------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        a = self.attention_layers[0]
        return 2 * len(self.attention_layers) * self.block_size * a.num_kv_heads * a.head_dim * self.dtype.itemsize

    def _allocate_kv_cache(self) -> int:
        num_blocks = self.config.num_kvcache_blocks
        if num_blocks is None:
            budget = self.config.kv_cache_memory_bytes
            if budget is None:
                budget = self._gpu_kv_budget() if self.device.type == "cuda" else CPU_KV_CACHE_BYTES
            num_blocks = budget // self.kv_bytes_per_block()
            if num_blocks < 1:
                raise RuntimeError(f"no memory is left for the KV cache (budget {budget / 2**20:.0f} MiB); "
                                   "lower the context length, use a smaller model or a lower precision")
        a = self.attention_layers[0]
        shape = (2, len(self.attention_layers), num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        log.info("KV cache: %d blocks of %d tokens (%.0f MiB)", num_blocks, self.block_size, self.kv_cache.nbytes / 2**20)
        return num_blocks

    def _gpu_kv_budget(self) -> int:
        raise NotImplementedError  # filled in by the GPU path

    # ---- one step -------------------------------------------------------------------------------
    def prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """input_ids, positions, attention metadata, and the rows whose logits get sampled."""
        bs = self.block_size
        starts = [s.seq.num_computed_tokens for s in batch]
        query_lens = [s.num_new_tokens for s in batch]
        seq_lens = [a + n for a, n in zip(starts, query_lens)]
        token_ids: list[int] = []
        for s, start, n in zip(batch, starts, query_lens):
            token_ids += s.seq.token_ids[start : start + n]
        max_blocks = max(len(s.seq.block_table) for s in batch)
        tables = torch.tensor([s.seq.block_table + [-1] * (max_blocks - len(s.seq.block_table)) for s in batch], dtype=torch.int32)
        query_lens_t = torch.tensor(query_lens)
        query_start_loc = torch.zeros(len(batch) + 1, dtype=torch.int32)
        torch.cumsum(query_lens_t, 0, out=query_start_loc[1:])
        seq_index = torch.repeat_interleave(torch.arange(len(batch)), query_lens_t)
        positions = torch.tensor(starts)[seq_index] + torch.arange(len(token_ids)) - query_start_loc[:-1].long()[seq_index]
        slot_mapping = tables[seq_index, positions // bs].long() * bs + positions % bs
        sample_rows = [i for i, s in enumerate(batch) if s.samples]
        logits_index = query_start_loc[1:].long()[sample_rows] - 1
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            query_start_loc=query_start_loc.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev),
            block_tables=tables.to(dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        return torch.tensor(token_ids).to(dev), positions.to(dev), meta, logits_index.to(dev)

    def prepare_sampling(self, batch: list[ScheduledSeq]) -> SamplingBatch:
        params = [s.seq.sampling_params for s in batch]
        dev = self.device

        def column(values, dtype, off):
            return torch.tensor(values, dtype=dtype, device=dev) if any(v != off for v in values) else None

        penalties = column([p.repetition_penalty for p in params], torch.float32, 1.0)
        seen = None
        if penalties is not None:
            seen = torch.zeros(len(batch), self.vocab_size, dtype=torch.bool, device=dev)
            for row, s in enumerate(batch):
                if params[row].repetition_penalty != 1.0:
                    seen[row, torch.tensor(s.seq.token_ids, device=dev)] = True
        top_k = [p.top_k if p.top_k > 0 else self.vocab_size for p in params]
        return SamplingBatch(
            temperatures=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
            top_k=column([min(k, self.vocab_size) for k in top_k], torch.int64, self.vocab_size),
            top_p=column([p.top_p for p in params], torch.float32, 1.0),
            min_p=column([p.min_p for p in params], torch.float32, 0.0),
            repetition_penalties=penalties,
            seen_tokens=seen,
            generators=[s.seq.generator for s in batch],
            all_greedy=all(p.temperature == 0 for p in params),
        )

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> list[int]:
        """Run one step. Returns the sampled token of each sequence whose chunk reached its end."""
        input_ids, positions, meta, logits_index = self.prepare(batch)
        hidden = self.forward(input_ids, positions, meta)
        if logits_index.numel() == 0:
            return []
        logits = self.model.compute_logits(hidden[logits_index])
        sampling = self.prepare_sampling([s for s in batch if s.samples])
        return self.sampler(logits, sampling).tolist()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)
