"""The model catalog (assets/catalog.json) and memory estimates made without downloading anything.

Every entry carries the few config.json numbers a memory estimate needs: parameter count, layers, KV heads,
head size and the trained context length. `estimate_memory` turns them into bytes for weights (at a dtype, or
quantized to int8/int4 at load, or a GGUF file's own size), KV cache and a rough runtime overhead; `fit_report`
compares that with the free memory of a device and writes one sentence a person can act on, and
`quantization_advice` says which quantization fits with how much context and recommends one.
`entry_from_config` does the same for any hub repo the user types, from its config.json.

An entry with a `gguf_file` is served from that one file of its repo (already quantized; `gguf_type` names
its quantization, e.g. "Q4_K_M"); the others from the repo's safetensors.

This module imports neither gradio nor (unless a GPU is asked about) torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CatalogEntry", "MemoryEstimate", "FitReport", "QuantOption", "QuantAdvice", "DEFAULT_CATALOG",
    "SUPPORTED_ARCHITECTURES", "QUANTIZATIONS", "load_catalog", "entry_for_repo", "entry_from_config",
    "estimate_memory", "weights_bytes", "available_memory", "fit_report", "quantization_advice", "count_params",
    "dtype_bytes", "format_gib", "quantization_label",
]

DEFAULT_CATALOG = Path(__file__).resolve().parent.parent / "assets" / "catalog.json"

# config.json `architectures` the engine has a model class for (engine/models/__init__.py), and their family.
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}

GiB = 1024**3
MiB = 1024**2

_DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2,
    "float16": 2, "fp16": 2, "half": 2,
}

# Runtime overhead beyond weights and KV: the Python/torch runtime or CUDA context, activations of one prefill
# chunk, logits and sampler buffers. A rough rule that errs on the generous side for small models.
_OVERHEAD_FIXED = 256 * MiB
_OVERHEAD_WEIGHT_FRACTION = 0.10
# A report says "fits" only when the estimate leaves this share of the free memory unused.
_HEADROOM = 0.90

# What the load form offers: "none" keeps the weights at the chosen dtype; int8/int4 are the engine's weight-only
# quantization at load (LLM(quantization=...)), most precise first.
QUANTIZATIONS = ("none", "int8", "int4")
_QUANT_LABELS = {"none": "full precision", "int8": "int8", "int4": "int4"}
# Columns sharing one int4 scale and zero (the engine's default quantization_group_size).
_INT4_GROUP = 32
# The context a recommendation aims for when none is asked: enough for a real conversation.
_WANTED_CONTEXT = 4096

_REQUIRED = ("repo_id", "params", "checkpoint_dtype", "download_bytes", "num_hidden_layers", "num_key_value_heads",
             "head_dim", "max_position_embeddings")


@dataclass
class CatalogEntry:
    """One chat model. Sizes are approximate unless `size_is_approximate` is False (then they came from the hub)."""

    repo_id: str
    params: int                      # unique parameters (tied embeddings counted once)
    checkpoint_dtype: str            # dtype of the safetensors on the hub, e.g. "bfloat16"
    download_bytes: int              # what a download of the engine's files takes on disk
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    name: str = ""
    family: str = ""                 # "llama", "qwen2", "qwen3" ("" when unknown)
    architecture: str = ""           # config.json architectures[0]
    params_label: str = ""           # "0.6B", "135M"
    hidden_size: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    num_attention_heads: int | None = None
    tie_word_embeddings: bool = True
    gated: bool = False              # the repo needs its license accepted and a logged-in token
    license: str = ""
    bundled: bool = False            # ships with Pagoda and works offline
    gguf_file: str = ""              # the one GGUF file of the repo to fetch and serve ("": safetensors repo)
    gguf_type: str = ""              # its quantization as named in the file name, e.g. "Q4_K_M"
    description: str = ""
    size_is_approximate: bool = True

    def __post_init__(self) -> None:
        if not self.name:
            self.name = self.repo_id.split("/")[-1]
        if not self.params_label:
            self.params_label = _params_label(self.params)

    @property
    def is_gguf(self) -> bool:
        """Served from one GGUF file, whose weights are quantized already (no quantization= at load)."""
        return bool(self.gguf_file)

    @property
    def supported(self) -> bool:
        """Whether Pagoda's engine has a model class for this architecture."""
        return self.architecture in SUPPORTED_ARCHITECTURES

    def kv_bytes_per_token(self, dtype: str = "bfloat16") -> int:
        """K and V for one token across all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes(dtype, self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class MemoryEstimate:
    weights_bytes: int
    kv_bytes: int
    overhead_bytes: int
    total_bytes: int
    context_len: int = 0
    num_seqs: int = 1
    dtype: str = "bfloat16"
    quantization: str = "none"       # "none", "int8", "int4" or "GGUF Q4_K_M"


@dataclass
class FitReport:
    fits: bool
    message: str
    estimate: MemoryEstimate
    free_bytes: int
    device: str = ""                  # the device description the free bytes belong to
    tight: bool = False               # fits, but with less than 10% of the free memory to spare
    max_context_len: int | None = None  # the longest context that fits comfortably (None: not even a short one)


@dataclass
class QuantOption:
    quantization: str                 # "none", "int8" or "int4" ("none" also for a GGUF entry: its own types)
    weights_bytes: int
    max_context_len: int | None       # the longest context that fits comfortably (None: not even a short one)


@dataclass
class QuantAdvice:
    """Which quantization fits this machine, with how much context, and the one to pick."""

    recommended: str | None           # a QUANTIZATIONS value; None when nothing fits
    options: list[QuantOption]        # most precise first; a GGUF entry has just its own
    message: str
    free_bytes: int
    device: str = ""


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
        for k in ("params", "download_bytes", "num_hidden_layers", "num_key_value_heads", "head_dim",
                  "max_position_embeddings"):
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


def count_params(*, hidden_size: int, intermediate_size: int, vocab_size: int, num_hidden_layers: int,
                 num_attention_heads: int, num_key_value_heads: int, head_dim: int,
                 tie_word_embeddings: bool = True, family: str = "llama") -> int:
    """Parameters of a Llama-style decoder (Qwen2 adds q/k/v biases, Qwen3 q/k norms); tied head counted once."""
    h, kv_dim, q_dim = hidden_size, num_key_value_heads * head_dim, num_attention_heads * head_dim
    attn = h * q_dim + 2 * h * kv_dim + q_dim * h
    if family == "qwen2":
        attn += q_dim + 2 * kv_dim
    if family == "qwen3":
        attn += 2 * head_dim
    layer = attn + 3 * h * intermediate_size + 2 * h
    total = vocab_size * h + num_hidden_layers * layer + h
    if not tie_word_embeddings:
        total += vocab_size * h
    return total


def quantization_label(entry: CatalogEntry, quantization: str | None = None) -> str:
    """How the weights are stored, as the estimate and the header name it: "none", "int8", "int4" or
    "GGUF Q4_K_M" (a GGUF entry ignores `quantization`)."""
    if entry.is_gguf:
        return f"GGUF {entry.gguf_type}".rstrip()
    return _check_quantization(quantization)


def _check_quantization(quantization: str | None) -> str:
    name = (quantization or "none").strip().lower()
    if name not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; use none, int8 or int4")
    return name


def weights_bytes(entry: CatalogEntry, dtype: str = "bfloat16", quantization: str | None = None,
                  on_cpu: bool = False) -> int:
    """Bytes the weights take once loaded: at `dtype`, quantized at load (int8: a byte per weight and a bf16 scale
    per row; int4: half a byte plus a bf16 scale and zero per group of 32 columns, with the output head at int8
    as the engine keeps it, shared with a tied embedding), or, for a GGUF entry, the size of its file, whose
    blocks stay quantized in memory.

    `on_cpu`: the engine hands float32 weights to oneDNN in its packed layout there, and a tied output
    head gets a packed copy of its own, apart from the embedding table (engine/layers/linear.py)."""
    if entry.is_gguf:
        return entry.download_bytes
    quant = _check_quantization(quantization)
    elem = dtype_bytes(dtype, entry)
    head = entry.vocab_size * entry.hidden_size if entry.vocab_size and entry.hidden_size else 0
    if quant == "none":
        # Only float32 is counted: half-precision packing needs AVX-512 class CPUs, and where it happens
        # the runtime overhead covers most of the copy.
        extra = head * 4 if on_cpu and entry.tie_word_embeddings and elem == 4 else 0
        return entry.params * elem + extra
    matrix, rows = _matrix_params(entry)
    rest = (entry.params - matrix) * elem  # norms and biases stay at the dtype
    if quant == "int8":
        return matrix + 2 * rows + rest   # a tied head shares the embedding's codes
    per_weight = 0.5 + 4 / _INT4_GROUP
    # the head at int8, a byte a weight (a tied embedding shares it; an untied one is int4 like the layers)
    return int((matrix - head) * per_weight) + head + rest


def _matrix_params(entry: CatalogEntry) -> tuple[int, int]:
    """(weights in the matrices the engine quantizes: linear layers, token embedding, output head; their rows).
    Without the dimensions every parameter counts as a matrix weight, which is within a percent."""
    dims = (entry.hidden_size, entry.intermediate_size, entry.vocab_size, entry.num_attention_heads)
    if not all(dims):
        return entry.params, 0
    h, inter, vocab, heads = dims
    q_dim, kv_dim = heads * entry.head_dim, entry.num_key_value_heads * entry.head_dim
    per_layer = h * (q_dim + 2 * kv_dim) + q_dim * h + 3 * h * inter
    heads_and_embedding = vocab * h * (1 if entry.tie_word_embeddings else 2)
    matrix = entry.num_hidden_layers * per_layer + heads_and_embedding
    rows = (entry.num_hidden_layers * (q_dim + 2 * kv_dim + h + 2 * inter + h)
            + vocab * (1 if entry.tie_word_embeddings else 2))
    return min(matrix, entry.params), rows


def estimate_memory(entry: CatalogEntry, context_len: int, dtype: str = "bfloat16", num_seqs: int = 1,
                    on_cpu: bool = False, quantization: str | None = None) -> MemoryEstimate:
    """Memory to serve `num_seqs` sequences of `context_len` tokens: weights (see `weights_bytes`), the KV cache
    at `dtype`, and the runtime."""
    if int(context_len) <= 0:
        raise ValueError(f"context_len must be positive, got {context_len}")
    if int(num_seqs) <= 0:
        raise ValueError(f"num_seqs must be at least 1, got {num_seqs}")
    weights = weights_bytes(entry, dtype, quantization, on_cpu)
    kv = entry.kv_bytes_per_token(dtype) * int(context_len) * int(num_seqs)
    overhead = _OVERHEAD_FIXED + int(_OVERHEAD_WEIGHT_FRACTION * weights)
    name = dtype.lower().removeprefix("torch.") if dtype != "auto" else entry.checkpoint_dtype
    return MemoryEstimate(weights, kv, overhead, weights + kv + overhead, int(context_len), int(num_seqs), name,
                          quantization_label(entry, quantization))


def _max_context(entry: CatalogEntry, est: MemoryEstimate, free_bytes: int) -> int | None:
    """The longest context (a multiple of 256, at most the trained length) that fits comfortably beside the
    weights and runtime of `est`; None when not even 256 tokens do."""
    per_token = entry.kv_bytes_per_token(est.dtype) * est.num_seqs
    room = free_bytes * _HEADROOM - est.weights_bytes - est.overhead_bytes
    max_ctx = min(int(room // per_token) if room > 0 else 0, entry.max_position_embeddings)
    max_ctx = (max_ctx // 256) * 256
    return max_ctx if max_ctx >= 256 else None


# ---- free memory ----------------------------------------------------------------------------------------------

def available_memory(device: str = "auto") -> tuple[str, int]:
    """(description, free bytes) of a device: "auto" (CUDA when present, else CPU), "cuda[:i]", "mps" or "cpu".

    On CUDA the free bytes come from torch.cuda.mem_get_info, plus what this process holds (its model
    is unloaded before another loads there); on CPU from psutil when installed, else
    /proc/meminfo MemAvailable, else os.sysconf. Asking for CUDA without a usable GPU falls back to the CPU with a
    note in the description.
    """
    dev = (device or "auto").strip().lower()
    note = ""
    if dev == "auto" or dev.startswith("cuda"):
        torch = _torch()
        if torch is not None and torch.cuda.is_available():
            index = torch.device(dev).index if dev.startswith("cuda:") else torch.cuda.current_device()
            from engine.kv_cache import process_memory_info

            free, total = process_memory_info(torch.device("cuda", index))
            # What this process holds there is the model serving now, which goes before another loads
            # on the GPU (app/model_host.py): for the next model, it counts as free.
            free += torch.cuda.memory_reserved(index)
            return f"{torch.cuda.get_device_name(index)} ({total / GiB:.1f} GiB)", int(free)
        if dev != "auto":
            note = "; no CUDA GPU found"
    if dev == "mps":
        torch = _torch()
        total, free = _system_memory()
        if torch is not None and getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return f"Apple GPU (MPS, {total / GiB:.1f} GiB unified memory)", free
        note = "; MPS is not available"
    elif dev not in ("auto", "cpu") and not dev.startswith("cuda"):
        raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda, cuda:N or mps")
    total, free = _system_memory()
    return f"CPU ({total / GiB:.1f} GiB RAM{note})", free


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _system_memory() -> tuple[int, int]:
    """(total, available) bytes of RAM."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)
    try:
        info = {}
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024  # values are in kB
        if "MemAvailable" in info:
            return info.get("MemTotal", info["MemAvailable"]), info["MemAvailable"]
    except (OSError, ValueError, IndexError):
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):
        return 0, 0


# ---- the report -----------------------------------------------------------------------------------------------

def _measure(device: str, free_bytes: int | None, device_name: str | None) -> tuple[int, str]:
    if free_bytes is None or device_name is None:
        measured_name, measured_free = available_memory(device)
        free_bytes = measured_free if free_bytes is None else free_bytes
        device_name = measured_name if device_name is None else device_name
    return int(free_bytes), device_name


def fit_report(entry: CatalogEntry, context_len: int, dtype: str = "bfloat16", device: str = "auto", *,
               num_seqs: int = 1, free_bytes: int | None = None, device_name: str | None = None,
               quantization: str | None = None) -> FitReport:
    """Whether `entry` fits on `device` at this context length and quantization, as a sentence with the numbers
    behind it.

    `free_bytes`/`device_name` override the measurement (tests, or a UI that measured already)."""
    free_bytes, device_name = _measure(device, free_bytes, device_name)
    est = estimate_memory(entry, context_len, dtype, num_seqs, on_cpu=device_name.startswith("CPU"),
                          quantization=quantization)
    budget = free_bytes * _HEADROOM
    max_context = _max_context(entry, est, free_bytes)

    seqs = f" x {est.num_seqs} chats" if est.num_seqs > 1 else ""
    stored = est.dtype if est.quantization == "none" else f"{est.quantization} weights, {est.dtype}"
    head = (f"{entry.name} needs about {format_gib(est.total_bytes)} GiB (weights {format_gib(est.weights_bytes)} + "
            f"KV {format_gib(est.kv_bytes)} at {est.context_len:,} tokens{seqs} + "
            f"{format_gib(est.overhead_bytes)} runtime, "
            f"{stored}); {format_gib(free_bytes)} GiB free on {device_name}")
    tight = False
    if est.total_bytes <= budget:
        fits, verdict = True, ": fits."
    elif est.total_bytes <= free_bytes:
        fits, tight = True, True
        verdict = ": fits, but only just; close other programs or use a shorter context."
    else:
        fits = False
        if max_context is not None:
            verdict = f": does not fit. A context of about {max_context:,} tokens would fit, or pick a smaller model."
        else:
            smaller = ["a smaller model"]
            if not entry.is_gguf and est.quantization != "int4":
                smaller.append("int4 quantization")
            if est.quantization == "none" and dtype_bytes(dtype, entry) > 2:
                smaller.append("a 16-bit dtype")
            verdict = (": does not fit, even with a short context. Pick " + ", ".join(smaller[:-1])
                       + (" or " if len(smaller) > 1 else "") + smaller[-1] + ".")
    message = head + verdict
    if est.context_len > entry.max_position_embeddings:
        message += f" Note: the model was trained for at most {entry.max_position_embeddings:,} tokens."
    return FitReport(fits, message, est, free_bytes, device_name, tight, max_context)


def quantization_advice(entry: CatalogEntry, context_len: int = _WANTED_CONTEXT, dtype: str = "bfloat16",
                        device: str = "auto", *, num_seqs: int = 1, free_bytes: int | None = None,
                        device_name: str | None = None, quantized_dtype: str | None = None) -> QuantAdvice:
    """Which quantization fits `device`, with how much context each leaves, and the one to pick: the most
    precise that leaves room for `context_len` tokens (or the trained length, if shorter), else the one that
    leaves the most. A GGUF entry has only its own types; its advice is "none" (no quantization at load).

    `quantized_dtype` is the dtype of a load whose weights are quantized (at load, or a GGUF's), when it is
    not `dtype`: on a CPU the engine gives those float32 activations and KV cache, which doubles the KV of
    each token, so each option is sized at the dtype its own load gets (`dtype` when None)."""
    free_bytes, device_name = _measure(device, free_bytes, device_name)
    on_cpu = device_name.startswith("CPU")
    free = f"{format_gib(free_bytes)} GiB free"
    kinds = ("none",) if entry.is_gguf else QUANTIZATIONS
    options = []
    for quant in kinds:
        quantized = entry.is_gguf or quant != "none"
        load_dtype = quantized_dtype if quantized and quantized_dtype else dtype
        est = estimate_memory(entry, 256, load_dtype, num_seqs, on_cpu, quantization=quant)
        options.append(QuantOption(quant, est.weights_bytes, _max_context(entry, est, free_bytes)))
    if entry.is_gguf:
        ctx = options[0].max_context_len
        stored = f"The GGUF {entry.gguf_type} file is already quantized"
        if ctx is None:
            message = f"{stored}, and does not fit in {free} even with a short context: pick a smaller model."
            return QuantAdvice(None, options, message, free_bytes, device_name)
        return QuantAdvice("none", options, f"{stored}: it leaves room for {ctx:,} tokens of context in {free}.",
                           free_bytes, device_name)

    wanted = min(int(context_len), entry.max_position_embeddings)
    fitting = [o for o in options if o.max_context_len is not None]
    if not fitting:
        message = f"Does not fit in {free}, even at int4 with a short context: pick a smaller model."
        return QuantAdvice(None, options, message, free_bytes, device_name)
    best = next((o for o in fitting if o.max_context_len >= wanted), None)
    if best is None:
        best = max(fitting, key=lambda o: o.max_context_len)
    short = f"; less than the {wanted:,} asked" if best.max_context_len < wanted else ""
    parts = [f"{_QUANT_LABELS[best.quantization]} leaves room for {best.max_context_len:,} tokens of context "
             f"(recommended{short})"]
    for o in reversed(options):  # the others, smallest first
        if o is not best:
            fits = f"fits {o.max_context_len:,}" if o.max_context_len is not None else "does not fit"
            parts.append(f"{_QUANT_LABELS[o.quantization]} {fits}")
    return QuantAdvice(best.quantization, options, f"Fits in {free}: " + "; ".join(parts) + ".", free_bytes,
                       device_name)


def format_gib(n: int | float) -> str:
    """Bytes as GiB for a sentence: one decimal from 1 GiB up, two below."""
    g = n / GiB
    return f"{g:.1f}" if g >= 1 else f"{g:.2f}"


def _params_label(params: int) -> str:
    if params >= 1e9:
        return f"{params / 1e9:.1f}".rstrip("0").rstrip(".") + "B"
    return f"{round(params / 1e6)}M"


# ---- arbitrary repos ------------------------------------------------------------------------------------------

def entry_from_config(repo_id: str, config: dict[str, Any], size_bytes: int, *, gated: bool = False,
                      license: str = "") -> CatalogEntry:
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
    dims = dict(hidden_size=hidden, intermediate_size=cfg.get("intermediate_size"), vocab_size=cfg.get("vocab_size"),
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    counted = count_params(**dims, tie_word_embeddings=tie, family=family) if all(dims.values()) else 0
    # A checkpoint may store a tied head twice (smaller count) or be a mixture of experts (much larger file):
    # trust the dimension count only when it is plausible against the file size.
    if counted and (not size_params or 0.5 * size_params <= counted <= 1.1 * size_params):
        params = counted
    elif size_params:
        params = size_params
    else:
        raise ValueError(f"cannot tell the parameter count of {repo_id}: no file size and an incomplete config.json")

    notes = []
    if not family:
        notes.append(f"Pagoda's engine cannot run {architecture or 'this architecture'} yet "
                     f"(supported: Llama, Qwen2/2.5, Qwen3 dense).")
    if cfg.get("quantization_config"):
        notes.append("Quantized checkpoint: the estimate assumes unquantized weights.")
    return CatalogEntry(
        repo_id=repo_id, params=int(params), checkpoint_dtype=dtype, download_bytes=size_bytes,
        num_hidden_layers=int(layers), num_key_value_heads=int(kv_heads), head_dim=int(head_dim),
        max_position_embeddings=int(ctx), family=family, architecture=architecture,
        hidden_size=hidden, intermediate_size=cfg.get("intermediate_size"), vocab_size=cfg.get("vocab_size"),
        num_attention_heads=heads, tie_word_embeddings=tie, gated=gated, license=license,
        description=" ".join(notes), size_is_approximate=False,
    )
