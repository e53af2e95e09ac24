"""Engine settings: one dataclass, validated with errors that say what to change."""

from dataclasses import dataclass, field, fields

from engine.quantization.methods import DEFAULT_GROUP_SIZE, METHODS
from engine.spec_decode.config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash-attn")
RUNNERS = ("auto", "generate", "pooling")
KV_CACHE_DTYPES = (
    "auto",
    "int8",
    "fp8",
    "int4",
)  # how the KV cache stores keys and values: engine/attention/kv_format.py


def setting(default, help: str, choices: tuple | None = None):
    """A field of EngineConfig with the help text that `python -m engine.serve --help` shows for it."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class EngineConfig:
    model: str
    device: str = setting("auto", "where the model runs (auto: CUDA when there is a GPU)", DEVICES)
    dtype: str = setting(
        "auto",
        "weights and activations (auto: bf16/fp16 on a GPU, bf16 on a CPU that is fast at it, else float32)",
        DTYPES,
    )
    max_model_len: int | None = setting(
        None, "longest prompt plus reply (default: the model's context, capped by the KV cache)"
    )
    max_num_seqs: int = setting(256, "requests that run in one batch")
    max_num_batched_tokens: int | None = setting(
        None, "tokens one step may process (default: 2048 on a CPU, 16384 on a GPU)"
    )
    kvcache_block_size: int = setting(16, "tokens per KV block: the unit prefixes are shared in")
    num_kvcache_blocks: int | None = setting(None, "KV blocks (default: sized from memory)")
    kv_cache_memory_bytes: int | None = setting(
        None, "KV cache budget in bytes (default: 1 GiB on a CPU; on a GPU, what gpu_memory_utilization leaves)"
    )
    kv_cache_dtype: str = setting(
        "auto",
        "how the KV cache stores keys and values: auto (the model's dtype), or quantized, holding more tokens in the "
        "same memory: int8 or fp8 (about 2x; a scale per token and head), int4 (about 3.5x; a scale per 32 "
        "values); fp8 and int4 store keys less a mean key measured at load",
        KV_CACHE_DTYPES,
    )
    gpu_memory_utilization: float = setting(0.9, "share of the GPU's memory for weights, activations and KV cache")
    enable_prefix_caching: bool = setting(True, "share the KV blocks of identical prompt prefixes")
    state_snapshot_tokens: int = setting(
        128, "a hybrid model's recurrent state is kept for the prefix cache at every this many prompt tokens"
    )
    enforce_eager: bool = setting(False, "no CUDA graphs and no torch.compile (slower; for debugging)")
    tensor_parallel_size: int = setting(1, "split the model across this many GPUs (on a CPU: processes, for tests)")
    attention_backend: str = setting(
        "auto",
        "attention kernels (auto: flash-attn where installed and the block "
        "size allows, Triton on a GPU, torch elsewhere)",
        ATTENTION_BACKENDS,
    )
    # Plan and launch each step while the device still runs the one before. Default: on CUDA with
    # one GPU and a kernel backend (on a CPU, or with the torch backend, which reads lengths on the
    # host every layer, nothing overlaps, so it would only add a step of lag).
    async_scheduling: bool | None = setting(
        None, "plan each step while the GPU runs the one before (default: on for one GPU with a kernel backend)"
    )
    quantization: str | None = setting(
        None,
        "weight-only quantization at load: int8 (a scale per output "
        "channel) or int4 (a scale and offset per group of columns); "
        "GGUF files keep their own types (default: none)",
        METHODS,
    )
    quantization_group_size: int = setting(
        DEFAULT_GROUP_SIZE, "columns that share one scale and offset in int4 weights"
    )
    runner: str = setting(
        "auto",
        "generate text, or pool hidden states into embeddings (auto: what the checkpoint is)",
        RUNNERS,
    )
    seed: int = setting(0, "seed of the random generator that requests without their own seed sample from")
    speculative_config: dict | None = setting(
        None,
        'speculative decoding, with vLLM\'s keys, e.g. {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}: n-gram drafts from the request\'s own text, checked '
        "in one step; greedy output is unchanged, sampled output keeps its distribution (default: off)",
    )

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        check(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )
        check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
        )
        check(self.runner in RUNNERS, f"runner must be one of {RUNNERS}, got {self.runner!r}")
        check(
            self.max_model_len is None or self.max_model_len >= 2,
            f"max_model_len must be >= 2, got {self.max_model_len}",
        )
        check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        check(
            self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
        )
        check(
            1 <= self.kvcache_block_size <= 1024,
            f"kvcache_block_size must be in 1..1024, got {self.kvcache_block_size}",
        )
        check(
            self.state_snapshot_tokens >= 1 and self.state_snapshot_tokens % self.kvcache_block_size == 0,
            f"state_snapshot_tokens must be a positive multiple of kvcache_block_size ({self.kvcache_block_size}), "
            f"got {self.state_snapshot_tokens}",
        )
        check(
            self.num_kvcache_blocks is None or self.num_kvcache_blocks >= 1,
            f"num_kvcache_blocks must be >= 1, got {self.num_kvcache_blocks}",
        )
        check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes must be > 0")
        check(
            0 < self.gpu_memory_utilization <= 1,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        check(
            self.async_scheduling is None or isinstance(self.async_scheduling, bool),
            f"async_scheduling must be True, False or None (auto), got {self.async_scheduling!r}",
        )
        check(
            isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
            f"tensor_parallel_size must be a whole number >= 1 (the number of GPUs to split the model across), "
            f"got {self.tensor_parallel_size!r}",
        )
        check(
            self.quantization is None or self.quantization in METHODS,
            f"quantization must be one of {METHODS} or None, got {self.quantization!r}",
        )
        check(
            isinstance(self.quantization_group_size, int) and self.quantization_group_size >= 1,
            f"quantization_group_size must be a whole number >= 1, got {self.quantization_group_size!r}",
        )
        check(
            self.quantization is None or self.tensor_parallel_size == 1,
            "quantization does not work with tensor_parallel_size > 1 yet; use one of them",
        )
        check(
            self.kv_cache_dtype not in ("fp8", "int4") or self.tensor_parallel_size == 1,
            f"kv_cache_dtype={self.kv_cache_dtype!r} does not work with tensor_parallel_size > 1 yet (its keys are "
            "centred on a mean measured at load, on one process); use kv_cache_dtype='int8'",
        )
        check(
            not (self.async_scheduling and self.tensor_parallel_size > 1),
            "async_scheduling does not work with tensor_parallel_size > 1; turn one of them off",
        )

        self.speculative = None if self.speculative_config is None else SpeculativeConfig.parse(self.speculative_config)
        check(
            self.speculative is None or (self.tensor_parallel_size == 1 and not self.async_scheduling),
            "speculative_config does not work with tensor_parallel_size > 1 or async_scheduling yet; turn those off",
        )

    @property
    def max_draft_tokens(self) -> int:
        """The most drafted tokens a request checks in one step (0 without speculative decoding)."""
        return 0 if self.speculative is None else self.speculative.num_speculative_tokens

    @classmethod
    def from_kwargs(cls, model: str, **settings) -> "EngineConfig":
        known = {f.name for f in fields(cls)} - {"model"}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise TypeError(f"unknown engine setting(s) {unknown}; known settings are {sorted(known)}")
        return cls(model=model, **settings)


def batched_token_budget(config: EngineConfig, device_type: str) -> int:
    """The most tokens one step computes: `max_num_batched_tokens`, or a default for the device."""
    return config.max_num_batched_tokens or (2048 if device_type == "cpu" else 16384)
