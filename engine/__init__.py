"""Pagoda's inference engine: paged KV cache, prefix caching, continuous batching.

The public names load on first use (PEP 562), so `engine.config` imports with the standard library
alone: the launcher checks its command line with it before PyTorch is installed."""

import importlib
import os
from typing import TYPE_CHECKING

# MKL (PyTorch's BLAS on x86 CPUs) otherwise picks its code paths by each buffer's memory alignment, and SDPA's
# CPU kernel multiplies in per-thread buffers: with two threads a decode row's attention then changed in its last
# bits with the rows beside it, and a greedy reply changed when speculative decoding checked drafts in one step.
# AUTO keeps the CPU's fastest paths, chosen the same for every buffer. MKL reads it once, at its first call, so it
# is set before anything of ours multiplies; a process that already ran MKL keeps what it had.
os.environ.setdefault("MKL_CBWR", "AUTO")

_HOMES = {
    "EngineFailed": "engine.front.engine_thread",
    "EngineThread": "engine.front.engine_thread",
    "RequestFailed": "engine.front.engine_thread",
    "ConstraintFailed": "engine.front.engine_thread",
    "RequestStream": "engine.front.engine_thread",
    "LLM": "engine.front.llm_engine",
    "LLMEngine": "engine.front.llm_engine",
    "EmbeddingOutput": "engine.front.outputs",
    "EngineStats": "engine.front.outputs",
    "KVBlock": "engine.front.outputs",
    "RequestOutput": "engine.front.outputs",
    "SamplingParams": "engine.front.sampling_params",
    "StructuredOutputsParams": "engine.front.sampling_params",
}
__all__ = [
    "LLM",
    "LLMEngine",
    "EngineFailed",
    "EngineThread",
    "EmbeddingOutput",
    "EngineStats",
    "KVBlock",
    "RequestFailed",
    "ConstraintFailed",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "StructuredOutputsParams",
]

if TYPE_CHECKING:
    from engine.front.engine_thread import ConstraintFailed, EngineFailed, EngineThread, RequestFailed, RequestStream
    from engine.front.llm_engine import LLM, LLMEngine
    from engine.front.outputs import EmbeddingOutput, EngineStats, KVBlock, RequestOutput
    from engine.front.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
