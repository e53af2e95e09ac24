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

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.loader import gguf_config
from engine.loader.gguf_blocks import SUPPORTED_TYPES, FileBytes, decode
from engine.loader.gguf_header import GGUFHeader, TensorEntry, read_header
from engine.models import GGUF_ARCHITECTURES
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
    "qwen35": {
        "post_attention_norm": "post_attention_layernorm",
        "attn_qkv": "linear_attn.in_proj_qkv",
        "attn_gate": "linear_attn.in_proj_z",
        "ssm_beta": "linear_attn.in_proj_b",
        "ssm_alpha": "linear_attn.in_proj_a",
        "ssm_out": "linear_attn.out_proj",
        "ssm_norm": "linear_attn.norm",
        "ssm_conv1d": "linear_attn.conv1d",
    },
    "gemma4": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
        "post_ffw_norm_1": "post_feedforward_layernorm_1",
        "post_ffw_norm_2": "post_feedforward_layernorm_2",
        "inp_gate": "per_layer_input_gate",
        "proj": "per_layer_projection",
        "post_norm": "post_per_layer_input_norm",
        "ffn_gate_inp": "router.proj",
        "ffn_gate_exps": "experts.gate_proj",
        "ffn_up_exps": "experts.up_proj",
        "ffn_gate_up_exps": "experts.gate_up_proj",
        "ffn_down_exps": "experts.down_proj",
    },
}
_ARCH_LAYER_NAMES["qwen35moe"] = {
    **_ARCH_LAYER_NAMES["qwen35"],
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Qwen3-Next: Qwen3.5-MoE's names; the beta and alpha rows fused per key head as its checkpoints have them (split at
# load, engine/models/qwen3_5.py), and in files from before llama.cpp split it, q, k, v and z fused likewise (ssm_in)
_ARCH_LAYER_NAMES["qwen3next"] = {
    **_ARCH_LAYER_NAMES["qwen35moe"],
    "ssm_beta_alpha": "linear_attn.in_proj_ba",
    "ssm_in": "linear_attn.in_proj_qkvz",
}
# Tensors that are no module's weight, by family: GGUF name (after the layer) -> our parameter
_ARCH_PARAMETERS = {
    "gemma4": {
        "layer_output_scale.weight": "layer_scalar",
        "ffn_gate_inp.scale": "router.scale",
        "ffn_down_exps.scale": "router.per_expert_scale",
    },
    "qwen35": {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"},
}
_ARCH_PARAMETERS["qwen35moe"] = _ARCH_PARAMETERS["qwen3next"] = _ARCH_PARAMETERS["qwen35"]
_GEMMA4_GLOBAL_NAMES = {
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}
# Architectures whose GGUF config transformers cannot read, and whose tokenizer is its generic one
_GENERIC_TOKENIZER = ("gpt-oss",)
# The multi-token-prediction head's own tensors in its block (llama.cpp's nextn names), and its copies of the
# model's embedding and head, which the head shares with the model here
_MTP_NAMES = {
    "nextn.eh_proj": "fc",
    "nextn.enorm": "pre_fc_norm_embedding",
    "nextn.hnorm": "pre_fc_norm_hidden",
    "nextn.shared_head_norm": "norm",
}
_MTP_SHARED = ("nextn.embed_tokens", "nextn.shared_head_head")
# The head's input norms: zero-centred, stored as 1 + weight under their nextn names (enorm, hnorm), which end in
# "norm.weight" as the converter's rule wants, where the head's own names do not
_MTP_NORMS = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")
# Not weights of the HF model: Llama 3's rope factors, folded into the config's rope parameters instead.
# and Phi-3's LongRoPE factors
_CONFIG_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
# llama.cpp also ends generation on control tokens with these texts, whatever the file names as EOS
# (an instruct model's GGUF often names only one of its end-of-turn tokens).
_END_OF_TURN_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end|>", "<end_of_turn>")
_END_OF_TURN_TEXTS += ("<turn|>", "<|tool_response>")  # Gemma 4's, as llama.cpp ends generation on them
_TURN_TOKEN_TYPES = (3, 4)  # llama.cpp's token types for control and user-defined tokens (Gemma 4's <|tool_response>)


@dataclass(frozen=True)
class _Entry:
    gguf_name: str
    hf_name: str
    type_name: str
    heads: int | None  # llama's q/k rows were interleaved per head by llama.cpp: undo with this many heads


def _read_floats(path: Path, tensor: TensorEntry) -> np.ndarray:
    """A small F32/F16 tensor's values, as float64."""
    dtype = {"F32": np.float32, "F16": np.float16}.get(tensor.type_name)
    if dtype is None:
        raise ValueError(f"{path.name} stores {tensor.name} as {tensor.type_name}; Pagoda reads it as F32 or F16")
    count = tensor.n_bytes // np.dtype(dtype).itemsize
    return np.fromfile(path, dtype=dtype, count=count, offset=tensor.offset).astype(np.float64)


class GGUFCheckpoint:
    """One GGUF file: metadata at hand, tensors read from the file and decoded on demand.

    The header is read once (gguf_header.py) and kept as plain values; the tensors' bytes are read when they load."""

    def __init__(self, path: Path, header: GGUFHeader) -> None:
        self.path = path
        self._fields = header.metadata
        self._tensors = header.tensors
        self._gguf_names = {t.name for t in self._tensors}
        self._config_tensors = {t.name: _read_floats(path, t) for t in self._tensors if t.name in _CONFIG_TENSORS}
        self.architecture: str = self.field("general.architecture")
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
            header = read_header(path)
        except Exception as e:  # bad magic, a header cut short, a type this gguf package does not know
            raise RuntimeError(
                f"cannot read {path} as a GGUF file ({type(e).__name__}: {e}). The file is incomplete "
                "or corrupt: re-download it. (If it is new, `pip install -U gguf` may be needed to "
                "read it.)"
            ) from e
        end = max((t.offset + t.n_bytes for t in header.tensors), default=0)
        size = path.stat().st_size
        if end > size:
            raise RuntimeError(
                f"{path} is incomplete: its tensors need {end} bytes, the file has {size}. Re-download it."
            )
        return cls(path, header)

    # metadata

    def metadata(self, key: str, default: Any = None) -> Any:
        """One metadata value (`llama.context_length`, `tokenizer.chat_template`, ...), or `default`."""
        value = self._fields.get(key)
        return default if value is None else value

    def field(self, key: str) -> Any:
        """A metadata value the file must have; a clear error where it lacks it."""
        value = self.metadata(key)
        if value is None:
            raise RuntimeError(
                f"{self.path} has no {key!r} in its metadata; it is not a complete model GGUF. "
                "Re-download it or use another file."
            )
        return value

    def hf_config(self) -> Any:
        """The transformers config (LlamaConfig, Qwen3MoeConfig, GptOssConfig, ...) the file's metadata describes
        (gguf_config.py). Built from the metadata this reader holds already: transformers' `from_pretrained(gguf_file=)`
        would parse the whole header again, vocabulary included (5 s for SmolLM2's)."""
        return gguf_config.hf_config(self)

    def config_tensor(self, name: str) -> np.ndarray | None:
        """A small tensor that is configuration, not a weight (Llama 3's rope_freqs, Phi-3's LongRoPE factors)."""
        return self._config_tensors.get(name)

    def has_tensor(self, name: str) -> bool:
        return name in self._gguf_names

    def tokenizer(self) -> Any:
        """A transformers tokenizer built from the file's vocabulary, with the file's chat template."""
        tokenizer = self.tokenizer_class().from_pretrained(str(self.path.parent), gguf_file=self.path.name)
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

    def tokenizer_class(self) -> type:
        """The class AutoTokenizer takes for the file's model type, found from the config this reader built.
        AutoTokenizer itself would parse the whole file again for a config (10 s for a 150k vocabulary with
        gguf-py's reader), and fails on gpt-oss's rope settings."""
        from transformers import PreTrainedTokenizerFast
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

        names = TOKENIZER_MAPPING_NAMES.get(self.hf_config().model_type)
        if isinstance(names, tuple):  # transformers 4: (slow, fast) class names
            names = names[-1] or names[0]
        found = tokenizer_class_from_name(names) if names and self.architecture not in _GENERIC_TOKENIZER else None
        return found or PreTrainedTokenizerFast

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
                if text in _END_OF_TURN_TEXTS and types[token_id] in _TURN_TOKEN_TYPES and token_id not in ids:
                    ids.append(token_id)
        return ids

    # tensors

    def _make_plan(self) -> list[_Entry]:
        heads = self._llama_heads() if self.architecture == "llama" else None
        plan, unsupported = [], []
        for t in self._tensors:
            type_name = t.type_name
            if self._is_mtp_block(t.name):
                continue
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

    def _is_mtp_block(self, name: str) -> bool:
        """A tensor of the multi-token-prediction head's blocks, which convert_hf_to_gguf appends after the model's
        (Qwen3.5's `nextn_predict_layers`): speculative decoding's, not read with the model."""
        nextn = self._nextn_layers()
        if not nextn:  # (a file without a head may lack even the block count: tests' partial files do)
            return False
        match = re.match(r"blk\.(\d+)\.", name)
        return match is not None and int(match[1]) >= int(self.field(f"{self.architecture}.block_count")) - nextn

    def _nextn_layers(self) -> int:
        return int(self.metadata(f"{self.architecture}.nextn_predict_layers", 0) or 0)

    def _llama_heads(self) -> tuple[int, int]:
        """(query heads, KV heads): how many heads llama.cpp interleaved the q and k rows of."""
        arch = self.architecture
        heads = int(self.field(f"{arch}.attention.head_count"))
        return heads, int(self.metadata(f"{arch}.attention.head_count_kv") or heads)

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
        return self._decoded(self._plan)

    def mtp_tensors(self) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """As `tensors()`, the multi-token-prediction head's (its blocks after the model's), named as the head of
        engine/models/qwen3_5_mtp.py names them: `fc`, its three norms and `layers.i.*`. Empty where the file keeps
        no head. Its copies of the model's embedding and head, where the file has them, are the model's own."""
        plan, first = [], int(self.field(f"{self.architecture}.block_count")) - self._nextn_layers()
        for t in self._tensors:
            if not self._is_mtp_block(t.name):
                continue
            block, rest = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name).groups()
            stem, _, suffix = rest.rpartition(".")
            if stem in _MTP_SHARED:
                continue
            hf_name = _hf_name(t.name, self.architecture)
            if stem in _MTP_NAMES:
                hf_name = f"{_MTP_NAMES[stem]}.{suffix}"
            elif hf_name is not None:
                hf_name = hf_name.replace(f"model.layers.{block}.", f"layers.{int(block) - first}.", 1)
            else:
                raise ValueError(
                    f"{self.path.name} holds tensor {t.name!r} in its multi-token-prediction head, which Pagoda "
                    'does not know; load the model without speculative_config method "mtp"'
                )
            plan.append(_Entry(t.name, hf_name, t.type_name, None))
        return self._decoded(plan)

    def _decoded(self, plan: list[_Entry]) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        by_name = {t.name: t for t in self._tensors}
        with open(self.path, "rb") as file:
            for entry in plan:
                t = by_name[entry.gguf_name]
                value = decode(FileBytes(file, t.offset, t.n_bytes), entry.type_name, t.shape)
                if entry.heads is not None:
                    value = _unpermute_heads(value, entry.heads)
                yield entry.hf_name, _as_converted_back(self.architecture, entry.hf_name, value)
                del value  # not held while the next tensor decodes


def _as_converted_back(architecture: str, hf_name: str, value):
    """Undo what convert_hf_to_gguf does to a family's small tensors: Gemma 3's, Qwen3.5's and Qwen3-Next's
    zero-centred norms stored as 1 + weight (not their gated norm), their decay rates stored as -exp(A_log), and
    their depthwise convolution stored without its middle dimension."""
    hybrid = architecture in ("qwen35", "qwen35moe", "qwen3next")
    zero_centred = architecture == "gemma3" or (hybrid and ".linear_attn.norm." not in hf_name)
    if zero_centred and hf_name.endswith(("norm.weight", *_MTP_NORMS)):
        return value - 1
    if hybrid and hf_name.endswith(".A_log"):
        return torch.log(-value.float()).to(value.dtype)
    if hybrid and hf_name.endswith(".conv1d.weight"):
        return value.unsqueeze(1)
    return value


def _hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    parameters = _ARCH_PARAMETERS.get(architecture, {})
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if match is not None and match[2] in parameters:
        return f"model.layers.{match[1]}.{parameters[match[2]]}"
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    global_names = {**_GLOBAL_NAMES, **(_GEMMA4_GLOBAL_NAMES if architecture == "gemma4" else {})}
    if stem in global_names:
        return f"{global_names[stem]}.{suffix}"
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
    return value[order].contiguous() if isinstance(value, torch.Tensor) else value.take(order)
