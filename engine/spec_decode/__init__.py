"""Speculative decoding: proposers guess a request's next tokens cheaply, and one step of the real model checks
them all (engine/sample/rejection.py), keeping the longest prefix it agrees with.

`SpeculativeConfig` (config.py) is what `LLM(..., speculative_config={...})` takes; `Speculator` (speculator.py)
asks the configured proposer for drafts between steps and adapts how many it asks for to what gets accepted."""

from engine.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
