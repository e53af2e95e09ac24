"""Model registry, keyed by the `architectures` entry of a HF config."""

from torch import nn

from engine.models.llama import LlamaForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def model_class(hf_config) -> type[nn.Module]:
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(
        f"unsupported model architecture {architectures or '(none given in config.json)'}; "
        f"supported: {', '.join(MODEL_REGISTRY)} (Llama, SmolLM2, TinyLlama, Qwen2/2.5, Qwen3 dense)"
    )
