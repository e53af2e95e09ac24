"""The paged KV cache: how many blocks fit, and the tensors that hold them.

Each layer's keys and values live in tensors of their own:

    layer.k_cache, layer.v_cache: (num_blocks, block_size, num_kv_heads, head_dim), for each Attention layer
                                    |           |
                                    |           +-- slot within the block: token position % block_size
                                    +-- block id, as BlockManager hands them out (a sequence's block_table)
    and per slot, one (num_kv_heads, head_dim) key or value: this rank's KV heads under tensor parallelism.

Separate tensors, not views of one: a compiled decode step writes each cache in place, which the
compiler does only for a tensor that is no view of a larger one (with one shared tensor it copied
the whole cache for every layer, 50-250 ms a step; engine/runner/compiled_decode.py).

A model whose layers attend in different ways (sliding windows beside full attention) has KV-cache groups
(KVCacheGroups): layers of one kind, each group with its own block tables and slots per step. Then a pair of
tensors serves one layer of every group, and a block id holds the KV of one group's layers only.

    one sequence, block_size 4, block_table [7, 2, 9]:

    position       0  1  2  3 |  4  5  6  7 |  8  9
    block id       7          |  2          |  9
    slot_mapping  28 29 30 31 |  8  9 10 11 | 36 37      slot = block id * block_size + position % block_size

A layer's k_cache viewed as (num_blocks * block_size, num_kv_heads, head_dim) is indexed by slot:
a step writes its new keys and values at `slot_mapping`, and attention reads a sequence's history
block by block through `block_tables`. Slot -1 is a padded token, written nowhere.

Sizing: `num_kvcache_blocks` if set; else a byte budget divided by the bytes of one block. The
budget is `kv_cache_memory_bytes` (for the whole engine, split across tensor-parallel ranks), or
by default CPU_KV_CACHE_BYTES on the CPU, and on a GPU what `gpu_memory_utilization` leaves once a
warm-up step of the largest batch has measured the activations (`gpu_kv_budget`).
"""

import logging
import math
import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.layers.attention import Attention
from engine.runner.distributed import TPGroup
from engine.runner.memory import check_host_memory

log = logging.getLogger("engine")

CPU_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class KVCacheGroups:
    """The model's attention layers in KV-cache groups of one kind each (full attention, or one sliding window),
    as vLLM v1's hybrid KV-cache manager groups them. Every group has as many layers (the kind with the fewest
    sets the size; a short last group of a kind is padded), and a cache tensor is shared by one layer of each
    group: layer i of every group uses tensor i. A block id belongs to one group at a time (BlockManager), so
    the groups never write the same rows, and a block weighs `group_size` layers instead of all of them.

    Gemma 3 4B: 5 global layers and 29 sliding ones make 1 full group and 6 sliding ones of 5 layers (one
    padded); at 32k tokens its sequence holds 2,048 full-group blocks and 6 x 65 sliding ones, 0.18x the bytes
    of the all-global layout."""

    windows: tuple[int | None, ...]  # each group's sliding window, None for full attention
    layer_groups: tuple[int, ...]  # each attention layer's group
    layer_slots: tuple[int, ...]  # each attention layer's cache tensor: its place in its group

    @property
    def group_size(self) -> int:
        return max(self.layer_slots) + 1

    def blocks_held(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """The most blocks one sequence of `num_tokens` tokens holds, computed in steps of at most `chunk`
        tokens: a sliding-window group holds its window's blocks and the step's."""
        full = -(-num_tokens // block_size)
        return sum(full if w is None else min(full, -(-(w - 1 + chunk) // block_size) + 1) for w in self.windows)

    def tokens_that_fit(self, num_blocks: int, block_size: int, chunk: int) -> int:
        """The longest sequence `num_blocks` blocks hold (in whole blocks)."""
        if None not in self.windows and self.blocks_held(1 << 40, block_size, chunk) <= num_blocks:
            return 1 << 40  # every group slides: any length fits
        low, high = 0, num_blocks * block_size  # a full group holds a block per block_size tokens
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.blocks_held(mid, block_size, chunk) <= num_blocks else (low, mid - 1)
        return low // block_size * block_size

    @classmethod
    def of(cls, layer_windows: Sequence[int | None], split: bool = True) -> "KVCacheGroups":
        """Groups for layers with these windows; `split` False: one group of every layer, releasing nothing (a
        step that is compiled or captured reads one block table: each layer still masks its own window)."""
        kinds = list(dict.fromkeys(layer_windows))
        if not split or len(kinds) == 1:
            window = kinds[0] if split else None
            return cls((window,), (0,) * len(layer_windows), tuple(range(len(layer_windows))))
        size = min(layer_windows.count(kind) for kind in kinds)
        windows, groups, slots = [], [0] * len(layer_windows), [0] * len(layer_windows)
        for kind in kinds:
            layers = [i for i, w in enumerate(layer_windows) if w == kind]
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start : start + size]):
                    groups[layer], slots[layer] = len(windows), slot
                windows.append(kind)
        return cls(tuple(windows), tuple(groups), tuple(slots))


@dataclass(frozen=True)
class KVCacheLayout:
    """The shape of one block across the cache tensors, and what it weighs. Each token of cache tensor i holds
    `slot_widths[i]` keys (or values): the widest of its layers' heads x head size. Where a tensor serves layers
    of different widths (Gemma 4's global layers have other heads and head sizes than its sliding ones), a
    narrower layer reads and writes the first part of each token's row (`layer_view`), so that a block id names
    the same rows for every layer of the tensor."""

    slot_widths: tuple[int, ...]  # per cache tensor (of keys, and of values): one per layer of a KV-cache group
    block_size: int
    dtype: torch.dtype

    @classmethod
    def of(
        cls, attention_layers: Sequence[Attention], block_size: int, dtype: torch.dtype, groups: KVCacheGroups
    ) -> "KVCacheLayout":
        widths = [0] * groups.group_size
        for layer, slot in zip(attention_layers, groups.layer_slots, strict=True):
            widths[slot] = max(widths[slot], row_width(layer))
        return cls(tuple(widths), block_size, dtype)

    @property
    def num_layers(self) -> int:
        """Cache tensors of keys (and as many of values): the layers one block holds."""
        return len(self.slot_widths)

    @property
    def bytes_per_block(self) -> int:
        return 2 * sum(self.slot_widths) * self.block_size * self.dtype.itemsize

    def layer_shape(self, num_blocks: int, slot: int = 0) -> tuple[int, ...]:
        """Cache tensor `slot` of keys (or values)."""
        return (num_blocks, self.block_size, self.slot_widths[slot])

    def uniform(self, attention_layers: Sequence[Attention], groups: KVCacheGroups) -> bool:
        """Whether every layer fills its tensor's whole rows: then each layer's cache is a contiguous tensor."""
        return all(
            row_width(layer) == self.slot_widths[slot]
            for layer, slot in zip(attention_layers, groups.layer_slots, strict=True)
        )


def plan_kv_cache(
    attention_layers: Sequence[Attention], block_size: int, dtype: torch.dtype, split: bool, strided: bool
) -> tuple[KVCacheGroups, KVCacheLayout]:
    """The KV-cache groups (split by window where `split`) and their layout, in `dtype` or the bytes of the layers'
    quantized format (`Attention.kv_format`). `strided`: whether the attention backend reads a cache that is a
    strided view; where it does not and the groups would put layers of different widths in one tensor, every
    layer keeps a tensor of its own (the groups not split: sliding layers then hold every block, as full ones do)."""
    for layer in attention_layers:
        layer.kv_format.check_head_dim(layer.head_dim)
    dtype = attention_layers[0].kv_format.storage_dtype(dtype) if attention_layers else dtype
    windows = [layer.sliding_window for layer in attention_layers]
    groups = KVCacheGroups.of(windows, split)
    layout = KVCacheLayout.of(attention_layers, block_size, dtype, groups)
    if split and not strided and not layout.uniform(attention_layers, groups):
        log.info("KV cache: layers of different widths in one block need strided caches; not splitting by window")
        return plan_kv_cache(attention_layers, block_size, dtype, False, strided)
    return groups, layout


def row_width(layer: Attention) -> int:
    """Elements of the cache tensor one token of `layer` takes: num_kv_heads x head_dim, or the rows of a quantized
    cache (engine/attention/kv_format.py)."""
    return layer.num_kv_heads * layer.kv_format.row_width(layer.head_dim)


def layer_view(cache: torch.Tensor, layer: Attention) -> torch.Tensor:
    """`layer`'s keys (or values) in a cache tensor: (num_blocks, block_size, num_kv_heads, head_dim), the first
    num_kv_heads x head_dim of each token's row (for a quantized cache, a row of bytes per head in place of
    head_dim). Strided where the layer is narrower than the row."""
    width = row_width(layer)
    rows = cache if width == cache.shape[-1] else cache[..., :width]
    return rows.view(*cache.shape[:2], layer.num_kv_heads, width // layer.num_kv_heads)


def blocks_for_budget(budget: int, bytes_per_block: int) -> int:
    """How many whole blocks `budget` bytes hold; at least one, or an error that says what to change."""
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise RuntimeError(
            f"no memory is left for the KV cache (budget {budget / 2**20:.0f} MiB); "
            "lower the context length, use a smaller model or a lower precision"
        )
    return num_blocks


def choose_num_blocks(
    config: EngineConfig,
    layout: KVCacheLayout,
    device: torch.device,
    tp: TPGroup,
    measure_gpu_budget: Callable[[], int],
) -> int:
    """This rank's number of blocks. `measure_gpu_budget` runs only when a GPU's budget must be
    measured (no explicit count or byte budget): it runs a warm-up step, which takes seconds."""
    num_blocks = config.num_kvcache_blocks
    if num_blocks is None:
        budget = config.kv_cache_memory_bytes
        if budget is None:
            budget = measure_gpu_budget() if device.type == "cuda" else CPU_KV_CACHE_BYTES
        elif tp.size > 1:  # an explicit budget is for the whole engine; split it across the ranks
            budget //= tp.size
        num_blocks = blocks_for_budget(budget, layout.bytes_per_block)
    if tp.size > 1:  # a block id must name the same slots on every rank: all take the smallest count
        num_blocks = tp.min(num_blocks)
    if device.type == "cpu":
        check_host_memory(
            num_blocks * layout.bytes_per_block,
            "the KV cache",
            "give it less memory (kv_cache_memory_bytes or num_kvcache_blocks; in the app, 'KV cache memory')",
        )
    return num_blocks


def fitting_max_model_len(
    wanted: int | None, max_position: int, groups: KVCacheGroups, num_blocks: int, block_size: int, chunk: int
) -> int:
    """The context one sequence may have: `wanted` (max_model_len) if the cache holds it, else an error that says
    what to change; by default the model's `max_position`, or what the cache holds if less. `chunk`: the most
    tokens a step computes (a sliding-window group holds them beside its window)."""
    capacity = groups.tokens_that_fit(num_blocks, block_size, chunk)
    if wanted is not None and wanted > capacity:
        raise ValueError(
            f"max_model_len={wanted} does not fit the KV cache, which holds {capacity} tokens of one sequence "
            f"({num_blocks} blocks); lower max_model_len or give the cache more memory"
        )
    return wanted or min(max_position, capacity)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on the CPU in an anonymous mapping, whose pages the system gives out zeroed when first written. A
    cache sized for a whole context then takes memory as the context grows, and a load does not wait to zero it:
    torch.zeros wrote every page of an 8B model's 1 GiB cache first, 3.1 s of the load on a 2-core VM."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    private = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_ANONYMOUS") else {}
    pages = mmap.mmap(-1, max(nbytes, 1), **private)  # shared (the default) would count as shared memory
    return torch.frombuffer(pages, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def allocate_kv_cache(
    layout: KVCacheLayout,
    num_blocks: int,
    attention_layers: Sequence[Attention],
    device: torch.device,
    groups: KVCacheGroups | None = None,
) -> list[torch.Tensor]:
    """The zeroed cache tensors (`zeroed`), [k, v, k, v, ...], bound to each Attention layer's k_cache and v_cache
    (`layer_view`): a tensor pair per layer, or per place in a KV-cache group where `groups` has several
    (KVCacheGroups). Layers that share another's cache (`Attention.kv_source`) are not among `attention_layers`."""
    groups = groups or KVCacheGroups.of([None] * len(attention_layers))
    pairs = [
        tuple(zeroed(layout.layer_shape(num_blocks, slot), layout.dtype, device) for _ in range(2))
        for slot in range(groups.group_size)
    ]
    for layer, group, slot in zip(attention_layers, groups.layer_groups, groups.layer_slots, strict=True):
        layer.k_cache, layer.v_cache = (layer_view(cache, layer) for cache in pairs[slot])
        layer.kv_group = group
    kv_cache = [t for pair in pairs for t in pair]
    log.info(
        "KV cache: %d blocks of %d tokens (%.0f MiB)",
        num_blocks,
        layout.block_size,
        sum(t.nbytes for t in kv_cache) / 2**20,
    )
    return kv_cache


MAX_STATE_SNAPSHOTS = 256


def allocate_states(
    model: nn.Module, config: EngineConfig, device: torch.device, dtype: torch.dtype
) -> tuple[int, int, int]:
    """The recurrent layers' state pools (a hybrid model's Gated DeltaNet layers: `state_shapes()`), zeroed:
    (running slots, snapshot slots after them, bytes of one slot), zeros for a model without such layers
    (engine/core/state_slots.py).
    Running slots: max_num_seqs, or as many as a quarter of the KV budget holds if fewer (requests past them wait
    for one); snapshots for the prefix cache: another quarter's worth, at most MAX_STATE_SNAPSHOTS; with
    speculative decoding, num_speculative_tokens more per running slot (StateSlots.verify_slot)."""
    layers = [m for m in model.modules() if hasattr(m, "state_shapes")]
    if not layers:
        return 0, 0, 0
    shapes = [
        (layer, name, shape, torch.float32 if wide else dtype)
        for layer in layers
        for name, (shape, wide) in layer.state_shapes().items()
    ]
    slot_bytes = sum(math.prod(shape) * kind.itemsize for _, _, shape, kind in shapes)
    quarter = (config.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES) // 4
    running = max(1, min(config.max_num_seqs, quarter // slot_bytes))
    snapshots = min(MAX_STATE_SNAPSHOTS, quarter // slot_bytes) if config.enable_prefix_caching else 0
    # speculative decoding: k slots per running one, for the state after each row of a step that checks k drafts
    verify = running * config.max_draft_tokens if device.type == "cpu" else 0  # refused elsewhere for now
    total = running + snapshots + verify
    if device.type == "cpu":
        check_host_memory(total * slot_bytes, "the recurrent state", "lower max_num_seqs or num_speculative_tokens")
    for layer, name, shape, kind in shapes:  # and a scratch slot last, for rows that keep nothing (a graph's padding)
        setattr(layer, name, zeroed((total + 1, *shape), kind, device))
    log.info(
        "recurrent state: %d slots, %d prefix snapshots and %d for checking drafts, of %.1f MiB each (requests "
        "beyond the slots wait)",
        running,
        snapshots,
        verify,
        slot_bytes / 2**20,
    )
    return running, snapshots, slot_bytes


def process_memory_info(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the GPU as this process may use it: the device's own figures, within the cap
    `torch.cuda.set_per_process_memory_fraction` set, if any (as when an 8 GB laptop is modelled on a big GPU)."""
    free, total = torch.cuda.mem_get_info(device)
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # absent from older torch
    fraction = get_fraction(device) if get_fraction is not None else 1.0
    if fraction < 1.0:
        total = int(total * fraction)
        free = max(0, min(free, total - torch.cuda.memory_reserved(device)))
    return free, total


@torch.inference_mode()
def gpu_kv_budget(
    model: nn.Module,
    attention_layers: Sequence[Attention],
    layout: KVCacheLayout,
    config: EngineConfig,
    device: torch.device,
    bytes_before: int,
    use_graphs: bool,
) -> int:
    """Bytes for the KV cache: what gpu_memory_utilization leaves after weights, peak activations
    and graphs, and never more than is physically free (memory of other processes, or of other
    engines in this one, is not ours). `bytes_before`: what this process held on the device
    before the weights were loaded."""
    allocated = torch.cuda.memory_allocated(device)
    weights = allocated - bytes_before
    torch.cuda.reset_peak_memory_stats(device)
    warmup(model, attention_layers, layout, config, device)
    activations = torch.cuda.max_memory_allocated(device) - allocated
    torch.cuda.empty_cache()
    free, total = process_memory_info(device)
    graphs = min(1 << 30, total // 64) if use_graphs else 0
    by_share = total * config.gpu_memory_utilization - weights - activations - graphs
    by_free = free - activations - graphs - (256 << 20)
    budget = int(min(by_share, by_free))
    gib = 2**30
    if budget < layout.bytes_per_block:
        raise RuntimeError(
            f"the model does not fit: weights {weights / gib:.2f} GiB + activations {activations / gib:.2f} GiB "
            f"+ graphs {graphs / gib:.2f} GiB leave {max(budget, 0) / gib:.2f} GiB for the KV cache on a "
            f"{total / gib:.1f} GiB GPU with {free / gib:.1f} GiB free at gpu_memory_utilization="
            f"{config.gpu_memory_utilization}; use a smaller model, a lower max_num_batched_tokens, "
            "or raise gpu_memory_utilization"
        )
    return budget


def warmup(
    model: nn.Module,
    attention_layers: Sequence[Attention],
    layout: KVCacheLayout,
    config: EngineConfig,
    device: torch.device,
) -> None:
    """Run the largest step the scheduler may build, so its activation memory gets measured.

    Every token is a one-token sequence over a scratch cache of one block: the matmuls see the
    full token budget, and attention reads one block and writes nothing. The layers are left bound
    to the scratch block: `allocate_kv_cache` binds the real cache."""
    num_tokens = config.max_num_batched_tokens or 16384
    scratch = torch.zeros((1, layout.block_size, max(layout.slot_widths)), dtype=layout.dtype, device=device)
    for layer in attention_layers:
        layer.k_cache = layer.v_cache = layer_view(scratch, layer)
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(num_tokens + 1, dtype=torch.int32, device=device),
        seq_lens=torch.ones(num_tokens, dtype=torch.int32, device=device),
        block_tables=torch.zeros((num_tokens, 1), dtype=torch.int32, device=device),
        max_query_len=1,
        max_seq_len=1,
        query_lens_cpu=[1] * num_tokens,
        seq_lens_cpu=[1] * num_tokens,
        state_slots_cpu=[0] * num_tokens,  # a hybrid model's recurrent layers: every sequence new, on slot 0
    )
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    hidden = model(ids, ids, meta)
    rows = min(num_tokens, config.max_num_seqs)
    logits = model.compute_logits(hidden[:rows])
    if logits is not None:  # tensor-parallel workers get none
        logits.float().softmax(-1)
    torch.cuda.synchronize(device)
