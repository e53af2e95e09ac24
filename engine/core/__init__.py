"""The engine's core, with no tensors: per-request state (`Sequence`), the paged KV blocks and prefix cache
(`BlockManager`), and continuous batching with chunked prefill and preemption (`Scheduler`)."""
