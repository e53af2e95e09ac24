"""SmolLM3: the Llama network with rotary left out of every fourth layer (NoPE; `no_rope_layers` says which layers
keep it). llama.DecoderModel reads that list, so the family needs no code of its own beyond its name."""

from engine.models.llama import LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    pass
