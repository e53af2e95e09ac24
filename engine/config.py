"""Engine settings: one dataclass, validated with errors that say what to change."""
from dataclasses import dataclass, fields

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash-attn")


@dataclass
class EngineConfig:
    model: str
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None  # default: the model's context, capped by the KV cache
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: 2048 on CPU, 16384 on GPU
    kvcache_block_size: int = 16
    num_kvcache_blocks: int | None = None  # default: sized from memory (see kv_cache_memory_bytes)
    kv_cache_memory_bytes: int | None = None  # CPU: explicit budget, default 1 GiB
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    tensor_parallel_size: int = 1  # split the model across this many GPUs (on CPU: processes, for tests)
    attention_backend: str = "auto"
    # Plan and launch each step while the device still runs the one before. Default: on CUDA with
    # one GPU and a kernel backend (on a CPU, or with the torch backend, which reads lengths on the
    # host every layer, nothing overlaps, so it would only add a step of lag).
    async_scheduling: bool | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        check(self.attention_backend in ATTENTION_BACKENDS, f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        check(self.max_model_len is None or self.max_model_len >= 2, f"max_model_len must be >= 2, got {self.max_model_len}")
        check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        check(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
              f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        check(1 <= self.kvcache_block_size <= 1024, f"kvcache_block_size must be in 1..1024, got {self.kvcache_block_size}")
        check(self.num_kvcache_blocks is None or self.num_kvcache_blocks >= 1, f"num_kvcache_blocks must be >= 1, got {self.num_kvcache_blocks}")
        check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes must be > 0")
        check(0 < self.gpu_memory_utilization <= 1, f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        check(self.async_scheduling is None or isinstance(self.async_scheduling, bool), f"async_scheduling must be True, False or None (auto), got {self.async_scheduling!r}")
        check(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
              f"tensor_parallel_size must be a whole number >= 1 (the number of GPUs to split the model across), "
              f"got {self.tensor_parallel_size!r}")
        check(not (self.async_scheduling and self.tensor_parallel_size > 1),
              "async_scheduling does not work with tensor_parallel_size > 1; turn one of them off")

    @classmethod
    def from_kwargs(cls, model: str, **settings) -> "EngineConfig":
        known = {f.name for f in fields(cls)} - {"model"}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise TypeError(f"unknown engine setting(s) {unknown}; known settings are {sorted(known)}")
        return cls(model=model, **settings)
