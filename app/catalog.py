"""The model catalog (assets/catalog.json): the chat models Pagoda offers, each with the few config.json numbers a
memory estimate needs (parameter count, layers, KV heads, head size, trained context length), and
`entry_from_config`, which makes such an entry for any hub repo the user types, from its config.json. The
estimates themselves are app/memory_estimate.py's.

An entry with a `gguf_file` is served from that one file of its repo (already quantized; `gguf_type` names
its quantization, e.g. "Q4_K_M"); the others from the repo's safetensors.

This module imports neither gradio nor torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CatalogEntry",
    "DEFAULT_CATALOG",
    "SUPPORTED_ARCHITECTURES",
    "load_catalog",
    "entry_for_repo",
    "entry_from_config",
    "count_params",
    "dtype_bytes",
]

DEFAULT_CATALOG = Path(__file__).resolve().parent.parent / "assets" / "catalog.json"

# config.json `architectures` the engine has a model class for (engine/models/__init__.py), and their family.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MinistralForCausalLM": "mistral",
    "SmolLM3ForCausalLM": "smollm3",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its language model; images are not supported yet
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",  # its language model; images and audio are not supported yet
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # its language model; images are not supported yet
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
}
SUPPORTED_NAMES = (
    "Llama, Mistral, Ministral, SmolLM3, Phi-3/4-mini, Gemma 3, Gemma 4, Qwen2/2.5, Qwen3 (dense and MoE), "
    "Qwen3.5 (dense and MoE), Qwen3-Next, gpt-oss"
)

_DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
}

_REQUIRED = (
    "repo_id",
    "params",
    "checkpoint_dtype",
    "download_bytes",
    "num_hidden_layers",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


@dataclass
class CatalogEntry:
    """One chat model. Sizes are approximate unless `size_is_approximate` is False (then they came from the hub)."""

    repo_id: str
    params: int  # unique parameters (tied embeddings counted once)
    checkpoint_dtype: str  # dtype of the safetensors on the hub, e.g. "bfloat16"
    download_bytes: int  # what a download of the engine's files takes on disk
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    name: str = ""
    family: str = ""  # "llama", "qwen2", "qwen3" ("" when unknown)
    architecture: str = ""  # config.json architectures[0]
    params_label: str = ""  # "0.6B", "135M"
    hidden_size: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    num_attention_heads: int | None = None
    tie_word_embeddings: bool = True
    gated: bool = False  # the repo needs its license accepted and a logged-in token
    license: str = ""
    bundled: bool = False  # ships with Pagoda and works offline
    gguf_file: str = ""  # the one GGUF file of the repo to fetch and serve ("": safetensors repo)
    gguf_type: str = ""  # its quantization as named in the file name, e.g. "Q4_K_M"
    description: str = ""
    size_is_approximate: bool = True
    num_experts: int = 0  # a mixture of experts' experts per layer (0: a dense model)
    num_experts_per_tok: int = 0  # of num_experts, those each token is routed to
    moe_intermediate_size: int | None = None  # one expert's width, where it is not intermediate_size (Qwen3-MoE)
    active_params: int = 0  # of `params`, those one token's step reads (count_active_params; 0: a dense model)
    sliding_window: int | None = None  # tokens a sliding-window layer sees (None: no such layers)
    num_sliding_layers: int = 0  # of the layers holding a KV cache, those that attend through sliding_window
    num_kv_layers: int = (
        0  # layers holding a KV cache of their own (0: every layer; Gemma 4's shared-KV ones hold none)
    )
    kv_width: int = 0  # keys (or values) one token holds in one layer (0: num_key_value_heads x head_dim)
    state_bytes: int = 0  # a hybrid model's recurrent state per chat, whatever its length (Qwen3.5)

    def __post_init__(self) -> None:
        if not self.name:
            self.name = self.repo_id.split("/")[-1]
        if not self.params_label:
            self.params_label = _params_label(self.params)

    @property
    def active_label(self) -> str:
        """ "3.6B active" for a mixture of experts whose active parameters are known, else ""."""
        return f"{_params_label(self.active_params)} active" if self.num_experts and self.active_params else ""

    @property
    def is_gguf(self) -> bool:
        """Served from one GGUF file, whose weights are quantized already (no quantization= at load)."""
        return bool(self.gguf_file)

    @property
    def quantizable(self) -> bool:
        """Whether the engine can quantize it at load: not a GGUF (quantized already), not a mixture of experts
        (the engine does not quantize experts yet)."""
        return not self.is_gguf and not self.num_experts

    @property
    def supported(self) -> bool:
        """Whether Pagoda's engine has a model class for this architecture."""
        return self.architecture in SUPPORTED_ARCHITECTURES

    def kv_bytes_per_token(self, dtype: str = "bfloat16", kv_cache_dtype: str = "auto") -> int:
        """K and V for one token across all layers, at `dtype` or quantized (`kv_cache_dtype`: a row of bytes per
        head, engine/attention/kv_format.py). Where layers differ in width (Gemma 4), the engine gives every layer
        the widest one's rows (engine/runner/kv_cache.py), and so does this."""
        width = self.kv_width or self.num_key_value_heads * self.head_dim
        layers = self.num_kv_layers or self.num_hidden_layers
        if kv_cache_dtype == "auto" or not self.head_dim:
            return 2 * layers * width * dtype_bytes(dtype, self)
        from engine.attention.kv_format import kv_format

        return 2 * layers * width * kv_format(kv_cache_dtype).row_width(self.head_dim) // self.head_dim

    def kv_bytes(
        self, context_len: int, dtype: str = "bfloat16", windows_release: bool = False, kv_cache_dtype: str = "auto"
    ) -> int:
        """K and V of one sequence of `context_len` tokens, and a hybrid model's recurrent state. `windows_release`:
        the engine gives back what a sliding window has passed (its KV-cache groups, where steps are not CUDA
        graphs), so a sliding layer holds its window and a step's chunk of tokens, not the whole context."""
        layers = self.num_kv_layers or self.num_hidden_layers
        per_layer = self.kv_bytes_per_token(dtype, kv_cache_dtype) // layers
        sliding = self.num_sliding_layers if windows_release and self.sliding_window else 0
        held = min(context_len, (self.sliding_window or 0) + SLIDING_CHUNK_TOKENS)
        return per_layer * ((layers - sliding) * context_len + sliding * held) + self.state_bytes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# The tokens a CPU step computes at most (engine/config.py's default): a sliding-window layer holds them beside its
# window while a long prompt is prefilled
SLIDING_CHUNK_TOKENS = 2048


# ---- loading --------------------------------------------------------------------------------------------------

_default_cache: list[CatalogEntry] | None = None


def load_catalog(path: str | os.PathLike | None = None) -> list[CatalogEntry]:
    """The catalog's entries, in file order. Raises ValueError naming the entry and key when the file is malformed."""
    global _default_cache
    if path is None and _default_cache is not None:
        return [dataclasses.replace(e) for e in _default_cache]
    file = Path(path) if path is not None else DEFAULT_CATALOG
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"model catalog {file} is missing") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"model catalog {file} is not valid JSON ({e})") from None
    raw = doc.get("models") if isinstance(doc, dict) else doc
    if not isinstance(raw, list):
        raise ValueError(f"model catalog {file} must hold a list of models under 'models'")
    known = {f.name for f in dataclasses.fields(CatalogEntry)}
    entries = []
    for i, item in enumerate(raw):
        label = item.get("repo_id", "?") if isinstance(item, dict) else repr(item)
        where = f"model catalog {file}, entry {i} ({label})"
        if not isinstance(item, dict):
            raise ValueError(f"{where} is not an object")
        missing = [k for k in _REQUIRED if item.get(k) in (None, "")]
        if missing:
            raise ValueError(f"{where} lacks {', '.join(missing)}")
        entry = CatalogEntry(**{k: v for k, v in item.items() if k in known})  # unknown keys: newer catalog
        for k in (
            "params",
            "download_bytes",
            "num_hidden_layers",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if not isinstance(getattr(entry, k), int) or getattr(entry, k) <= 0:
                raise ValueError(f"{where}: {k} must be a positive integer, got {getattr(entry, k)!r}")
        entries.append(entry)
    if path is None:
        _default_cache = entries
        return [dataclasses.replace(e) for e in entries]
    return entries


def entry_for_repo(repo_id: str) -> CatalogEntry | None:
    """The catalog entry for a hub repo id (case-insensitive), or None."""
    key = repo_id.strip().lower()
    for entry in load_catalog():
        if entry.repo_id.lower() == key:
            return entry
    return None


# ---- arithmetic -----------------------------------------------------------------------------------------------


def dtype_bytes(dtype: str, entry: CatalogEntry | None = None) -> int:
    """Bytes per element of a dtype name ("bfloat16", "float16", "float32", "auto" = the checkpoint's dtype)."""
    name = str(dtype).lower().removeprefix("torch.")
    if name == "auto":
        name = (entry.checkpoint_dtype if entry is not None else "bfloat16").lower().removeprefix("torch.")
    try:
        return _DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use bfloat16, float16, float32 or auto") from None


def count_params(
    *,
    hidden_size: int,
    intermediate_size: int,
    vocab_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    tie_word_embeddings: bool = True,
    family: str = "llama",
    num_experts: int = 0,
    moe_intermediate_size: int | None = None,
) -> int:
    """Parameters of a Llama-style decoder (Qwen2 adds q/k/v biases, Qwen3 q/k norms, gpt-oss biases everywhere and
    attention sinks); tied head counted once. With `num_experts`, each layer's MLP is that many experts of
    `moe_intermediate_size` (gpt-oss: `intermediate_size`) and a router."""
    h, kv_dim, q_dim = hidden_size, num_key_value_heads * head_dim, num_attention_heads * head_dim
    attn = h * q_dim + 2 * h * kv_dim + q_dim * h
    if family in ("qwen2", "gpt_oss"):
        attn += q_dim + 2 * kv_dim
    if family in ("qwen3", "qwen3_moe"):
        attn += 2 * head_dim
    if family == "gpt_oss":
        attn += h + num_attention_heads  # the output projection's bias, a sink per head
    mlp = 3 * h * intermediate_size
    if num_experts:
        mlp = num_experts * expert_params(h, moe_intermediate_size or intermediate_size, family) + h * num_experts
        mlp += num_experts if family == "gpt_oss" else 0  # the router's bias
    layer = attn + mlp + 2 * h
    total = vocab_size * h + num_hidden_layers * layer + h
    if not tie_word_embeddings:
        total += vocab_size * h
    return total


def expert_params(hidden_size: int, expert_intermediate_size: int, family: str = "") -> int:
    """One expert's gated MLP (gpt-oss's with biases)."""
    weights = 3 * hidden_size * expert_intermediate_size
    return weights + (2 * expert_intermediate_size + hidden_size if family == "gpt_oss" else 0)


def count_active_params(
    params: int,
    *,
    hidden_size: int,
    vocab_size: int,
    num_hidden_layers: int,
    num_experts: int,
    num_experts_per_tok: int,
    expert_intermediate_size: int,
    family: str = "",
) -> int:
    """The weights one token's step reads in a mixture of experts: all but the experts it is not routed to and
    the token embedding (it reads one row of that table). gpt-oss-20b: 3.6B of 20.9B; Qwen3-30B-A3B: 3.0B of 30.5B."""
    idle = (
        num_hidden_layers
        * (num_experts - num_experts_per_tok)
        * expert_params(hidden_size, expert_intermediate_size, family)
    )
    return params - idle - vocab_size * hidden_size


def expert_layers(config: dict[str, Any], layers: int) -> int:
    """The layers that hold experts: every one, or every decoder_sparse_step-th but the mlp_only_layers (Qwen3-MoE,
    Qwen3-Next), as the engine builds them."""
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or [])
    return sum(1 for i in range(layers) if (i + 1) % step == 0 and i not in dense)


def _params_label(params: int) -> str:
    if params >= 1e9:
        return f"{params / 1e9:.1f}".rstrip("0").rstrip(".") + "B"
    return f"{round(params / 1e6)}M"


# ---- arbitrary repos ------------------------------------------------------------------------------------------


def entry_from_config(
    repo_id: str, config: dict[str, Any], size_bytes: int, *, gated: bool = False, license: str = ""
) -> CatalogEntry:
    """A catalog entry for any hub repo, from its config.json and the byte size of the files a download takes.

    Parameters are counted from the config's dimensions when it has them (more exact than the file size, which may
    include a stored copy of a tied output head), else taken as size / bytes per element of the checkpoint dtype.
    `entry.supported` tells whether the engine can run the architecture. Raises ValueError when the config lacks
    what a KV-cache estimate needs."""
    cfg = dict(config or {})
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):  # multimodal wrappers
        cfg = {**cfg["text_config"], "architectures": cfg.get("architectures")}
    archs = list(cfg.get("architectures") or [])
    architecture = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), archs[0] if archs else "")
    family = SUPPORTED_ARCHITECTURES.get(architecture, "")

    def need(key: str, *alternatives: str) -> int:
        for k in (key, *alternatives):
            if isinstance(cfg.get(k), int) and cfg[k] > 0:
                return cfg[k]
        raise ValueError(f"config.json of {repo_id} has no {key}; cannot estimate its memory")

    layers = need("num_hidden_layers", "n_layer", "num_layers")
    heads = need("num_attention_heads", "n_head")
    kv_heads = cfg.get("num_key_value_heads") or heads
    hidden = cfg.get("hidden_size") or cfg.get("n_embd")
    head_dim = cfg.get("head_dim") or (hidden // heads if hidden else None)
    if not head_dim:
        raise ValueError(f"config.json of {repo_id} gives neither head_dim nor hidden_size; cannot estimate its memory")
    ctx = cfg.get("max_position_embeddings") or cfg.get("n_positions") or cfg.get("seq_length") or 2048
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").lower().removeprefix("torch.")
    if dtype not in _DTYPE_BYTES:
        dtype = "bfloat16"
    tie = bool(cfg.get("tie_word_embeddings", True))

    size_bytes = int(size_bytes or 0)
    size_params = size_bytes // _DTYPE_BYTES[dtype] if size_bytes > 0 else 0
    dims = dict(
        hidden_size=hidden,
        intermediate_size=cfg.get("intermediate_size"),
        vocab_size=cfg.get("vocab_size"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
    )
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    expert_width = cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")
    moe = dict(num_experts=experts, moe_intermediate_size=expert_width) if experts else {}
    counted = count_params(**dims, tie_word_embeddings=tie, family=family, **moe) if all(dims.values()) else 0
    if family in (
        "gemma4",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_next",
    ):  # layers unlike one another: counted on transformers' own model
        from app.config_shapes import counted_params

        counted = counted_params(cfg) or 0
    # A checkpoint may store a tied head twice (smaller count) or be a mixture of experts (much larger file):
    # trust the dimension count only when it is plausible against the file size.
    if counted and (not size_params or 0.5 * size_params <= counted <= 1.1 * size_params):
        params = counted
    elif size_params:
        params = size_params
    else:
        raise ValueError(f"cannot tell the parameter count of {repo_id}: no file size and an incomplete config.json")

    active = 0
    per_token = int(cfg.get("num_experts_per_tok") or cfg.get("top_k_experts") or 0)
    if experts and per_token and hidden and expert_width and cfg.get("vocab_size"):
        active = count_active_params(
            params,
            hidden_size=hidden,
            vocab_size=cfg["vocab_size"],
            num_hidden_layers=expert_layers(cfg, layers),
            num_experts=experts,
            num_experts_per_tok=per_token,
            expert_intermediate_size=expert_width,
            family=family,
        )
    from app.config_shapes import kv_shape

    shape = kv_shape(cfg)
    notes = []
    if not family:
        notes.append(
            f"Pagoda's engine cannot run {architecture or 'this architecture'} yet (supported: {SUPPORTED_NAMES})."
        )
    if cfg.get("quantization_config"):
        notes.append("Quantized checkpoint: the estimate assumes unquantized weights.")
    return CatalogEntry(
        repo_id=repo_id,
        params=int(params),
        checkpoint_dtype=dtype,
        download_bytes=size_bytes,
        num_hidden_layers=int(layers),
        num_key_value_heads=int(kv_heads),
        head_dim=int(head_dim),
        max_position_embeddings=int(ctx),
        family=family,
        architecture=architecture,
        hidden_size=hidden,
        intermediate_size=cfg.get("intermediate_size"),
        vocab_size=cfg.get("vocab_size"),
        num_attention_heads=heads,
        tie_word_embeddings=tie,
        num_experts=experts,
        num_experts_per_tok=per_token,
        moe_intermediate_size=cfg.get("moe_intermediate_size"),
        active_params=max(active, 0),
        sliding_window=shape.sliding_window,
        num_sliding_layers=shape.num_sliding_layers,
        num_kv_layers=shape.num_kv_layers,
        kv_width=shape.kv_width,
        state_bytes=shape.state_bytes,
        gated=gated,
        license=license,
        description=" ".join(notes),
        size_is_approximate=False,
    )


def sliding_layers(config: dict[str, Any]) -> tuple[int | None, int]:
    """(sliding window, number of sliding-window layers holding a KV cache) of a config.json, as the engine reads
    them (app/config_shapes.py); (None, 0) for a config it cannot read: the estimate then counts every layer as
    full attention, the safe side."""
    from app.config_shapes import kv_shape

    shape = kv_shape(config)
    return shape.sliding_window, shape.num_sliding_layers


# The estimates and the free-memory measurement lived here before they got modules of their own; scripts that
# import them from here (bench/gpu_laptop.py) still can. Looked up on first use: app.memory_estimate imports this.
_MOVED = {
    "available_memory": "app.device_memory",
    "GiB": "app.device_memory",
    "MiB": "app.device_memory",
    **{
        name: "app.memory_estimate"
        for name in (
            "MemoryEstimate",
            "FitReport",
            "QuantOption",
            "QuantAdvice",
            "QUANTIZATIONS",
            "estimate_memory",
            "weights_bytes",
            "fit_report",
            "quantization_advice",
            "format_gib",
            "quantization_label",
        )
    },
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'app.catalog' has no attribute {name!r}")
