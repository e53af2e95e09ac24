"""Phi-3 and Phi-4-mini: the Llama network with q/k/v and gate/up stored fused in the checkpoint, rotary over a share
of each head (partial_rotary_factor) and LongRoPE scaling (engine/layers/rotary_embedding.py)."""

from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    pass
