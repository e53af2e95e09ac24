"""Reading GGUF files as they are: llama.cpp's quantized blocks become `QuantizedWeight`s without loss.

    ckpt = GGUFCheckpoint.open("model.Q4_K_M.gguf")
    ckpt.hf_config()          # LlamaConfig / Qwen2Config / Qwen3Config from the metadata
    ckpt.tokenizer()          # a transformers tokenizer with the file's chat template
    for name, value in ckpt.tensors():   # Hugging Face names; a torch tensor or a QuantizedWeight
        ...

Every block type a Llama/Qwen file uses is codes times a per-group scale plus a per-group offset
(engine/quantization/layout.py), so each tensor is repacked into that layout exactly: its
`dequantize()` equals llama.cpp's dequantization bit for bit. Tensors are read and decoded one at a
time, a few MB of rows per step, so loading needs little beyond the tensor being decoded.

The block types are decoded in gguf_blocks.py; gguf_files.py finds the file a model string names.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.loader.gguf_blocks import SUPPORTED_TYPES, FileBytes, decode
from engine.models import GGUF_ARCHITECTURES
from engine.quantization.blocks import BlockWeight
from engine.quantization.layout import QuantizedWeight

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # a mixture of experts: the router, and each projection's experts stacked in one tensor
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Where a family's llama.cpp names mean another HF module than Llama's
_ARCH_LAYER_NAMES = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # stored fused, as Phi-3 keeps them
    "gemma3": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "gpt-oss": {
        "post_attention_norm": "post_attention_layernorm",
        "attn_sinks": "self_attn.sinks",
        "ffn_gate_inp": "mlp.router",
    },
}
# The transformers config class of an HF architecture, where it is not the architecture's name with "Config"
_CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}
# llama.cpp's Gemma 3: every sixth layer global, local layers at rope base 10000; Gemma 3 27B (62 layers) scales
# queries by hidden / heads, the others by the head size (llama.cpp's f_attention_scale)
_GEMMA3_GLOBAL_EVERY, _GEMMA3_LOCAL_ROPE_BASE, _GEMMA3_27B_LAYERS = 6, 10000.0, 62
# Architectures whose GGUF config transformers cannot read, and whose tokenizer is its generic one
_GENERIC_TOKENIZER = ("gpt-oss",)
# Not weights of the HF model: Llama 3's rope factors, folded into the config's rope parameters instead.
# and Phi-3's LongRoPE factors
_CONFIG_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
# llama.cpp also ends generation on control tokens with these texts, whatever the file names as EOS
# (an instruct model's GGUF often names only one of its end-of-turn tokens).
_END_OF_TURN_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end|>", "<end_of_turn>")
_CONTROL_TOKEN = 3  # llama.cpp's token type for control tokens


@dataclass(frozen=True)
class _Entry:
    gguf_name: str
    hf_name: str
    type_name: str
    heads: int | None  # llama's q/k rows were interleaved per head by llama.cpp: undo with this many heads


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    type_name: str
    shape: tuple[int, ...]  # rows first, as torch has it
    offset: int  # of its bytes in the file
    n_bytes: int


class GGUFCheckpoint:
    """One GGUF file: metadata at hand, tensors read from the file and decoded on demand.

    gguf-py's reader parses the whole header into numpy views, one or two per element of every array: 136 MB for
    SmolLM2's 49k-token vocabulary, three times that for a 150k one. What loading needs of it (the metadata's
    values, the tensors' places, Llama 3's rope factors) is copied out here and the reader let go, so that it is
    not held beside the weights while they load."""

    def __init__(self, path: Path, reader: Any) -> None:
        self.path = path
        self._fields = {key: field.contents() for key, field in reader.fields.items()}
        self._tensors = [
            _TensorInfo(
                t.name,
                t.tensor_type.name,
                tuple(int(d) for d in reversed(t.shape.tolist())),
                int(t.data_offset),
                int(t.n_bytes),
            )
            for t in reader.tensors
        ]
        self._gguf_names = {t.name for t in self._tensors}
        self._config_tensors = {
            t.name: np.array(t.data, dtype=np.float64) for t in reader.tensors if t.name in _CONFIG_TENSORS
        }
        self._rope_freqs = self._config_tensors.get("rope_freqs.weight")
        self.architecture: str = self._field("general.architecture")
        if self.architecture not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"{path.name} is a GGUF of architecture {self.architecture!r}; Pagoda runs "
                f"{', '.join(GGUF_ARCHITECTURES)} GGUF files. Pick a GGUF of a supported model, or the "
                "model's safetensors repo."
            )
        self._plan = self._make_plan()

    @classmethod
    def open(cls, path: str | Path) -> GGUFCheckpoint:
        """Open and check a GGUF file: architecture, every tensor's type and name, and that its data is all there.
        Nothing is decoded yet."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist; check the path")
        try:
            from gguf import GGUFReader
        except ImportError as e:
            raise RuntimeError("reading GGUF files needs the gguf package: pip install gguf") from e
        try:
            reader = GGUFReader(path)
        except Exception as e:  # numpy reshape/index errors on short files, ValueError on bad magic or types
            raise RuntimeError(
                f"cannot read {path} as a GGUF file ({type(e).__name__}: {e}). The file is incomplete "
                "or corrupt: re-download it. (If it is new, `pip install -U gguf` may be needed to "
                "read it.)"
            ) from e
        end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
        size = path.stat().st_size
        if end > size:
            raise RuntimeError(
                f"{path} is incomplete: its tensors need {end} bytes, the file has {size}. Re-download it."
            )
        return cls(path, reader)

    # metadata

    def metadata(self, key: str, default: Any = None) -> Any:
        """One metadata value (`llama.context_length`, `tokenizer.chat_template`, ...), or `default`."""
        value = self._fields.get(key)
        return default if value is None else value

    def _field(self, key: str) -> Any:
        value = self.metadata(key)
        if value is None:
            raise RuntimeError(
                f"{self.path} has no {key!r} in its metadata; it is not a complete model GGUF. "
                "Re-download it or use another file."
            )
        return value

    def hf_config(self) -> Any:
        """The transformers config (LlamaConfig, Qwen2Config or Qwen3Config) the file's metadata describes.

        Built from the metadata this reader holds already: transformers' `from_pretrained(gguf_file=)`
        would parse the whole header again, vocabulary included (5 s for SmolLM2's)."""
        import transformers

        arch = self.architecture
        names = {
            "hidden_size": "embedding_length",
            "intermediate_size": "feed_forward_length",
            "num_hidden_layers": "block_count",
            "num_attention_heads": "attention.head_count",
            "max_position_embeddings": "context_length",
            "rms_norm_eps": "attention.layer_norm_rms_epsilon",
        }
        settings = {ours: self._field(f"{arch}.{theirs}") for ours, theirs in names.items()}
        # files of models without grouped-query attention may leave the KV head count out
        settings["num_key_value_heads"] = self.metadata(
            f"{arch}.attention.head_count_kv", settings["num_attention_heads"]
        )
        settings = {k: (float(v) if k == "rms_norm_eps" else int(v)) for k, v in settings.items()}
        vocab = self.metadata(f"{arch}.vocab_size")
        settings["vocab_size"] = int(vocab) if vocab is not None else len(self._field("tokenizer.ggml.tokens"))
        if self.metadata(f"{arch}.expert_count") is not None:  # a mixture of experts (qwen3moe)
            settings["num_experts"] = int(self._field(f"{arch}.expert_count"))
            settings["num_experts_per_tok"] = int(self._field(f"{arch}.expert_used_count"))
            settings["moe_intermediate_size"] = int(self._field(f"{arch}.expert_feed_forward_length"))
            settings["norm_topk_prob"] = True  # llama.cpp renormalises qwen3moe's top-k weights
        hf_arch = GGUF_ARCHITECTURES[arch]
        if arch == "gemma3":
            settings.update(self._gemma3_settings(settings))
        if arch == "gpt-oss":
            settings = self._gpt_oss_settings(settings)
        config = getattr(transformers, _CONFIG_CLASSES.get(hf_arch, hf_arch.replace("ForCausalLM", "Config")))(
            **settings
        )
        config.architectures = [GGUF_ARCHITECTURES[arch]]
        # transformers maps no head size for qwen2/qwen3 (Qwen3Config would fall back to its default of 128)
        head_dim = self.metadata(f"{arch}.attention.key_length")
        if head_dim is not None:
            config.head_dim = int(head_dim)
        config.tie_word_embeddings = "output.weight" not in self._gguf_names
        for attr in ("bos_token_id", "eos_token_id"):
            value = self.metadata(f"tokenizer.ggml.{attr}")
            if value is not None:
                setattr(config, attr, int(value))
        theta = float(self.metadata(f"{arch}.rope.freq_base", 10000.0))
        rope = self._rope_parameters(theta) or {"rope_type": "default", "rope_theta": theta}
        if arch == "phi3":
            rope = self._phi3_rope(theta, config)
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

    def _phi3_rope(self, theta: float, config) -> dict:
        """Phi-3's rotary as llama.cpp keeps it: over `rope.dimension_count` of each head, with LongRoPE's factors
        as tensors (rope_factors_short, rope_factors_long) and the pretraining length in the metadata."""
        head_dim = config.hidden_size // config.num_attention_heads
        rotary = int(self.metadata("phi3.rope.dimension_count", head_dim))
        rope = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": rotary / head_dim}
        short, long = (self._config_tensors.get(f"rope_factors_{k}.weight") for k in ("short", "long"))
        if short is None:
            return rope
        original = int(self._field("phi3.rope.scaling.original_context_length"))
        config.original_max_position_embeddings = original
        attention_factor = self.metadata("phi3.rope.scaling.attn_factor")
        return {
            **rope,
            "rope_type": "longrope",
            "short_factor": short.tolist(),
            "long_factor": (long if long is not None else short).tolist(),
            "original_max_position_embeddings": original,
            "factor": config.max_position_embeddings / original,
            **({"attention_factor": float(attention_factor)} if attention_factor is not None else {}),
        }

    def _gemma3_settings(self, settings: dict) -> dict:
        """What a Gemma 3 file implies beyond the shared metadata, as llama.cpp reads it."""
        layers, head_dim = settings["num_hidden_layers"], int(self._field("gemma3.attention.key_length"))
        scalar = (
            settings["hidden_size"] // settings["num_attention_heads"] if layers == _GEMMA3_27B_LAYERS else head_dim
        )
        return {
            "head_dim": head_dim,
            "query_pre_attn_scalar": scalar,
            "sliding_window": int(self._field("gemma3.attention.sliding_window")),
            "layer_types": [
                "full_attention" if (i + 1) % _GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention" for i in range(layers)
            ],
        }

    def _gpt_oss_settings(self, settings: dict) -> dict:
        """gpt-oss's names for the experts' settings, and what llama.cpp fixes for it: layers alternating a window
        (the even ones) and full attention, biased attention."""
        settings = {**settings, "intermediate_size": settings.pop("moe_intermediate_size")}
        settings["num_local_experts"] = settings.pop("num_experts")
        del settings["norm_topk_prob"]  # gpt-oss always takes the softmax of its top-k logits
        layers = settings["num_hidden_layers"]
        return {
            **settings,
            "head_dim": int(self._field("gpt-oss.attention.key_length")),
            "sliding_window": int(self._field("gpt-oss.attention.sliding_window")),
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            "attention_bias": True,
        }

    def tokenizer(self) -> Any:
        """A transformers tokenizer built from the file's vocabulary, with the file's chat template."""
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        # AutoTokenizer reads the file's config to pick a tokenizer class, and fails on gpt-oss's rope settings
        # (it takes a metadata array's length field for its value): such a file's tokenizer is built by the class
        # AutoTokenizer would take for its model type (the generic one), which reads the tokenizer's metadata alone
        kind = PreTrainedTokenizerFast if self.architecture in _GENERIC_TOKENIZER else AutoTokenizer
        tokenizer = kind.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        if self.metadata("tokenizer.ggml.pre") == "smollm":
            # transformers splits smollm text like GPT-2; SmolLM2's own tokenizer splits digits first
            from engine.loader.bundled import _use_smollm_pretokenizer

            _use_smollm_pretokenizer(tokenizer)
        template = self.metadata("tokenizer.chat_template")
        if template and not tokenizer.chat_template:
            tokenizer.chat_template = template
        context = self.metadata(f"{self.architecture}.context_length")
        if context is not None:
            tokenizer.model_max_length = int(context)
        return tokenizer

    def generation_eos_ids(self) -> list[int]:
        """Token ids that end a reply: the file's EOS, EOT and EOM ids and its end-of-turn control tokens."""
        ids: list[int] = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            value = self.metadata(f"tokenizer.ggml.{key}")
            if value is not None and int(value) not in ids:
                ids.append(int(value))
        tokens, types = self.metadata("tokenizer.ggml.tokens"), self.metadata("tokenizer.ggml.token_type")
        if tokens is not None and types is not None:
            for token_id, text in enumerate(tokens):
                if text in _END_OF_TURN_TEXTS and types[token_id] == _CONTROL_TOKEN and token_id not in ids:
                    ids.append(token_id)
        return ids

    def _rope_parameters(self, theta: float) -> dict | None:
        """Rope scaling transformers does not read from a GGUF: `rope.scaling.*` metadata, and the
        `rope_freqs` tensor llama.cpp writes for Llama 3.1+ in place of its rope_scaling settings."""
        arch = self.architecture
        kind = self.metadata(f"{arch}.rope.scaling.type")
        if kind not in (None, "none"):
            factor = self.metadata(f"{arch}.rope.scaling.factor")
            if kind not in ("linear", "yarn") or factor is None:
                raise ValueError(
                    f"{self.path.name} uses rope scaling {kind!r}; Pagoda supports linear, YaRN and Llama 3 "
                    "scaling. Use another file of this model."
                )
            if kind == "yarn":
                return self._yarn(theta, float(factor))
            return {"rope_type": "linear", "factor": float(factor), "rope_theta": theta}
        if self._rope_freqs is None:
            return None
        return _llama3_rope(self._rope_freqs, theta, self.path.name)

    def _yarn(self, theta: float, factor: float) -> dict:
        """YaRN's settings as convert_hf_to_gguf writes them. The file does not say whether the correction range
        is truncated to whole dimensions: gpt-oss was trained without (its config's `truncate: false`), the
        other families with (transformers' default)."""
        arch = self.architecture
        rope = {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": factor,
            "original_max_position_embeddings": int(self._field(f"{arch}.rope.scaling.original_context_length")),
            "truncate": arch != "gpt-oss",
        }
        for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            value = self.metadata(f"{arch}.rope.scaling.{theirs}")
            if value is not None:
                rope[ours] = float(value)
        attention_factor = self.metadata(f"{arch}.rope.scaling.yarn_attn_factor")
        if attention_factor is not None:
            rope["attention_factor"] = float(attention_factor)
        return rope

    # tensors

    def _make_plan(self) -> list[_Entry]:
        heads = (
            int(self._field(f"{self.architecture}.attention.head_count")),
            int(
                self.metadata(f"{self.architecture}.attention.head_count_kv")
                or self._field(f"{self.architecture}.attention.head_count")
            ),
        )
        plan, unsupported = [], []
        for t in self._tensors:
            type_name = t.type_name
            if type_name not in SUPPORTED_TYPES:
                unsupported.append(f"{t.name} ({type_name})")
            if t.name in _CONFIG_TENSORS:
                continue
            hf_name = _hf_name(t.name, self.architecture)
            if hf_name is None:
                raise ValueError(
                    f"{self.path.name} holds tensor {t.name!r}, which a {self.architecture} model does "
                    "not have; this file is not a plain Llama/Qwen GGUF that Pagoda can run."
                )
            permute = None
            if self.architecture == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
                permute = heads[0] if ".attn_q." in t.name else heads[1]
            plan.append(_Entry(t.name, hf_name, type_name, permute))
        if unsupported:
            raise ValueError(
                f"{self.path.name} stores tensor {unsupported[0]} in a GGUF type Pagoda cannot read"
                f"{f' (and {len(unsupported) - 1} more tensors)' if len(unsupported) > 1 else ''}. "
                f"Supported types: {', '.join(SUPPORTED_TYPES)}. Pick a file of another quantization "
                "(Q4_K_M, Q5_K_M, Q6_K or Q8_0 are all readable)."
            )
        return plan

    def tensor_names(self) -> list[str]:
        """The Hugging Face names `tensors()` yields, in file order."""
        return [e.hf_name for e in self._plan]

    def tensor_types(self) -> dict[str, str]:
        """GGUF type name of each tensor, by Hugging Face name."""
        return {e.hf_name: e.type_name for e in self._plan}

    def tensors(self) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """`(hf_name, value)` for every weight, one tensor decoded at a time: a torch tensor in the file's
        dtype for F32/F16/BF16, a QuantizedWeight for the block types.

        The bytes are read from the file, not through a memory map: every mapped page read stays in the
        process's resident memory while the map lives, which counted the whole file again beside the weights."""
        by_name = {t.name: t for t in self._tensors}
        with open(self.path, "rb") as file:
            for entry in self._plan:
                t = by_name[entry.gguf_name]
                value = decode(FileBytes(file, t.offset, t.n_bytes), entry.type_name, t.shape)
                if entry.heads is not None:
                    value = _unpermute_heads(value, entry.heads)
                if self.architecture == "gemma3" and entry.hf_name.endswith("norm.weight"):
                    value = value - 1  # convert_hf_to_gguf stores Gemma's norms as 1 + weight
                yield entry.hf_name, value
                del value  # not held while the next tensor decodes


def _hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(architecture, {})}
    if match is None or match[2] not in names:
        return None
    return f"model.layers.{match[1]}.{names[match[2]]}.{suffix}"


def _unpermute_heads(value: torch.Tensor | QuantizedWeight, heads: int) -> torch.Tensor | QuantizedWeight:
    """Undo convert_hf_to_gguf's llama q/k permutation, which interleaves each head's two rotary halves.
    It moves whole rows, so on quantized weights it moves codes, scales and offsets together, losslessly."""
    rows = value.shape[0]
    order = torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    if isinstance(value, torch.Tensor):
        return value[order].contiguous()
    if isinstance(value, BlockWeight):
        return value.take(order)
    return QuantizedWeight(
        value.bits,
        value.q[order].contiguous(),
        value.scale[order].contiguous(),
        None if value.offset is None else value.offset[order].contiguous(),
        value.group_size,
        value.source,
    )


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
