"""Qwen3 (dense): Llama with RMSNorm on each head of q and k before rotary, and an explicit head_dim."""

from engine.models.llama import LlamaForCausalLM, ModelFlags


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def flags(config) -> ModelFlags:
        bias = bool(getattr(config, "attention_bias", False))
        return ModelFlags(qkv_bias=bias, o_bias=bias, qk_norm=True, mlp_bias=False)
