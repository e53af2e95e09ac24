"""What the engine reports: each request's increments, its counters, and the state of every KV block.

Small typed contracts in the form of vLLM v1's `RequestOutput` and `SchedulerStats`: the app, the
API server and the benchmarks read these fields, never a dict whose keys might be missing.
"""

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_text: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    token_ids: list[int] = field(default_factory=list)  # all output tokens, once finished
    # Asked-for logprobs (SamplingParams.logprobs): one {token_id: logprob} per token of new_token_ids
    logprobs: list[dict[int, float]] | None = None
    # SamplingParams.prompt_logprobs: None, then one dict per prompt token; in the request's first output only
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None  # why the request failed (finish_reason "error": its constraint could not be followed)
    # With finish_reason "stop": the stop string or stop token id (not the model's end token) that ended it
    stop_reason: str | int | None = None
    # Speculative decoding, once finished: (steps that checked drafts, tokens drafted, of them accepted); None when
    # the request never speculated
    speculation: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class EmbeddingOutput:
    """One input's embedding (`LLM.embed`)."""

    embedding: list[float]  # pooled, truncated to the dimensions asked for, normalized where the model says so
    prompt_token_ids: list[int]  # the input as the model read it (with the special tokens its tokenizer adds)


@dataclass(frozen=True)
class EngineStats:
    """The engine's counters and settings at one moment (`LLMEngine.stats()`)."""

    num_blocks: int  # KV blocks in the cache
    free_blocks: int  # blocks no running request holds (empty or cached)
    cached_blocks: int  # free blocks that still hold a registered prefix hash (evicted last, LRU)
    used_blocks: int  # blocks held by at least one running request
    block_size: int  # tokens per block
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int  # of those, tokens served from the cache (hit rate = hits / queries)
    num_running: int  # requests in the running batch
    num_waiting: int  # requests queued, not yet admitted (or preempted, to be recomputed)
    num_preemptions: int  # times a running request gave up its blocks for lack of room, since start
    num_generated_tokens: int  # tokens sampled, since start
    max_model_len: int  # longest prompt plus output one request may have
    device: str  # "cpu", "cuda:0", ...
    dtype: str  # "float32", "bfloat16", ...
    attention_backend: str  # "torch", "triton" or "flash-attn"
    matmul: str  # "onednn-packed", "torch", "torch+triton-gemv", with any fused norm projections; quantized
    # models list their kernels, e.g. "Int4PackMatmul x210, SplitInt4Matmul x1"
    quantization: str  # how the weights are stored: "none", "int8", "int4 (groups of 64)", "GGUF Q4_1, Q8_0"
    sampler: str  # "compiled" (large GPU batches through torch.compile) or "eager"
    # How decode steps run: "cuda-graphs", "compiled (1 row, 2-256 rows)" on a CPU (the graphs that measured
    # faster than eager; engine/runner/compiled_decode.py), "eager", or "eager (compile failed)"
    decode: str
    async_scheduling: bool  # the host plans step N+1 while the device runs step N
    tensor_parallel_size: int  # processes (GPUs) the model is split across
    # The most requests one step has run together, since start. A recorded peak: sampling num_running from
    # outside misses short peaks, most of all on a loaded machine.
    max_batch_size: int = 0
    # KV-cache groups (engine/runner/kv_cache.py): each group's kind ("full" or "sliding 1024"), the blocks
    # running requests hold in it, and how many of the model's layers one block holds (all of them, for one group)
    kv_groups: tuple[str, ...] = ("full",)
    used_blocks_per_group: tuple[int, ...] = ()
    layers_per_block: int = 0
    bytes_per_block: int = 0  # of every layer's keys and values a block holds
    # How the cache stores them: "auto" (the model's dtype), or quantized: "int8", "fp8", "int4"
    kv_cache_dtype: str = "auto"
    # A hybrid model's recurrent state (engine/core/state_slots.py): one slot's bytes, the slots running requests
    # hold, and the prefix snapshots kept
    state_slot_bytes: int = 0
    used_state_slots: int = 0
    state_snapshots: int = 0
    num_state_slots: int = 0  # running requests' slots (at most that many run)
    num_snapshot_slots: int = 0
    # Speculative decoding (engine/spec_decode/): the method; request-steps that checked drafts; drafted, accepted
    speculative_method: str | None = None
    spec_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a speculating request gained per step: its accepted drafts and the one token every step gives."""
        return (self.spec_accepted_tokens + self.spec_steps) / self.spec_steps if self.spec_steps else 0.0

    @property
    def held_bytes(self) -> int:
        """Bytes of KV blocks and recurrent state that running requests hold (cached free blocks and snapshots
        not counted: they are kept for later requests, and given up when room is needed)."""
        return self.used_blocks * self.bytes_per_block + self.used_state_slots * self.state_slot_bytes

    @property
    def kv_cache_usage(self) -> float:
        """The share of blocks in use, 0..1 (vLLM's kv_cache_usage_perc)."""
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclass(slots=True)
class KVBlock:
    """One block of the paged KV cache, as `LLMEngine.kv_blocks()` reports it to the visualizer.

    The UI polls every block a few times a second under the engine's lock, so this is a slotted,
    unfrozen dataclass: 1.0 ms for 10,000 blocks, where frozen=True took 5.0 ms (a dict, 1.7 ms)."""

    id: int  # the block's index in the cache
    ref_count: int  # running requests that use it; 0 for a free block
    cached: bool  # it holds a registered prefix hash, so a request with the same prefix can reuse it
    filled: int  # tokens written into it (block_size once full)
    owners: tuple[str, ...]  # ids of the running requests that use it
    group: int = 0  # the KV-cache group whose KV it holds (EngineStats.kv_groups), while used or cached
