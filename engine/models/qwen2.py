"""Qwen2 / Qwen2.5: Llama with biases on q, k and v (and none on o). With use_sliding_window, the layers past
max_window_layers attend through a window (transformers' layer_types say which; llama.layer_windows reads them)."""

from engine.models.llama import LlamaForCausalLM, ModelFlags


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def flags(config) -> ModelFlags:
        return ModelFlags(qkv_bias=True, o_bias=False, qk_norm=False, mlp_bias=False)
