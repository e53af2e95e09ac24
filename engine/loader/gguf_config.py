"""The transformers config a GGUF file's metadata describes, family by family, as llama.cpp reads it: the shared
keys, a mixture of experts' counts, Gemma 3's and gpt-oss's layer patterns, Phi-3's LongRoPE, and the rope scalings
(linear, YaRN, Llama 3's per-frequency factors) that transformers does not read from a GGUF."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.models import GGUF_ARCHITECTURES

if TYPE_CHECKING:
    from engine.loader.gguf import GGUFCheckpoint

# The transformers config class of an HF architecture, where it is not the architecture's name with "Config"
_CONFIG_CLASSES = {
    "Gemma3ForCausalLM": "Gemma3TextConfig",
    "Gemma4ForCausalLM": "Gemma4TextConfig",
    "Qwen3_5ForCausalLM": "Qwen3_5TextConfig",
    "Qwen3_5MoeForCausalLM": "Qwen3_5MoeTextConfig",
}
_HYBRID = ("qwen35", "qwen35moe", "qwen3next")  # Qwen3.5's and Qwen3-Next's linear-attention families
_NO_DENSE_MLP = ("qwen35moe", "qwen3next")  # experts in every layer: feed_forward_length may be absent
# llama.cpp's Gemma 3: every sixth layer global, local layers at rope base 10000; Gemma 3 27B (62 layers) scales
# queries by hidden / heads, the others by the head size (llama.cpp's f_attention_scale)
_GEMMA3_GLOBAL_EVERY, _GEMMA3_LOCAL_ROPE_BASE, _GEMMA3_27B_LAYERS = 6, 10000.0, 62


def hf_config(ckpt: GGUFCheckpoint) -> Any:
    """The transformers config of `ckpt`'s model, from the metadata it holds."""
    import transformers

    arch = ckpt.architecture
    names = {
        "hidden_size": "embedding_length",
        "intermediate_size": "feed_forward_length",
        "num_hidden_layers": "block_count",
        "num_attention_heads": "attention.head_count",
        "max_position_embeddings": "context_length",
        "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    }
    if arch in _NO_DENSE_MLP:
        del names["intermediate_size"]
    settings = {ours: ckpt.field(f"{arch}.{theirs}") for ours, theirs in names.items()}
    # files of models without grouped-query attention may leave the KV head count out
    settings["num_key_value_heads"] = ckpt.metadata(f"{arch}.attention.head_count_kv", settings["num_attention_heads"])
    per_layer = {k: v for k, v in settings.items() if isinstance(v, list)}  # Gemma 4's: a value per layer
    settings = {
        k: (float(v) if k == "rms_norm_eps" else int(v[0] if k in per_layer else v)) for k, v in settings.items()
    }
    # A multi-token-prediction head (Qwen3.5's, as convert_hf_to_gguf keeps it): blocks after the model's own
    nextn = int(ckpt.metadata(f"{arch}.nextn_predict_layers", 0) or 0)
    settings["num_hidden_layers"] -= nextn
    settings["mtp_num_hidden_layers"] = nextn
    vocab = ckpt.metadata(f"{arch}.vocab_size")
    settings["vocab_size"] = int(vocab) if vocab is not None else len(ckpt.field("tokenizer.ggml.tokens"))
    if ckpt.metadata(f"{arch}.expert_count") is not None:  # a mixture of experts (qwen3moe)
        settings["num_experts"] = int(ckpt.field(f"{arch}.expert_count"))
        settings["num_experts_per_tok"] = int(ckpt.field(f"{arch}.expert_used_count"))
        settings["moe_intermediate_size"] = int(ckpt.field(f"{arch}.expert_feed_forward_length"))
        settings["norm_topk_prob"] = True  # llama.cpp renormalises qwen3moe's top-k weights
    hf_arch = GGUF_ARCHITECTURES[arch]
    if arch == "gemma3":
        settings.update(_gemma3_settings(ckpt, settings))
    if arch == "gpt-oss":
        settings = _gpt_oss_settings(ckpt, settings)
    if arch == "gemma4":
        settings = _gemma4_settings(ckpt, settings, per_layer)
    if arch in _HYBRID:
        settings = _qwen35_settings(ckpt, settings)
    config = getattr(transformers, _CONFIG_CLASSES.get(hf_arch, hf_arch.replace("ForCausalLM", "Config")))(**settings)
    config.architectures = [GGUF_ARCHITECTURES[arch]]
    # transformers maps no head size for qwen2/qwen3 (Qwen3Config would fall back to its default of 128)
    head_dim = ckpt.metadata(f"{arch}.attention.key_length")
    if head_dim is not None and arch != "gemma4":  # Gemma 4's is its global layers'
        config.head_dim = int(head_dim)
    if arch in ("qwen35", "qwen35moe"):  # convert_hf_to_gguf orders their value heads tiled across key heads;
        config.linear_v_heads_tiled = True  # Qwen3-Next's stay grouped by key head, as its checkpoints have them
    config.tie_word_embeddings = not ckpt.has_tensor("output.weight")
    for attr in ("bos_token_id", "eos_token_id"):
        value = ckpt.metadata(f"tokenizer.ggml.{attr}")
        if value is not None:
            setattr(config, attr, int(value))
    theta = float(ckpt.metadata(f"{arch}.rope.freq_base", 10000.0))
    if (
        arch == "gemma4" or arch in _HYBRID
    ):  # set with the layers' settings: Gemma 4's rope_freqs are no Llama 3 scaling
        return config
    rope = _rope_parameters(ckpt, theta) or {"rope_type": "default", "rope_theta": theta}
    if arch == "phi3":
        rope = _phi3_rope(ckpt, theta, config)
    if arch == "gemma3":  # the global layers' rotary, and the local layers' own
        rope = {
            "full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_BASE},
        }
    if hasattr(config, "rope_parameters"):
        config.rope_parameters = rope
    else:  # transformers 4
        config.rope_theta = rope["rope_theta"]
        config.rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return config


def _phi3_rope(ckpt: GGUFCheckpoint, theta: float, config) -> dict:
    """Phi-3's rotary as llama.cpp keeps it: over `rope.dimension_count` of each head, with LongRoPE's factors
    as tensors (rope_factors_short, rope_factors_long) and the pretraining length in the metadata."""
    head_dim = config.hidden_size // config.num_attention_heads
    rotary = int(ckpt.metadata("phi3.rope.dimension_count", head_dim))
    rope = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": rotary / head_dim}
    short, long = (ckpt.config_tensor(f"rope_factors_{k}.weight") for k in ("short", "long"))
    if short is None:
        return rope
    original = int(ckpt.field("phi3.rope.scaling.original_context_length"))
    config.original_max_position_embeddings = original
    attention_factor = ckpt.metadata("phi3.rope.scaling.attn_factor")
    return {
        **rope,
        "rope_type": "longrope",
        "short_factor": short.tolist(),
        "long_factor": (long if long is not None else short).tolist(),
        "original_max_position_embeddings": original,
        "factor": config.max_position_embeddings / original,
        **({"attention_factor": float(attention_factor)} if attention_factor is not None else {}),
    }


def _gemma3_settings(ckpt: GGUFCheckpoint, settings: dict) -> dict:
    """What a Gemma 3 file implies beyond the shared metadata, as llama.cpp reads it."""
    layers, head_dim = settings["num_hidden_layers"], int(ckpt.field("gemma3.attention.key_length"))
    scalar = settings["hidden_size"] // settings["num_attention_heads"] if layers == _GEMMA3_27B_LAYERS else head_dim
    return {
        "head_dim": head_dim,
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(ckpt.field("gemma3.attention.sliding_window")),
        "layer_types": [
            "full_attention" if (i + 1) % _GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention" for i in range(layers)
        ],
    }


def _gpt_oss_settings(ckpt: GGUFCheckpoint, settings: dict) -> dict:
    """gpt-oss's names for the experts' settings, and what llama.cpp fixes for it: layers alternating a window
    (the even ones) and full attention, biased attention."""
    settings = {**settings, "intermediate_size": settings.pop("moe_intermediate_size")}
    settings["num_local_experts"] = settings.pop("num_experts")
    del settings["norm_topk_prob"]  # gpt-oss always takes the softmax of its top-k logits
    layers = settings["num_hidden_layers"]
    return {
        **settings,
        "head_dim": int(ckpt.field("gpt-oss.attention.key_length")),
        "sliding_window": int(ckpt.field("gpt-oss.attention.sliding_window")),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "attention_bias": True,
    }


def _gemma4_settings(ckpt: GGUFCheckpoint, settings: dict, per_layer: dict[str, list]) -> dict:
    """Gemma 4's layers as convert_hf_to_gguf writes them: which slide (a flag per layer), the sliding layers' head
    size (`key_length_swa`) beside the global ones' (`key_length`), KV heads and MLP widths per layer, the layers
    that read an earlier layer's cache, per-layer inputs, experts beside the MLP, and the global layers' rotary:
    proportional, its share the `rope_freqs` entries that are 1 (the rest, 1e30, turn not at all)."""
    arch, layers = "gemma4", settings["num_hidden_layers"]
    sliding = [bool(flag) for flag in ckpt.field(f"{arch}.attention.sliding_window_pattern")]
    types = ["sliding_attention" if flag else "full_attention" for flag in sliding]
    kv_heads = per_layer.get("num_key_value_heads") or [settings["num_key_value_heads"]] * layers
    widths = per_layer.get("intermediate_size") or [settings["intermediate_size"]] * layers
    shared = int(ckpt.metadata(f"{arch}.attention.shared_kv_layers", 0))
    full = types.index("full_attention")
    global_head_dim = int(ckpt.field(f"{arch}.attention.key_length"))
    factors = ckpt.config_tensor("rope_freqs.weight")
    turning = int((factors == 1.0).sum()) if factors is not None else global_head_dim // 2
    out = {
        **{k: v for k, v in settings.items() if k not in ("num_experts_per_tok", "norm_topk_prob")},
        "layer_types": types,
        "sliding_window": int(ckpt.field(f"{arch}.attention.sliding_window")),
        "head_dim": int(ckpt.field(f"{arch}.attention.key_length_swa")),
        "global_head_dim": global_head_dim,
        "num_key_value_heads": kv_heads[types.index("sliding_attention")],
        "num_kv_shared_layers": shared,
        "use_double_wide_mlp": shared > 0 and widths[-1] == 2 * widths[0],
        "hidden_size_per_layer_input": int(ckpt.metadata(f"{arch}.embedding_length_per_layer_input", 0)),
        "vocab_size_per_layer_input": settings["vocab_size"],
        "final_logit_softcapping": ckpt.metadata(f"{arch}.final_logit_softcapping"),
        # keys that serve as values too: the global layers have no attn_v
        "attention_k_eq_v": not ckpt.has_tensor(f"blk.{full}.attn_v.weight"),
        "num_global_key_value_heads": kv_heads[full],
        "rope_parameters": {
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(ckpt.field(f"{arch}.rope.freq_base_swa")),
            },
            "full_attention": {
                "rope_type": "proportional",
                "rope_theta": float(ckpt.field(f"{arch}.rope.freq_base")),
                "partial_rotary_factor": 2 * turning / global_head_dim,
            },
        },
    }
    if "num_experts" in settings:
        out.update(enable_moe_block=True, top_k_experts=settings["num_experts_per_tok"])
    return out


def _qwen35_settings(ckpt: GGUFCheckpoint, settings: dict) -> dict:
    """Qwen3.5's hybrid layers as convert_hf_to_gguf writes them: which are recurrent (a flag per layer, or every
    full_attention_interval-th is full attention), the Gated DeltaNet's sizes under llama.cpp's ssm names, and rotary
    over `rope.dimension_count` of each head (its multimodal sections all alike for text)."""
    arch, layers = ckpt.architecture, settings["num_hidden_layers"]
    recurrent = ckpt.metadata(f"{arch}.attention.recurrent_layers")
    if recurrent is not None:
        recurrent = list(recurrent)[:layers]  # with an MTP head, its block's flag comes last
    else:
        every = int(ckpt.metadata(f"{arch}.full_attention_interval", 4))
        recurrent = [(i + 1) % every != 0 for i in range(layers)]
    head_dim, value_heads = (
        int(ckpt.field(f"{arch}.attention.key_length")),
        int(ckpt.field(f"{arch}.ssm.time_step_rank")),
    )
    if "num_experts" in settings:  # Qwen3.5-MoE: a shared expert beside them; top-k always renormalised
        if arch != "qwen3next":  # Qwen3-Next's config names the renormalisation, Qwen3.5's always does it
            del settings["norm_topk_prob"]
        settings["shared_expert_intermediate_size"] = int(ckpt.field(f"{arch}.expert_shared_feed_forward_length"))
    if arch == "qwen3next":  # llama.cpp's qwen3next has experts in every layer (its loader refuses a file without)
        settings.update(decoder_sparse_step=1, mlp_only_layers=[])
        dense = ckpt.metadata(f"{arch}.feed_forward_length")
        if dense is not None:
            settings["intermediate_size"] = int(dense)
    return {
        **settings,
        "layer_types": ["linear_attention" if flag else "full_attention" for flag in recurrent],
        "head_dim": head_dim,
        "linear_conv_kernel_dim": int(ckpt.field(f"{arch}.ssm.conv_kernel")),
        "linear_key_head_dim": int(ckpt.field(f"{arch}.ssm.state_size")),
        "linear_num_key_heads": int(ckpt.field(f"{arch}.ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(ckpt.field(f"{arch}.ssm.inner_size")) // value_heads,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(ckpt.metadata(f"{arch}.rope.freq_base", 10000.0)),
            "partial_rotary_factor": int(ckpt.field(f"{arch}.rope.dimension_count")) / head_dim,
        },
    }


def _rope_parameters(ckpt: GGUFCheckpoint, theta: float) -> dict | None:
    """Rope scaling transformers does not read from a GGUF: `rope.scaling.*` metadata, and the
    `rope_freqs` tensor llama.cpp writes for Llama 3.1+ in place of its rope_scaling settings."""
    arch = ckpt.architecture
    kind = ckpt.metadata(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        factor = ckpt.metadata(f"{arch}.rope.scaling.factor")
        if kind not in ("linear", "yarn") or factor is None:
            raise ValueError(
                f"{ckpt.path.name} uses rope scaling {kind!r}; Pagoda supports linear, YaRN and Llama 3 "
                "scaling. Use another file of this model."
            )
        if kind == "yarn":
            return _yarn(ckpt, theta, float(factor))
        return {"rope_type": "linear", "factor": float(factor), "rope_theta": theta}
    if ckpt.config_tensor("rope_freqs.weight") is None:
        return None
    return _llama3_rope(ckpt.config_tensor("rope_freqs.weight"), theta, ckpt.path.name)


def _yarn(ckpt: GGUFCheckpoint, theta: float, factor: float) -> dict:
    """YaRN's settings as convert_hf_to_gguf writes them. The file does not say whether the correction range
    is truncated to whole dimensions: gpt-oss was trained without (its config's `truncate: false`), the
    other families with (transformers' default)."""
    arch = ckpt.architecture
    rope = {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": factor,
        "original_max_position_embeddings": int(ckpt.field(f"{arch}.rope.scaling.original_context_length")),
        "truncate": arch != "gpt-oss",
    }
    for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
        value = ckpt.metadata(f"{arch}.rope.scaling.{theirs}")
        if value is not None:
            rope[ours] = float(value)
    attention_factor = ckpt.metadata(f"{arch}.rope.scaling.yarn_attn_factor")
    if attention_factor is not None:
        rope["attention_factor"] = float(attention_factor)
    return rope


def _llama3_rope(factors: np.ndarray, theta: float, file_name: str) -> dict:
    """llama.cpp stores Llama 3 rope scaling only as per-frequency divisors (convert_hf_to_gguf's rope_freqs).
    Every Llama 3.x uses low_freq_factor 1, high_freq_factor 4 and an 8192-token original context, with
    the factor the largest divisor: rebuild those settings and check they give back every divisor."""
    params = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": theta,
    }
    dim = 2 * len(factors)
    wavelen = 2 * math.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    old, low, high, factor = 8192, 1.0, 4.0, params["factor"]
    smooth = (old / wavelen - low) / (high - low)
    expected = np.where(
        wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth))
    )
    if not np.allclose(factors, expected, rtol=1e-4, atol=0):
        raise ValueError(
            f"{file_name} scales rope by per-frequency factors (rope_freqs) that are not Llama 3's "
            "scaling; Pagoda cannot reproduce them. Use the model's safetensors repo instead."
        )
    return params
