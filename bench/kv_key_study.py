"""Where a quantized KV cache loses quality, and what a different key format would buy (issue 36): each variant
quantizes and dequantizes keys and/or values inside the model (the cache itself stays in the model's dtype), so
formats the engine does not have yet can be scored before they are built.

    python -m bench.kv_key_study TEXT_FILE [--calibration TEXT_FILE] [--variants int4,int4/keys,int4@pre+mean]

A variant is FORMAT[/keys|/values][@pre][+mean|+rmean]:
- FORMAT: one of the engine's quantized kv_cache_dtypes (int8, fp8, int4), applied as kv_format.py packs and
  unpacks them, after the same Hadamard rotation;
- /keys or /values: quantize only those (default: both);
- @pre: quantize keys before the rotary embedding instead of after it (as KVQuant does), values as always;
- +mean: subtract a per-layer, per-head mean key before quantizing and add it back after (exact for attention: a
  vector added to every key adds the same score to every position), measured on --calibration's first 512 tokens.
  After the rotary embedding such a vector is the same at every position only in the dimensions that barely turn.
- +rmean: the engine's centred keys (engine/attention/key_mean.py): the mean key before the rotary embedding,
  turned to each key's position and subtracted after it; the same as @pre+mean for attention, without moving keys.

Each variant reports perplexity against the unquantized model over the text (windows as bench/quality.py cuts
them) and the mean KL, as bench/quality.py does. For a model whose keys are normalised per head before the rotary
embedding (Qwen3), @pre quantizes before that norm; the bundled SmolLM2 has none.
"""

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from bench.quality import bucketed_kl, score, windows
from engine.attention.kv_format import hadamard, kv_format
from engine.layers.attention import Attention
from engine.layers.rotary_embedding import RotaryEmbedding


class Variant:
    def __init__(self, spec: str, num_layers: int):
        name, self.pre, self.mean, self.rmean = spec, "@pre" in spec, "+mean" in spec, "+rmean" in spec
        name = name.replace("@pre", "").replace("+rmean", "").replace("+mean", "")
        self.mean = self.mean or self.rmean
        name, _, which = name.partition("/")
        if which not in ("", "keys", "values"):
            raise SystemExit(f"variant {spec!r}: after '/' comes keys or values")
        self.format, self.keys, self.values = kv_format(name), which != "values", which != "keys"
        if not self.format.quantized:
            raise SystemExit(f"variant {spec!r}: {name} does not quantize")
        self.num_layers, self.calls = num_layers, 0
        self.sums: dict[int, torch.Tensor] = {}  # layer -> summed keys [heads, head_dim], while calibrating
        self.counts: dict[int, int] = {}
        self.offsets: dict[int, torch.Tensor] = {}

    def quantized(self, x: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
        """x [tokens, heads, head_dim] as the cache would give it back: rotated, packed, unpacked, rotated back."""
        rotation = hadamard(x.shape[-1], x.device)
        y = x.float() - (0 if offset is None else offset)
        y = self.format.unpack(self.format.pack(y @ rotation), torch.float32, x.shape[-1]) @ rotation
        return (y + (0 if offset is None else offset)).to(x.dtype)

    def keys_at(self, k: torch.Tensor, calibrating: bool) -> torch.Tensor:
        layer = self.calls % self.num_layers
        self.calls += 1
        if calibrating:
            self.sums[layer] = self.sums.get(layer, 0) + k.float().sum(0)
            self.counts[layer] = self.counts.get(layer, 0) + len(k)
            return k
        return self.quantized(k, self.offsets.get(layer)) if self.keys else k

    def finish_calibration(self) -> None:
        self.offsets = {layer: total / self.counts[layer] for layer, total in self.sums.items()}
        self.calls = 0


@contextlib.contextmanager
def applied(variant: Variant, calibrating: bool = False) -> Iterator[None]:
    """Patch the attention layer (keys after the rotary embedding, values) or the rotary embedding (keys before it)."""
    attention_forward, rotary_forward = Attention.forward, RotaryEmbedding.forward

    def attend(self, q, k, v, meta):
        if k is not None and not variant.pre and not variant.rmean:
            k = variant.keys_at(k, calibrating)
        if v is not None and variant.values and not calibrating:
            v = variant.quantized(v)
        return attention_forward(self, q, k, v, meta)

    def rotate_rmean(self, positions, qk, num_q_heads, q_norm=None, k_norm=None):
        out = rotary_forward(self, positions, qk, num_q_heads, q_norm, k_norm)
        cos, signed_sin = self._lookup(positions, torch.float32)
        layer = variant.calls % variant.num_layers
        if calibrating:  # the keys before the rotation: rotated back
            variant.keys_at(self.fn(out[:, num_q_heads:].float(), cos, -signed_sin), True)
            return out
        variant.calls += 1
        mean = variant.offsets[layer].expand(len(positions), -1, -1)
        mean_at = self.fn(mean, cos, signed_sin)  # the mean key, rotated to each key's position
        keys = (variant.quantized(out[:, num_q_heads:].float() - mean_at) + mean_at).to(out.dtype)
        return torch.cat((out[:, :num_q_heads], keys), 1)

    def rotate(self, positions, qk, num_q_heads, q_norm=None, k_norm=None):
        keys = variant.keys_at(qk[:, num_q_heads:], calibrating)
        return rotary_forward(self, positions, torch.cat((qk[:, :num_q_heads], keys), 1), num_q_heads, q_norm, k_norm)

    Attention.forward = attend
    if variant.pre:
        RotaryEmbedding.forward = rotate
    elif variant.rmean:
        RotaryEmbedding.forward = rotate_rmean
    try:
        yield
    finally:
        Attention.forward, RotaryEmbedding.forward = attention_forward, rotary_forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("text_file", type=Path)
    ap.add_argument("--calibration", type=Path, default=Path("/usr/share/common-licenses/Apache-2.0"))
    ap.add_argument("--model", help="model folder or hub id (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--variants", default="int4,int4/keys,int4/values,int4+mean,int4@pre+mean,fp8,fp8@pre+mean")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = args.model
    if model is None:
        from engine.loader.bundled import bundled_model_path

        model = str(bundled_model_path())
    from transformers import AutoConfig, AutoTokenizer

    from engine.loader import resolve_model_path

    path = resolve_model_path(model)
    tokenizer, num_layers = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path).num_hidden_layers
    prompts = windows(tokenizer.encode(args.text_file.read_text()), args.window, args.max_tokens)
    calibration = windows(tokenizer.encode(args.calibration.read_text()), 512, 512)
    settings = {"max_model_len": args.window + 1, "enforce_eager": True, "dtype": args.dtype}
    reference = score(model, "none", prompts, settings)
    print(f"{model}: {len(reference.targets)} scored tokens, windows of {args.window}; ppl {reference.perplexity:.4f}")
    print(f"{'variant':<20} {'perplexity':>11} {'Δppl %':>8} {'mean KL*':>10}")
    for spec in args.variants.split(","):
        variant = Variant(spec.strip(), num_layers)
        if variant.mean:
            with applied(variant, calibrating=True):
                score(model, "none", calibration, {**settings, "max_model_len": 513})
            variant.finish_calibration()
        with applied(variant):
            scores = score(model, "none", prompts, settings)
        kl = sum(bucketed_kl(p, q) for p, q in zip(reference.entries, scores.entries, strict=True))
        delta = 100 * (scores.perplexity / reference.perplexity - 1)
        print(f"{spec:<20} {scores.perplexity:>11.4f} {delta:>+8.2f} {kl / len(scores.entries):>10.5f}")
    print("* as in bench/quality.py: a lower bound of the exact KL over each position's top 20 tokens")


if __name__ == "__main__":
    main()
