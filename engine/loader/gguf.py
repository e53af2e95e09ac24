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

`resolve_gguf(model)` says whether a model string names a GGUF: a `.gguf` path, a folder holding one,
`owner/repo/file.gguf` on the hub, or `owner/repo:Q4_K_M` (a quant tag, as llama.cpp and Ollama write it).
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.quantization.blocks import BlockWeight
from engine.quantization.layout import QuantizedWeight

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# GGUF type -> (bytes per block, values per block, code bits, values per scale)
QUANT_TYPES = {
    "Q4_0": (18, 32, 4, 32),
    "Q4_1": (20, 32, 4, 32),
    "Q5_0": (22, 32, 8, 32),
    "Q5_1": (24, 32, 8, 32),
    "Q8_0": (34, 32, 8, 32),
    "Q4_K": (144, 256, 4, 32),
    "Q5_K": (176, 256, 8, 32),
    "Q6_K": (210, 256, 8, 16),
}
SUPPORTED_TYPES = (*FLOAT_TYPES, *QUANT_TYPES)

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
}
# Not weights of the HF model: Llama 3's rope factors, folded into the config's rope parameters instead.
_CONFIG_TENSORS = {"rope_freqs.weight"}
# llama.cpp also ends generation on control tokens with these texts, whatever the file names as EOS
# (an instruct model's GGUF often names only one of its end-of-turn tokens).
_END_OF_TURN_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end|>", "<end_of_turn>")
_CONTROL_TOKEN = 3  # llama.cpp's token type for control tokens
_SPLIT_FILE = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


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
        self._tensors = [_TensorInfo(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())),
                                     int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
        self._gguf_names = {t.name for t in self._tensors}
        self._rope_freqs = next((np.array(t.data, dtype=np.float64) for t in reader.tensors
                                 if t.name == "rope_freqs.weight"), None)
        self.architecture: str = self._field("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"{path.name} is a GGUF of architecture {self.architecture!r}; Pagoda runs "
                             f"{', '.join(ARCHITECTURES)} GGUF files. Pick a GGUF of a supported model, or the "
                             "model's safetensors repo.")
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
            raise RuntimeError(f"cannot read {path} as a GGUF file ({type(e).__name__}: {e}). The file is incomplete "
                               "or corrupt: re-download it. (If it is new, `pip install -U gguf` may be needed to "
                               "read it.)") from e
        end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
        size = path.stat().st_size
        if end > size:
            raise RuntimeError(f"{path} is incomplete: its tensors need {end} bytes, the file has {size}. "
                               "Re-download it.")
        return cls(path, reader)

    # metadata

    def metadata(self, key: str, default: Any = None) -> Any:
        """One metadata value (`llama.context_length`, `tokenizer.chat_template`, ...), or `default`."""
        value = self._fields.get(key)
        return default if value is None else value

    def _field(self, key: str) -> Any:
        value = self.metadata(key)
        if value is None:
            raise RuntimeError(f"{self.path} has no {key!r} in its metadata; it is not a complete model GGUF. "
                               "Re-download it or use another file.")
        return value

    def hf_config(self) -> Any:
        """The transformers config (LlamaConfig, Qwen2Config or Qwen3Config) the file's metadata describes.

        Built from the metadata this reader holds already: transformers' `from_pretrained(gguf_file=)`
        would parse the whole header again, vocabulary included (5 s for SmolLM2's)."""
        import transformers

        arch = self.architecture
        names = {"hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
                 "num_hidden_layers": "block_count", "num_attention_heads": "attention.head_count",
                 "max_position_embeddings": "context_length", "rms_norm_eps": "attention.layer_norm_rms_epsilon"}
        settings = {ours: self._field(f"{arch}.{theirs}") for ours, theirs in names.items()}
        # files of models without grouped-query attention may leave the KV head count out
        settings["num_key_value_heads"] = self.metadata(f"{arch}.attention.head_count_kv",
                                                        settings["num_attention_heads"])
        settings = {k: (float(v) if k == "rms_norm_eps" else int(v)) for k, v in settings.items()}
        vocab = self.metadata(f"{arch}.vocab_size")
        settings["vocab_size"] = int(vocab) if vocab is not None else len(self._field("tokenizer.ggml.tokens"))
        config = getattr(transformers, ARCHITECTURES[arch].replace("ForCausalLM", "Config"))(**settings)
        config.architectures = [ARCHITECTURES[arch]]
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
        if hasattr(config, "rope_parameters"):
            config.rope_parameters = rope
        else:  # transformers 4
            config.rope_theta = rope["rope_theta"]
            config.rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        return config

    def tokenizer(self) -> Any:
        """A transformers tokenizer built from the file's vocabulary, with the file's chat template."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
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
            if kind != "linear" or factor is None:
                raise ValueError(f"{self.path.name} uses rope scaling {kind!r}; Pagoda supports linear and Llama 3 "
                                 "scaling. Use another file of this model.")
            return {"rope_type": "linear", "factor": float(factor), "rope_theta": theta}
        if self._rope_freqs is None:
            return None
        return _llama3_rope(self._rope_freqs, theta, self.path.name)

    # tensors

    def _make_plan(self) -> list[_Entry]:
        heads = (int(self._field(f"{self.architecture}.attention.head_count")),
                 int(self.metadata(f"{self.architecture}.attention.head_count_kv")
                     or self._field(f"{self.architecture}.attention.head_count")))
        plan, unsupported = [], []
        for t in self._tensors:
            type_name = t.type_name
            if type_name not in SUPPORTED_TYPES:
                unsupported.append(f"{t.name} ({type_name})")
            if t.name in _CONFIG_TENSORS:
                continue
            hf_name = _hf_name(t.name)
            if hf_name is None:
                raise ValueError(f"{self.path.name} holds tensor {t.name!r}, which a {self.architecture} model does "
                                 "not have; this file is not a plain Llama/Qwen GGUF that Pagoda can run.")
            permute = None
            if self.architecture == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
                permute = heads[0] if ".attn_q." in t.name else heads[1]
            plan.append(_Entry(t.name, hf_name, type_name, permute))
        if unsupported:
            raise ValueError(f"{self.path.name} stores tensor {unsupported[0]} in a GGUF type Pagoda cannot read"
                             f"{f' (and {len(unsupported) - 1} more tensors)' if len(unsupported) > 1 else ''}. "
                             f"Supported types: {', '.join(SUPPORTED_TYPES)}. Pick a file of another quantization "
                             "(Q4_K_M, Q5_K_M, Q6_K or Q8_0 are all readable).")
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
                value = decode(_FileBytes(file, t.offset, t.n_bytes), entry.type_name, t.shape)
                if entry.heads is not None:
                    value = _unpermute_heads(value, entry.heads)
                yield entry.hf_name, value
                del value  # not held while the next tensor decodes


class _FileBytes:
    """One tensor's stored bytes in an open file, read a range at a time."""

    def __init__(self, file: Any, offset: int, size: int) -> None:
        self.file, self.offset, self.size = file, offset, size

    def read(self, start: int, stop: int) -> torch.Tensor:
        """Bytes [start, stop) of the tensor as a uint8 tensor."""
        out = torch.empty(stop - start, dtype=torch.uint8)
        self.file.seek(self.offset + start)
        if self.file.readinto(out.numpy()) != stop - start:
            raise RuntimeError(f"{self.file.name} ended inside a tensor; the file is incomplete: re-download it")
        return out


def _hf_name(gguf_name: str) -> str | None:
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if match is None or match[2] not in _LAYER_NAMES:
        return None
    return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{suffix}"


def _unpermute_heads(value: torch.Tensor | QuantizedWeight, heads: int) -> torch.Tensor | QuantizedWeight:
    """Undo convert_hf_to_gguf's llama q/k permutation, which interleaves each head's two rotary halves.
    It moves whole rows, so on quantized weights it moves codes, scales and offsets together, losslessly."""
    rows = value.shape[0]
    order = torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    if isinstance(value, torch.Tensor):
        return value[order].contiguous()
    if isinstance(value, BlockWeight):
        return value.take(order)
    return QuantizedWeight(value.bits, value.q[order].contiguous(), value.scale[order].contiguous(),
                           None if value.offset is None else value.offset[order].contiguous(), value.group_size,
                           value.source)


def _llama3_rope(factors: np.ndarray, theta: float, file_name: str) -> dict:
    """llama.cpp stores Llama 3 rope scaling only as per-frequency divisors (convert_hf_to_gguf's rope_freqs).
    Every Llama 3.x uses low_freq_factor 1, high_freq_factor 4 and an 8192-token original context, with
    the factor the largest divisor: rebuild those settings and check they give back every divisor."""
    params = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_theta": theta}
    dim = 2 * len(factors)
    wavelen = 2 * math.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    old, low, high, factor = 8192, 1.0, 4.0, params["factor"]
    smooth = (old / wavelen - low) / (high - low)
    expected = np.where(wavelen < old / high, 1.0,
                        np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    if not np.allclose(factors, expected, rtol=1e-4, atol=0):
        raise ValueError(f"{file_name} scales rope by per-frequency factors (rope_freqs) that are not Llama 3's "
                         "scaling; Pagoda cannot reproduce them. Use the model's safetensors repo instead.")
    return params


# block decoders: uint8 blocks [n_blocks, bytes] -> codes [n_blocks, values], scales (and offsets) [n_blocks, groups]

def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()  # [n_blocks, 1]


def _nibbles(qs: torch.Tensor, run: int = 32) -> torch.Tensor:
    """The low nibbles of each `run` bytes, then their high nibbles, as ggml lays out 4-bit values (runs of 16
    bytes in the 32-value blocks, of 32 in the K-quants' sub-blocks): [n, runs, 2, run]."""
    qs = qs.reshape(qs.shape[0], -1, 1, run)
    return torch.cat((qs & 0xF, qs >> 4), dim=2)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """Each byte's 8 bits, least significant first: [n, bytes] -> [n, 8, bytes]."""
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    return (packed.unsqueeze(1) >> shifts) & 1


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight 6-bit scales and mins, packed in 12 bytes."""
    lo, mid, hi = packed.view(-1, 3, 4).unbind(1)
    scales = torch.cat((lo & 63, (hi & 0xF) | ((lo >> 2) & 0x30)), dim=1)
    mins = torch.cat((mid & 63, (hi >> 4) | ((mid >> 2) & 0x30)), dim=1)
    return scales.float(), mins.float()


def _q4_0(b):
    d = _half(b, 0)
    return _nibbles(b[:, 2:18], 16).reshape(len(b), 32), d, -8 * d


def _q4_1(b):
    return _nibbles(b[:, 4:20], 16).reshape(len(b), 32), _half(b, 0), _half(b, 2)


def _q5(b, qh_at: int):
    high = _bits(b[:, qh_at:qh_at + 4]).transpose(1, 2).reshape(len(b), 32)  # bit j of the 32-bit word: value j
    return _nibbles(b[:, qh_at + 4:qh_at + 20], 16).reshape(len(b), 32) | (high << 4)


def _q5_0(b):
    return (_q5(b, 2).to(torch.int8) - 16), _half(b, 0), None


def _q5_1(b):
    return _q5(b, 4).to(torch.int8), _half(b, 0), _half(b, 2)


def _q8_0(b):
    return b[:, 2:34].contiguous().view(torch.int8), _half(b, 0), None


def _q4_k(b):
    scales, mins = _k_scales(b[:, 4:16])
    return _nibbles(b[:, 16:144]).reshape(len(b), 256), _half(b, 0) * scales, -(_half(b, 2) * mins)


def _q5_k(b):
    scales, mins = _k_scales(b[:, 4:16])
    high = _bits(b[:, 16:48])  # bit j of byte l: value l of sub-block j
    codes = _nibbles(b[:, 48:176]).reshape(len(b), 8, 32) | (high << 4)
    return codes.reshape(len(b), 256).to(torch.int8), _half(b, 0) * scales, -(_half(b, 2) * mins)


def _q6_k(b):
    n = len(b)
    low = b[:, :128].reshape(n, 2, 1, 64)
    low = torch.cat((low & 0xF, low >> 4), dim=2).reshape(n, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3
    codes = (low | (high << 4)).reshape(n, 256).to(torch.int8) - 32
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    return codes, _half(b, 208) * scales, None


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k,
             "Q6_K": _q6_k}


DECODE_SLAB_BYTES = 1 << 20  # stored bytes decoded per step: the decoders' temporaries stay a few times this
KEEP_BLOCKS = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")  # the types kquant.py reads as stored


def decode(data: _FileBytes, type_name: str, shape: tuple[int, ...]) -> torch.Tensor | QuantizedWeight:
    """One tensor's stored bytes in Pagoda's form: a float tensor of `shape` in its own dtype, or a
    QuantizedWeight with `shape` [N, K] for a block type, decoded a slab of rows at a time. K-quants stay as
    stored (a BlockWeight, decoded when asked for), for the kernel that reads them so (quantization/kquant.py)."""
    if type_name in FLOAT_TYPES:
        return data.read(0, data.size).view(FLOAT_TYPES[type_name]).view(shape)
    if type_name not in _DECODERS:
        raise ValueError(f"GGUF type {type_name} is not supported; supported: {', '.join(SUPPORTED_TYPES)}")
    block_bytes, block_values, bits, group = QUANT_TYPES[type_name]
    if len(shape) != 2:
        raise ValueError(f"a {type_name} tensor of shape {shape} is not a matrix; Pagoda reads quantized matrices only")
    rows, cols = shape
    if cols % block_values:
        raise ValueError(f"a {type_name} tensor's rows hold whole {block_values}-value blocks, but it has {cols} "
                         "columns; the file is corrupt")
    row_bytes = cols // block_values * block_bytes
    if type_name in KEEP_BLOCKS:
        stored = data.read(0, data.size).view(rows, row_bytes)
        return BlockWeight(stored, type_name, (rows, cols), bits, group, partial(_decode_stored, type_name))
    codes, scale, offset = _decode_rows(lambda start, stop: data.read(start * row_bytes, stop * row_bytes),
                                        type_name, rows, cols)
    return QuantizedWeight(bits, codes, scale, offset, group, type_name)


def _decode_stored(type_name: str, stored: torch.Tensor, cols: int):
    """BlockWeight's decoder: codes, scales and offsets of stored blocks [rows, row bytes]."""
    return _decode_rows(lambda start, stop: stored[start:stop].reshape(-1), type_name, stored.shape[0], cols)


def _decode_rows(read, type_name: str, rows: int, cols: int):
    """(codes, scale, offset) of `rows` rows whose bytes `read(start_row, stop_row)` gives, a slab at a time."""
    block_bytes, block_values, _, group = QUANT_TYPES[type_name]
    row_bytes, groups = cols // block_values * block_bytes, cols // group
    step = max(1, DECODE_SLAB_BYTES // row_bytes)
    codes = scale = offset = None
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        blocks = read(start, stop).view(-1, block_bytes)
        part_codes, part_scale, part_offset = _DECODERS[type_name](blocks)
        if codes is None:
            codes = torch.empty(rows, cols, dtype=part_codes.dtype)
            scale = torch.empty(rows, groups)
            offset = None if part_offset is None else torch.empty(rows, groups)
        codes[start:stop] = part_codes.reshape(stop - start, cols)
        scale[start:stop] = part_scale.reshape(stop - start, groups)
        if offset is not None:
            offset[start:stop] = part_offset.reshape(stop - start, groups)
    return codes, scale, offset


# finding a GGUF model

def resolve_gguf(model: str) -> Path | None:
    """The local GGUF file a model string names, downloading it from the hub if needed; None when the
    model is not a GGUF (a Hugging Face folder or repo id, for the safetensors path).

    - `path/to/model.gguf`
    - a folder with exactly one `.gguf` and no config.json
    - `owner/repo/file.gguf` (the file may sit in a folder of the repo: `owner/repo/Q4/file.gguf`)
    - `owner/repo:Q4_K_M`: the repo's one GGUF with that quant tag in its name, as llama.cpp (`-hf`) and
      Ollama (`hf.co/owner/repo:Q4_K_M`) spell it
    - `owner/repo-GGUF` with no tag: the repo's GGUF if it holds just one
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return _gguf_in_folder(path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            return None
        _refuse_split(path.name)
        return path
    local = model.startswith((".", "/", "~")) or "\\" in model or re.match(r"[A-Za-z]:[\\/]", model) is not None
    if local:
        if model.lower().endswith(".gguf"):
            raise FileNotFoundError(f"GGUF file {model!r} does not exist; check the path")
        return None
    parts = model.split("/")
    if len(parts) >= 3 and model.lower().endswith(".gguf"):
        repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
        _refuse_split(filename)
        return _download(repo, filename)
    if len(parts) == 2 and ":" in parts[1]:
        repo, _, tag = model.rpartition(":")
        return _download(repo, _pick_by_tag(repo, tag))
    if len(parts) == 2 and parts[1].lower().endswith("-gguf"):
        return _download(model, _pick_by_tag(model, None))
    if model.lower().endswith(".gguf"):
        raise FileNotFoundError(f"GGUF file {model!r} does not exist; give a local .gguf path or a hub file as "
                                "'owner/repo/file.gguf'")
    return None


def _gguf_in_folder(folder: Path) -> Path | None:
    if (folder / "config.json").is_file():
        return None
    found = sorted(folder.glob("*.gguf"))
    if len(found) > 1:
        raise ValueError(f"{folder} holds {len(found)} GGUF files ({', '.join(f.name for f in found)}); pass the one "
                         "to load as the model path")
    if found:
        _refuse_split(found[0].name)
        return found[0]
    return None


def _refuse_split(name: str) -> None:
    if _SPLIT_FILE.search(name):
        raise ValueError(f"{name} is one part of a split GGUF; Pagoda reads single files. Merge the parts with "
                         "llama.cpp's `llama-gguf-split --merge`, or pick a smaller quantization that is one file.")


def _pick_by_tag(repo: str, tag: str | None) -> str:
    import huggingface_hub

    try:
        files = [f for f in huggingface_hub.HfApi().list_repo_files(repo) if f.lower().endswith(".gguf")]
    except Exception as e:
        raise RuntimeError(f"could not list the files of {repo!r} on the Hugging Face hub ({type(e).__name__}: {e}). "
                           "Check the repo id and your connection.") from e
    files = [f for f in files if "mmproj" not in f.lower()]  # vision projectors, not language models
    if tag is not None:
        pattern = re.compile(rf"(?:^|[-._/]){re.escape(tag)}(?:[-./]|$)", re.IGNORECASE)
        matches = [f for f in files if pattern.search(f[:-len(".gguf")])]
    else:
        matches = files
    if len(matches) == 1:
        _refuse_split(matches[0])
        return matches[0]
    tags = sorted({_quant_tag(f) for f in files} - {None})
    if not matches:
        wanted = f"with quant tag {tag!r}" if tag else "at all"
        raise FileNotFoundError(f"{repo!r} has no GGUF file {wanted}; available: {', '.join(tags) or 'none'}. Pass "
                                f"'{repo}:<tag>' or '{repo}/<file>.gguf'.")
    raise ValueError(f"{repo!r} has {len(matches)} GGUF files{f' matching {tag!r}' if tag else ''} "
                     f"({', '.join(matches[:8])}{', ...' if len(matches) > 8 else ''}); pass one as "
                     f"'{repo}/<file>.gguf'" + (f" or pick a quant tag: '{repo}:{tags[0]}' ({', '.join(tags)})"
                                                if tags and not tag else ""))


def _quant_tag(filename: str) -> str | None:
    match = re.search(r"(?:^|[-._])((?:I?Q\d\w*?)|F16|BF16|F32)$", Path(filename).stem, re.IGNORECASE)
    return match[1].upper() if match else None


def _download(repo: str, filename: str) -> Path:
    import huggingface_hub

    try:
        return Path(huggingface_hub.hf_hub_download(repo_id=repo, filename=filename))
    except Exception as e:
        raise RuntimeError(f"could not get {filename!r} from {repo!r} on the Hugging Face hub "
                           f"({type(e).__name__}: {e}). Check the repo id, the file name and your connection, or pass "
                           "a local .gguf file.") from e
