"""Loading a draft model beside the target: same device and dtype, and a tokenizer that must be the target's, or
its drafts would mean other text. Its own KV cache has as many blocks as the target's (it mirrors the target's
requests); on a GPU whose cache is sized from free memory, the target takes a smaller share of the GPU so that
the draft's weights and a cache of their size fit beside it (leave_room_for_the_draft)."""

from dataclasses import replace

import torch

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.front.model_files import open_model
from engine.loader import resolve_gguf, resolve_model_path, safetensors_files
from engine.runner.model_runner import ModelRunner
from engine.spec_decode.draft_model import DraftModelProposer


def load_draft_model(model: str, target) -> DraftModelProposer:
    """`model` (a GGUF file, a folder or a hub repo) loaded as the draft of `target`, an LLMEngine whose runner
    and tokenizer are loaded."""
    if target.pooling is not None:
        raise ValueError("speculative decoding is for generating text; an embedding model has nothing to draft")
    on_gpu = target.device.type == "cuda" and target.config.num_kvcache_blocks is None
    config = replace(
        target.config,
        model=str(model),
        speculative_config=None,
        runner="generate",
        # as many blocks as the target's; on a GPU, what the target left it (gpu_share_beside_draft)
        num_kvcache_blocks=None if on_gpu else target.model_runner.num_blocks,
        kv_cache_memory_bytes=draft_checkpoint_bytes(model) if on_gpu else None,
        max_model_len=None,  # its own context, or what its cache holds: it drafts nothing past that
        async_scheduling=False,
        # a GGUF draft keeps its own types; a checkpoint draft is quantized as the target is
        quantization=None if resolve_gguf(str(model)) is not None else target.config.quantization,
    )
    path, hf_config, tokenizer = open_model(config)
    check_same_vocabulary(tokenizer.result(), target.tokenizer, model, target.config.model)
    try:
        runner = ModelRunner(config, hf_config, path, target.device, target.dtype, tokenizer=tokenizer)
    except torch.OutOfMemoryError as e:
        raise MemoryError(
            f"the draft model {model} does not fit beside {target.config.model}: lower gpu_memory_utilization "
            "(e.g. to 0.8) to leave it room, or pick a smaller draft"
        ) from e
    if runner.state_slots[0]:
        runner.release()
        raise ValueError(
            f"the draft model {model} keeps a recurrent state (Qwen3.5, Qwen3-Next), which cannot be rolled back "
            "past rejected drafts yet; pick a draft with attention layers only"
        )
    windows = runner.kv_groups.windows
    block_manager = BlockManager(runner.num_blocks, config.kvcache_block_size, config.enable_prefix_caching, windows)
    return DraftModelProposer(
        runner, block_manager, target.scheduler.max_num_batched_tokens, target.model_runner.vocab_size
    )


def leave_room_for_the_draft(config: EngineConfig, device: torch.device) -> None:
    """On a GPU whose KV cache is sized from free memory, the target takes a smaller share: the draft model loads
    after it, within the same gpu_memory_utilization."""
    if config.num_kvcache_blocks is None and config.kv_cache_memory_bytes is None:
        total = torch.cuda.get_device_properties(device).total_memory
        draft = draft_checkpoint_bytes(config.speculative.model)
        config.gpu_memory_utilization = gpu_share_beside_draft(config.gpu_memory_utilization, draft, total)


def draft_checkpoint_bytes(model: str) -> int:
    """The draft's weights as stored (a GGUF file, or a folder's safetensors files), downloading it if needed."""
    gguf = resolve_gguf(str(model))
    if gguf is not None:
        return gguf.stat().st_size
    return sum(f.stat().st_size for f in safetensors_files(resolve_model_path(str(model))))


def gpu_share_beside_draft(gpu_memory_utilization: float, draft_bytes: int, gpu_bytes: int) -> float:
    """The share of the GPU the target may take so that its draft fits beside it within gpu_memory_utilization: the
    draft's weights, a KV cache of their size, and 512 MiB of activations and graphs."""
    share = gpu_memory_utilization - (2 * draft_bytes + (512 << 20)) / gpu_bytes
    if share < 0.1:
        raise MemoryError(
            f"a draft model of {draft_bytes / 2**30:.1f} GiB leaves too little of this "
            f"{gpu_bytes / 2**30:.1f} GiB GPU for the model (at gpu_memory_utilization={gpu_memory_utilization}); "
            "pick a smaller draft, or use n-gram speculative decoding"
        )
    return share


def check_same_vocabulary(draft_tokenizer, target_tokenizer, draft: str, target: str) -> None:
    """Refuse a draft whose token ids mean other text than the target's. Only the ids both have are compared: the
    sizes of one series differ by padding (a GGUF file pads its vocabulary to the model's embedding rows: Qwen2.5's
    0.5B has 151,936, its 7B 152,064), and the target never takes a draft id it lacks (draft_model._usable)."""
    draft_ids = {i: t for t, i in draft_tokenizer.get_vocab().items()}
    target_ids = {i: t for t, i in target_tokenizer.get_vocab().items()}
    shared = min(len(draft_ids), len(target_ids))
    differing = [
        (i, draft_ids.get(i), target_ids.get(i)) for i in range(shared) if draft_ids.get(i) != target_ids.get(i)
    ]
    if not differing:
        return
    raise ValueError(
        f"the draft model {draft} has a different tokenizer from {target} ({len(differing)} of their first {shared} "
        f"token ids differ, e.g. (id, draft, target) {differing[:3]}): its drafts would mean other text. Pick a "
        "draft of the same family, one that shares the target's tokenizer (e.g. a smaller model of the same series)"
    )
