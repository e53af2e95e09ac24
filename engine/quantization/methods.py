"""The quantization Pagoda offers, as facts in one place: the methods, their group size, what a weight
costs in each, how a format is named, and the refusal to quantize weights that are quantized already.

Standard library only: engine/config.py validates its settings with these before PyTorch is installed.
"""

METHODS = ("int8", "int4")
DEFAULT_GROUP_SIZE = 32  # columns per int4 scale and zero, chosen by measurement: bench/RESULTS.md, "int4 group size"


def check_method(method: str | None) -> None:
    if method is not None and method not in METHODS:
        raise ValueError(f"quantization must be one of {METHODS} or None, got {method!r}")


def head_method(method: str | None) -> str | None:
    """How the LM head is stored: int8 under int4 as well. Every logit comes from the head, and 4-bit
    codes there cost SmolLM2 far more perplexity than 4-bit layers do (bench/RESULTS.md, "int4
    head"); llama.cpp's Q4_K_M keeps its output at 6 bits for the same reason."""
    return "int8" if method == "int4" else method


def bytes_per_weight(method: str | None, dtype_bytes: int, group_size: int = DEFAULT_GROUP_SIZE) -> float:
    """What one weight of a matrix costs once its layer is packed: None keeps `dtype_bytes`; int8 is a byte
    (and a bf16 scale per row, left to the caller, who knows the rows); int4 half a byte and a bf16 scale and
    zero per group of `group_size` columns."""
    check_method(method)
    if method is None:
        return dtype_bytes
    return 1 if method == "int8" else 0.5 + 4 / group_size


def describe(method: str | None, group_size: int, stored: str | None = None) -> str:
    """How the weights are stored, as stats() says it: "none", "int8", "int4 (groups of 32; LM head int8)",
    or the checkpoint's own format, `stored` ("GGUF Q4_K, Q6_K", "MXFP4 experts")."""
    if stored is not None:
        return stored
    if method == "int4":
        return f"int4 (groups of {group_size}; LM head {head_method(method)})"
    return method or "none"


def refuse_requantizing(method: str | None, stored_as: str, what: str = "this checkpoint") -> None:
    """Quantizing codes again would only lose precision: say so rather than do it."""
    if method is not None:
        raise ValueError(f"{what} is already quantized ({stored_as}); load it without quantization={method!r}")
