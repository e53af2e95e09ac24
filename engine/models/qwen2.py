"""Qwen2 / Qwen2.5: Llama with biases on q, k and v (and none on o)."""
from engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def flags(config) -> dict:
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen2 checkpoints with use_sliding_window=true are not supported")
        return dict(qkv_bias=True, o_bias=False, qk_norm=False, mlp_bias=False)
