"""Tensor parallelism: the group of ranks one engine runs on, and the checks made before it starts.

Each engine builds its own process group straight from its own store, instead of
torch.distributed's one global default group, so two engines in one process never share or
collide. The store listens on a port the OS picks (port 0); no fixed port or name anywhere.
"""

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# How long a collective may wait for a slow rank. A dead rank is noticed at once, not after this.
TIMEOUT = datetime.timedelta(minutes=30)
LOOPBACK = "127.0.0.1"  # every rank lives on this machine


@dataclass(frozen=True)
class TPGroup:
    """This process's place among the ranks of one engine. The default is the only rank."""

    rank: int = 0
    size: int = 1
    backend: object | None = None  # ProcessGroupGloo or ProcessGroupNCCL; None for a single rank
    device: torch.device = torch.device("cpu")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        self.backend.allreduce([x]).wait()
        return x

    def min(self, value: int) -> int:
        """The smallest `value` any rank holds."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.backend.allreduce([t], opts).wait()
        return int(t.item())

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `x`, in rank order, on rank 0; None on the other ranks."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        out = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == 0 else []
        self.backend.gather(out, [x.contiguous()], opts).wait()
        return out[0] if self.rank == 0 else None


SINGLE = TPGroup()


def new_store(size: int, port: int = 0) -> dist.TCPStore:
    """Rank 0 (port 0: the OS picks a free one, read it back from `.port`) or a worker joining it."""
    return dist.TCPStore(LOOPBACK, port, size, port == 0, timeout=datetime.timedelta(minutes=5), wait_for_workers=False)


def connect(rank: int, size: int, store: dist.Store, device: torch.device) -> TPGroup:
    """Join the group: NCCL between GPUs, gloo over loopback TCP on CPU. Blocks until all ranks join."""
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = TIMEOUT
        backend = dist.ProcessGroupNCCL(store, rank, size, opts)
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
        opts._timeout = TIMEOUT
        backend = dist.ProcessGroupGloo(store, rank, size, opts)
    return TPGroup(rank, size, backend, device)


def sizes_that_fit(hf_config, limit: int) -> list[int]:
    """Tensor-parallel sizes up to `limit` that split this model's heads and MLP evenly."""
    heads, kv_heads, inter = _dims(hf_config)
    return [
        n for n in range(1, limit + 1) if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0) and inter % n == 0
    ]


def _dims(hf_config) -> tuple[int, int, int]:
    heads = hf_config.num_attention_heads
    return heads, getattr(hf_config, "num_key_value_heads", None) or heads, hf_config.intermediate_size


def check_tensor_parallel(size: int, hf_config, device: torch.device) -> None:
    """Refuse a tensor_parallel_size this model or machine cannot run, before anything starts."""
    if size == 1:
        return
    if device.type == "cuda" and size > torch.cuda.device_count():
        gpus = torch.cuda.device_count()
        raise ValueError(
            f"tensor_parallel_size={size} needs {size} GPUs, but torch sees {gpus}; "
            f"use tensor_parallel_size={gpus} or less"
        )
    heads, kv_heads, inter = _dims(hf_config)
    problems = []
    if heads % size:
        problems.append(f"num_attention_heads={heads} is not divisible by {size}")
    # Fewer KV heads than ranks also works: each KV head is then copied to several ranks.
    if kv_heads % size and size % kv_heads:
        problems.append(f"num_key_value_heads={kv_heads} is neither divisible by {size} nor a divisor of it")
    if inter % size:
        problems.append(f"intermediate_size={inter} is not divisible by {size}")
    if problems:
        limit = torch.cuda.device_count() if device.type == "cuda" else heads
        raise ValueError(
            f"tensor_parallel_size={size} cannot split this model: {'; '.join(problems)}. "
            "Use a tensor_parallel_size that divides the heads, one of "
            f"{sizes_that_fit(hf_config, limit)}"
        )
