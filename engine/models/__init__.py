"""Model registry: a class per `architectures` entry of a HF config, and the HF architecture of each GGUF
`general.architecture` Pagoda reads. A family that is a different network gets a file of its own here."""

from torch import nn

from engine.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from engine.models.gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.mistral import MinistralForCausalLM, MistralForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_5 import (
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3NextForCausalLM,
)
from engine.models.qwen3_moe import Qwen3MoeForCausalLM
from engine.models.smollm3 import SmolLM3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration,
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MinistralForCausalLM": MinistralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
}

# GGUF's `general.architecture` -> the HF architecture whose config and weight names the file maps to
GGUF_ARCHITECTURES = {
    "gemma3": "Gemma3ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "llama": "LlamaForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen35": "Qwen3_5ForCausalLM",
    "qwen35moe": "Qwen3_5MoeForCausalLM",
    "qwen3next": "Qwen3NextForCausalLM",
}

# Checkpoints with a vision part whose language model the engine serves alone: their config nests its text_config
TEXT_OF_MULTIMODAL = (
    "Gemma3ForConditionalGeneration",
    "Gemma4ForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)


def language_config(hf_config):
    """The config the engine builds the model from: a multimodal checkpoint's text_config (keeping the checkpoint's
    architecture, which names the class that reads its weights), else `hf_config` itself."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not any(a in TEXT_OF_MULTIMODAL for a in architectures) or not hasattr(hf_config, "text_config"):
        return hf_config
    text = hf_config.get_text_config()
    text.architectures = architectures
    return text


def model_class(hf_config) -> type[nn.Module]:
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for name in architectures:
        # A bare decoder (`Qwen3Model`: an embedding model's checkpoint) is its family's network without the head
        name = name[: -len("Model")] + "ForCausalLM" if name.endswith("Model") else name
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(
        f"unsupported model architecture {architectures or '(none given in config.json)'}; "
        f"supported: {', '.join(MODEL_REGISTRY)} (Gemma 3 and Gemma 4 text, gpt-oss, Llama, SmolLM2, SmolLM3, "
        "TinyLlama, Mistral, Ministral, Phi-3, Phi-4-mini, Qwen2/2.5, Qwen3 dense, Qwen3-MoE, Qwen3.5 dense and MoE, "
        "Qwen3-Next)"
    )
