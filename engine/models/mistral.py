"""Mistral and Ministral: the Llama network, with a sliding window on the layers the config says (Mistral: every
layer when `sliding_window` is set; Ministral: its `layer_types`). The windows are read by llama.layer_windows."""

from engine.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass


class MinistralForCausalLM(LlamaForCausalLM):
    pass
