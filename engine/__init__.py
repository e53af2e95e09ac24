"""Pagoda's inference engine: paged KV cache, prefix caching, continuous batching."""
from engine.engine_thread import EngineFailed, EngineThread, RequestStream
from engine.llm_engine import LLM, LLMEngine
from engine.outputs import EngineStats, KVBlock, RequestOutput
from engine.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "EngineFailed", "EngineThread", "EngineStats", "KVBlock", "RequestOutput",
           "RequestStream", "SamplingParams", "StructuredOutputsParams"]
