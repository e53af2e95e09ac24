"""What a config.json says about the memory a model takes, read as the engine reads it: through transformers' config
class for its model_type, and the engine's own rules for which layers slide and which hold a KV cache. For the
families whose layers differ from one another (Gemma 4: global layers with other head sizes, layers that share an
earlier layer's cache, per-layer embeddings) the parameters are counted on transformers' model itself, built on
the meta device (no memory, no weights).

Imported by app/catalog.py on first use: it imports transformers (and so torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KVShape:
    """The KV cache one token takes, layer by layer, as the engine lays it out (engine/runner/kv_cache.py)."""

    sliding_window: int | None = None  # tokens a sliding layer sees (None: no such layers)
    num_sliding_layers: int = 0  # of the layers holding a cache, those that slide
    num_kv_layers: int = 0  # layers holding a cache of their own (0: every layer)
    kv_width: int = 0  # keys (or values) of one token in one layer: the widest layer's heads x head size (0: unknown)
    state_bytes: int = (
        0  # a hybrid model's recurrent state per chat, whatever its length (engine/layers/gated_deltanet)
    )


def text_config(config: dict[str, Any]):
    """transformers' config object for a config.json's language model; None where transformers cannot read it."""
    import transformers

    try:
        fields = {key: value for key, value in config.items() if key != "model_type"}
        known = transformers.AutoConfig.for_model(config["model_type"], **fields)
    except Exception:  # an unknown model_type or a config transformers refuses
        return None
    return getattr(known, "text_config", None) or known


def kv_shape(config: dict[str, Any]) -> KVShape:
    """The KV layout of a config.json. KVShape() for a config it cannot read: the estimate then counts every layer
    as full attention of num_key_value_heads x head_dim, the safe side for the families whose layers are alike."""
    from engine.models.gemma4 import kv_sources
    from engine.models.llama import layer_windows

    text = text_config(config)
    if text is None:
        return KVShape()
    types = list(getattr(text, "layer_types", None) or [])
    if "linear_attention" in types:  # Qwen3.5: its linear layers keep a fixed-size state, not a KV history
        return KVShape(num_kv_layers=types.count("full_attention"), state_bytes=_state_bytes(text))
    try:
        windows = layer_windows(text)
        owners = [i for i, source in enumerate(kv_sources(text)) if source is None]
    except (ValueError, AttributeError, TypeError):
        return KVShape()
    per_layer = getattr(text, "per_layer_config", None)
    width = 0
    if per_layer is not None:  # Gemma 4: each layer's heads and head size
        width = max(per_layer[i].num_key_value_heads * per_layer[i].head_dim for i in owners)
    sliding = [windows[i] for i in owners if windows[i] is not None]
    kv_layers = len(owners) if len(owners) < len(windows) else 0
    return KVShape(max(sliding) if sliding else None, len(sliding), kv_layers, width)


def _state_bytes(text) -> int:
    """One chat's Gated DeltaNet state, as the engine keeps it: each linear layer's recurrent state in float32 and
    its convolution's last inputs in bfloat16."""
    keys, values = text.linear_num_key_heads * text.linear_key_head_dim, text.linear_num_value_heads
    recurrent = values * text.linear_key_head_dim * text.linear_value_head_dim * 4
    conv = (2 * keys + values * text.linear_value_head_dim) * (text.linear_conv_kernel_dim - 1) * 2
    return text.layer_types.count("linear_attention") * (recurrent + conv)


def counted_params(config: dict[str, Any]) -> int | None:
    """The language model's parameters (a tied head once), counted on transformers' model built on the meta device;
    None where transformers cannot build it."""
    import torch
    import transformers

    text = text_config(config)
    if text is None:
        return None
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(text)
    except Exception:  # a model class transformers lacks, or a config it refuses
        return None
    return sum(p.numel() for p in model.parameters())
