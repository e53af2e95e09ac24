"""Memory estimates for a catalog entry made without downloading anything: bytes for weights (at a dtype, or
quantized to int8/int4 at load, or a GGUF file's own size), KV cache and a rough runtime overhead
(`estimate_memory`); `fit_report` compares that with the free memory of a device and writes one sentence a
person can act on, and `quantization_advice` says which quantization fits with how much context and recommends
one. The entries and their numbers are app/catalog.py's; free memory is app/device_memory.py's."""

from __future__ import annotations

from dataclasses import dataclass

from app.catalog import CatalogEntry, dtype_bytes
from app.device_memory import GiB, MiB, available_memory
from engine.quantization.methods import METHODS, bytes_per_weight

__all__ = [
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
]

# Runtime overhead beyond weights and KV: the Python/torch runtime or CUDA context, activations of one prefill
# chunk, logits and sampler buffers. A rough rule that errs on the generous side for small models.
_OVERHEAD_FIXED = 256 * MiB
_OVERHEAD_WEIGHT_FRACTION = 0.10
# A report says "fits" only when the estimate leaves this share of the free memory unused.
_HEADROOM = 0.90

# What the load form offers: "none" keeps the weights at the chosen dtype; int8/int4 are the engine's weight-only
# quantization at load (LLM(quantization=...)), most precise first.
QUANTIZATIONS = ("none", *METHODS)
_QUANT_LABELS = {"none": "full precision", **{m: m for m in METHODS}}
# The context a recommendation aims for when none is asked: enough for a real conversation.
_WANTED_CONTEXT = 4096


@dataclass
class MemoryEstimate:
    weights_bytes: int
    kv_bytes: int
    overhead_bytes: int
    total_bytes: int
    context_len: int = 0
    num_seqs: int = 1
    dtype: str = "bfloat16"
    quantization: str = "none"  # "none", "int8", "int4" or "GGUF Q4_K_M"
    windows_release: bool = False  # sliding-window layers hold only their window (CatalogEntry.kv_bytes)
    kv_cache_dtype: str = "auto"  # the KV cache at `dtype`, or quantized: "int8", "fp8", "int4"


@dataclass
class FitReport:
    fits: bool
    message: str
    estimate: MemoryEstimate
    free_bytes: int
    device: str = ""  # the device description the free bytes belong to
    tight: bool = False  # fits, but with less than 10% of the free memory to spare
    max_context_len: int | None = None  # the longest context that fits comfortably (None: not even a short one)


@dataclass
class QuantOption:
    quantization: str  # "none", "int8" or "int4" ("none" also for a GGUF entry: its own types)
    weights_bytes: int
    max_context_len: int | None  # the longest context that fits comfortably (None: not even a short one)


@dataclass
class QuantAdvice:
    """Which quantization fits this machine, with how much context, and the one to pick."""

    recommended: str | None  # a QUANTIZATIONS value; None when nothing fits
    options: list[QuantOption]  # most precise first; a GGUF entry has just its own
    message: str
    free_bytes: int
    device: str = ""


# ---- arithmetic -----------------------------------------------------------------------------------------------


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


def weights_bytes(
    entry: CatalogEntry, dtype: str = "bfloat16", quantization: str | None = None, on_cpu: bool = False
) -> int:
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
        return matrix + 2 * rows + rest  # a tied head shares the embedding's codes
    per_weight = bytes_per_weight("int4", elem)  # the engine's default group size
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
    rows = entry.num_hidden_layers * (q_dim + 2 * kv_dim + h + 2 * inter + h) + vocab * (
        1 if entry.tie_word_embeddings else 2
    )
    return min(matrix, entry.params), rows


def estimate_memory(
    entry: CatalogEntry,
    context_len: int,
    dtype: str = "bfloat16",
    num_seqs: int = 1,
    on_cpu: bool = False,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
) -> MemoryEstimate:
    """Memory to serve `num_seqs` sequences of `context_len` tokens: weights (see `weights_bytes`), the KV cache
    at `dtype` (or `kv_cache_dtype`), and the runtime."""
    if int(context_len) <= 0:
        raise ValueError(f"context_len must be positive, got {context_len}")
    if int(num_seqs) <= 0:
        raise ValueError(f"num_seqs must be at least 1, got {num_seqs}")
    weights = weights_bytes(entry, dtype, quantization, on_cpu)
    kv = entry.kv_bytes(int(context_len), dtype, on_cpu, kv_cache_dtype) * int(num_seqs)
    overhead = _OVERHEAD_FIXED + int(_OVERHEAD_WEIGHT_FRACTION * weights)
    name = dtype.lower().removeprefix("torch.") if dtype != "auto" else entry.checkpoint_dtype
    return MemoryEstimate(
        weights,
        kv,
        overhead,
        weights + kv + overhead,
        int(context_len),
        int(num_seqs),
        name,
        quantization_label(entry, quantization),
        windows_release=on_cpu,
        kv_cache_dtype=kv_cache_dtype,
    )


def _max_context(entry: CatalogEntry, est: MemoryEstimate, free_bytes: int) -> int | None:
    """The longest context (a multiple of 256, at most the trained length) that fits comfortably beside the
    weights and runtime of `est`; None when not even 256 tokens do."""
    room = free_bytes * _HEADROOM - est.weights_bytes - est.overhead_bytes

    def fits(ctx: int) -> bool:
        return entry.kv_bytes(ctx, est.dtype, est.windows_release, est.kv_cache_dtype) * est.num_seqs <= room

    low, high = 0, entry.max_position_embeddings // 256  # in steps of 256 tokens: the KV grows with the context
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid * 256) else (low, mid - 1)
    return low * 256 if low else None


# ---- the report -----------------------------------------------------------------------------------------------


def _window_note(entry: CatalogEntry, est: MemoryEstimate) -> str:
    """What the KV figure counts for a model with sliding-window layers."""
    if not entry.num_sliding_layers:
        return ""
    if est.windows_release:
        return f", its {entry.num_sliding_layers} sliding-window layers holding only their window"
    return ", every layer keeping the whole context (on a GPU the sliding-window saving is still to come)"


def _kv_note(est: MemoryEstimate) -> str:
    return "" if est.kv_cache_dtype == "auto" else f" in {est.kv_cache_dtype}"


def _experts_note(entry: CatalogEntry) -> str:
    """A mixture of experts holds every expert, but each token runs through a few: memory counts the total, speed
    the active parameters."""
    if not entry.active_label:
        return ""
    return (
        f" All {entry.params_label} parameters are held; each token runs through {entry.active_params / 1e9:.1f}B of"
        " them, so it replies about as fast as a dense model of that size."
    )


def _measure(device: str, free_bytes: int | None, device_name: str | None) -> tuple[int, str]:
    if free_bytes is None or device_name is None:
        measured_name, measured_free = available_memory(device)
        free_bytes = measured_free if free_bytes is None else free_bytes
        device_name = measured_name if device_name is None else device_name
    return int(free_bytes), device_name


def fit_report(
    entry: CatalogEntry,
    context_len: int,
    dtype: str = "bfloat16",
    device: str = "auto",
    *,
    num_seqs: int = 1,
    free_bytes: int | None = None,
    device_name: str | None = None,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
) -> FitReport:
    """Whether `entry` fits on `device` at this context length, quantization and KV-cache dtype, as a sentence with
    the numbers behind it.

    `free_bytes`/`device_name` override the measurement (tests, or a UI that measured already)."""
    free_bytes, device_name = _measure(device, free_bytes, device_name)
    on_cpu = device_name.startswith("CPU")
    est = estimate_memory(entry, context_len, dtype, num_seqs, on_cpu, quantization, kv_cache_dtype)
    budget = free_bytes * _HEADROOM
    max_context = _max_context(entry, est, free_bytes)

    seqs = f" x {est.num_seqs} chats" if est.num_seqs > 1 else ""
    stored = est.dtype if est.quantization == "none" else f"{est.quantization} weights, {est.dtype}"
    head = (
        f"{entry.name} needs about {format_gib(est.total_bytes)} GiB (weights {format_gib(est.weights_bytes)} + "
        f"KV {format_gib(est.kv_bytes)} at {est.context_len:,} tokens{seqs}{_kv_note(est)}{_window_note(entry, est)} + "
        f"{format_gib(est.overhead_bytes)} runtime, "
        f"{stored}); {format_gib(free_bytes)} GiB free on {device_name}"
    )
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
            if entry.quantizable and est.quantization != "int4":
                smaller.append("int4 quantization")
            if est.quantization == "none" and dtype_bytes(dtype, entry) > 2:
                smaller.append("a 16-bit dtype")
            verdict = (
                ": does not fit, even with a short context. Pick "
                + ", ".join(smaller[:-1])
                + (" or " if len(smaller) > 1 else "")
                + smaller[-1]
                + "."
            )
    message = head + verdict + _experts_note(entry)
    if est.context_len > entry.max_position_embeddings:
        message += f" Note: the model was trained for at most {entry.max_position_embeddings:,} tokens."
    return FitReport(fits, message, est, free_bytes, device_name, tight, max_context)


def quantization_advice(
    entry: CatalogEntry,
    context_len: int = _WANTED_CONTEXT,
    dtype: str = "bfloat16",
    device: str = "auto",
    *,
    num_seqs: int = 1,
    free_bytes: int | None = None,
    device_name: str | None = None,
    quantized_dtype: str | None = None,
    kv_cache_dtype: str = "auto",
) -> QuantAdvice:
    """Which quantization fits `device`, with how much context each leaves, and the one to pick: the most
    precise that leaves room for `context_len` tokens (or the trained length, if shorter), else the one that
    leaves the most. A GGUF entry has only its own types; its advice is "none" (no quantization at load).

    `quantized_dtype` is the dtype of a load whose weights are quantized (at load, or a GGUF's), when it is
    not `dtype`: on a CPU the engine gives those float32 activations and KV cache, which doubles the KV of
    each token, so each option is sized at the dtype its own load gets (`dtype` when None)."""
    free_bytes, device_name = _measure(device, free_bytes, device_name)
    on_cpu = device_name.startswith("CPU")
    free = f"{format_gib(free_bytes)} GiB free"
    kinds = QUANTIZATIONS if entry.quantizable else ("none",)
    options = []
    for quant in kinds:
        quantized = entry.is_gguf or quant != "none"
        load_dtype = quantized_dtype if quantized and quantized_dtype else dtype
        est = estimate_memory(entry, 256, load_dtype, num_seqs, on_cpu, quant, kv_cache_dtype)
        options.append(QuantOption(quant, est.weights_bytes, _max_context(entry, est, free_bytes)))
    if entry.is_gguf:
        ctx = options[0].max_context_len
        stored = f"The GGUF {entry.gguf_type} file is already quantized"
        if ctx is None:
            message = f"{stored}, and does not fit in {free} even with a short context: pick a smaller model."
            return QuantAdvice(None, options, message, free_bytes, device_name)
        return QuantAdvice(
            "none",
            options,
            f"{stored}: it leaves room for {ctx:,} tokens of context in {free}.",
            free_bytes,
            device_name,
        )

    wanted = min(int(context_len), entry.max_position_embeddings)
    fitting = [o for o in options if o.max_context_len is not None]
    if not fitting:
        message = f"Does not fit in {free}, even at int4 with a short context: pick a smaller model."
        return QuantAdvice(None, options, message, free_bytes, device_name)
    best = next((o for o in fitting if o.max_context_len >= wanted), None)
    if best is None:
        best = max(fitting, key=lambda o: o.max_context_len)
    short = f"; less than the {wanted:,} asked" if best.max_context_len < wanted else ""
    parts = [
        f"{_QUANT_LABELS[best.quantization]} leaves room for {best.max_context_len:,} tokens of context "
        f"(recommended{short})"
    ]
    for o in reversed(options):  # the others, smallest first
        if o is not best:
            fits = f"fits {o.max_context_len:,}" if o.max_context_len is not None else "does not fit"
            parts.append(f"{_QUANT_LABELS[o.quantization]} {fits}")
    return QuantAdvice(
        best.quantization, options, f"Fits in {free}: " + "; ".join(parts) + ".", free_bytes, device_name
    )


def format_gib(n: int | float) -> str:
    """Bytes as GiB for a sentence: one decimal from 1 GiB up, two below."""
    g = n / GiB
    return f"{g:.1f}" if g >= 1 else f"{g:.2f}"
