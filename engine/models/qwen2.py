"""Qwen2 / Qwen2.5: Llama with biases on q, k and v (and none on o)."""

from engine.models.llama import LlamaForCausalLM, ModelFlags


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def flags(config) -> ModelFlags:
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen2 checkpoints with use_sliding_window=true are not supported")
        return ModelFlags(qkv_bias=True, o_bias=False, qk_norm=False, mlp_bias=False)
