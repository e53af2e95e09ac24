"""What the engine shows of itself: `stats()` and the KV-cache block map `kv_blocks()` draw from here."""

from engine import quantization
from engine.core.block_manager import NO_BLOCK, BlockManager
from engine.core.sequence import Sequence
from engine.front.outputs import EngineStats, KVBlock
from engine.quantization.mxfp4 import checkpoint_reads_mxfp4
from engine.spec_decode.speculator import SpeculationStats


def engine_stats(engine) -> EngineStats:
    """`engine`'s (an LLMEngine's) EngineStats: its KV cache, queues, counters and how it runs."""
    bm, sched, runner = engine.block_manager, engine.scheduler, engine.model_runner
    spec = SpeculationStats() if engine.speculator is None else engine.speculator.stats
    return EngineStats(
        num_blocks=bm.num_blocks,
        free_blocks=bm.num_free_blocks,
        cached_blocks=bm.num_cached_free_blocks,
        used_blocks=bm.num_blocks - bm.num_free_blocks,
        block_size=bm.block_size,
        prefix_cache_queries=bm.prefix_cache_queries,
        prefix_cache_hits=bm.prefix_cache_hits,
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        num_preemptions=sched.num_preemptions,
        num_generated_tokens=engine.num_generated_tokens,
        max_model_len=engine.max_model_len,
        device=str(engine.device),
        dtype=str(engine.dtype).removeprefix("torch."),
        attention_backend=runner.backend.name,
        matmul=matmul_kind(runner),
        quantization=weight_format(runner),
        sampler=runner.sampler.kind,
        decode=runner.decode_kind,
        async_scheduling=engine.async_scheduling,
        tensor_parallel_size=engine.config.tensor_parallel_size,
        max_batch_size=engine.max_batch_size,
        kv_groups=tuple("full" if w is None else f"sliding {w}" for w in bm.group_windows),
        used_blocks_per_group=tuple(bm.used_blocks_per_group),
        layers_per_block=runner.kv_layout.num_layers,
        bytes_per_block=runner.kv_layout.bytes_per_block,
        kv_cache_dtype=engine.config.kv_cache_dtype,
        state_slot_bytes=runner.state_slots[2],
        used_state_slots=0 if bm.states is None else bm.states.num_running - len(bm.states.free_running),
        state_snapshots=0 if bm.states is None else len(bm.states.snapshots),
        num_state_slots=0 if bm.states is None else bm.states.num_running,
        num_snapshot_slots=0 if bm.states is None else bm.states.num_snapshots,
        speculative_method=None if engine.speculator is None else engine.speculator.config.method,
        spec_steps=spec.steps,
        spec_draft_tokens=spec.draft_tokens,
        spec_accepted_tokens=spec.accepted_tokens,
    )


def kv_block_map(block_manager: BlockManager, running: list[Sequence]) -> list[KVBlock]:
    """One entry per KV block, in block id order (see KVBlock), with the `running` requests that hold it."""
    bs = block_manager.block_size
    owners: dict[int, list[str]] = {}
    filled: dict[int, int] = {}
    for seq in running:
        for table in seq.block_tables:
            for i, block_id in enumerate(table):
                if block_id == NO_BLOCK:
                    continue
                owners.setdefault(block_id, []).append(seq.request_id)
                filled[block_id] = max(filled.get(block_id, 0), min(bs, max(0, seq.num_computed_tokens - i * bs)))
    return [
        KVBlock(
            b.block_id,
            b.ref_count,
            b.hash is not None,
            bs if b.hash is not None else filled.get(b.block_id, 0),
            tuple(owners.get(b.block_id, ())),
            b.group,
        )
        for b in block_manager.blocks
    ]


def matmul_kind(runner) -> str:
    """How a ModelRunner's linear layers multiply: "onednn-packed" (CPU), "torch", or "torch+triton-gemv" when
    some layers run few-row products with the Triton kernel (engine/layers/gemv.py), followed by how many
    projections run the norm before them, where any do (engine/layers/normed_gemv.py)."""
    if runner.quantized:
        return quantization.kernel_summary(runner.model)
    if runner.packed_weights:
        return "onednn-packed"
    kind = "torch+triton-gemv" if any(runner.gemv_layers_by_rows.values()) else "torch"
    return kind + (f" (norm fused into {runner.normed_layers} projections)" if runner.normed_layers else "")


def weight_format(runner) -> str:
    """How a ModelRunner's weights are stored: see quantization.describe."""
    stored = f"GGUF {quantization.weight_types(runner.model)}" if runner.from_gguf else None
    stored = "MXFP4 experts, as the checkpoint stores them" if checkpoint_reads_mxfp4(runner.hf_config) else stored
    return quantization.describe(runner.config.quantization, runner.config.quantization_group_size, stored)
