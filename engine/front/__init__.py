"""The engine's front: what callers hold. `LLM`/`LLMEngine` (the step loop, offline generate), `EngineThread`
(the thread-safe online front), `SamplingParams` in and `RequestOutput`/`EngineStats` out, the detokenizer; and
the engine's helpers: what a model string opens (model_files), what each sampled token makes (output_processor)."""
