"""What quantization costs in quality: perplexity, and KL divergence from the full-precision model.

    python -m bench.quality TEXT_FILE [--model M] [--variants none,int8,int4,gguf,kv:int8] [--max-tokens N] [--window W]

The text is tokenized and cut into windows of --window tokens (at most --max-tokens in all); each
variant scores every window through the engine's `prompt_logprobs`, so the numbers come from the
same paged, chunked path that serves chats. Variant `none` is the model as loaded (the reference;
it runs first even when not listed); `int8`, `int4` and `int4/gN` (groups of N) are passed as
`LLM(model, quantization=...)`; `gguf` is the bundled model's own Q4_1 file (whose dequantized
weights the default model folder holds) and a path to a .gguf file is served as it is. `kv:int8`,
`kv:fp8` and `kv:int4` keep the weights and quantize the KV cache (`kv_cache_dtype`): every scored
window's keys and values are written to the cache and read back from it. A variant the engine
cannot load is reported and skipped.

- Perplexity: exp of the mean negative logprob of each token after the first of its window.
- Mean KL: KL(reference || variant) per position, averaged. The engine returns the top
  MAX_LOGPROBS (20) tokens of each distribution, not the whole vocabulary, so each position's KL
  is taken over the tokens both top lists hold (their logprobs are exact) plus one bucket holding
  the rest of the mass on each side. Merging tokens into one bucket can only lower a KL divergence,
  so this is a lower bound of the exact KL; it is close to exact where the top 20 hold nearly all
  the mass (most positions of a small model's distribution), and it counts every difference in the
  tokens that matter most.
- Weight bytes: what the engine holds for the weights (`LLM.parameter_bytes()`, all ranks).
"""

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from engine import LLM, SamplingParams
from engine.front.sampling_params import MAX_LOGPROBS

Entries = list[dict[int, float]]  # per scored position: {token_id: logprob}, the actual token and the top k


@dataclass
class Scores:
    variant: str
    entries: Entries  # every window's prompt logprobs after its first token, in order
    targets: list[int]  # the actual token at each of those positions
    weight_bytes: int | None

    @property
    def perplexity(self) -> float:
        return math.exp(-sum(e[t] for e, t in zip(self.entries, self.targets, strict=True)) / len(self.targets))


def windows(token_ids: list[int], window: int, max_tokens: int) -> list[list[int]]:
    token_ids = token_ids[:max_tokens]
    return [token_ids[i : i + window] for i in range(0, len(token_ids), window) if len(token_ids[i : i + window]) > 1]


def variant_load(model: str, variant: str, settings: dict) -> tuple[str, dict]:
    """(what to load, its settings) for a variant: `none`; `int8`, `int4`, `int4/gN` (groups of N);
    `gguf` (the bundled model's own Q4_1 file); a path to a .gguf file; or `kv:NAME` (the KV cache's dtype)."""
    if variant == "none":
        return model, dict(settings)
    if variant.startswith("kv:"):
        return model, {**settings, "kv_cache_dtype": variant.removeprefix("kv:")}
    if variant == "gguf":
        from engine.loader.bundled import bundled_gguf_path

        return str(bundled_gguf_path()), dict(settings)
    if variant.endswith(".gguf"):
        return variant, dict(settings)
    method, _, group = variant.partition("/g")
    return model, {**settings, "quantization": method, **({"quantization_group_size": int(group)} if group else {})}


def score(model: str, variant: str, prompts: list[list[int]], settings: dict) -> Scores:
    model, kwargs = variant_load(model, variant, settings)
    llm = LLM(model, **kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=MAX_LOGPROBS)
        results = llm.generate(prompts, params, use_tqdm=False)
        weight_bytes = sum(llm.parameter_bytes()) if hasattr(llm, "parameter_bytes") else None
    finally:
        llm.close()
    entries = [e for r in results for e in r["prompt_logprobs"][1:]]
    targets = [t for p in prompts for t in p[1:]]
    return Scores(variant, entries, targets, weight_bytes)


def bucketed_kl(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(p || q) over the tokens both hold, plus one bucket for the rest of each side's mass (a lower
    bound of the exact KL; see the module docstring)."""
    shared = p.keys() & q.keys()
    kl = sum(math.exp(p[t]) * (p[t] - q[t]) for t in shared)
    rest_p = max(0.0, 1.0 - sum(math.exp(p[t]) for t in shared))
    rest_q = max(1e-12, 1.0 - sum(math.exp(q[t]) for t in shared))
    if rest_p > 1e-12:
        kl += rest_p * math.log(rest_p / rest_q)
    return max(0.0, kl)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("text_file", type=Path, help="a plain-text file to score (e.g. a wikitext-2 test split)")
    ap.add_argument("--model", help="HF model folder or hub id (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--variants", default="none,int8,int4", help="comma-separated quantization names; none = as loaded")
    ap.add_argument("--max-tokens", type=int, default=4096, help="tokens of the text to score (default 4096)")
    ap.add_argument("--window", type=int, default=512, help="tokens per scored window (default 512)")
    ap.add_argument("--dtype", help="weights' dtype for every variant (default: the engine's choice)")
    args = ap.parse_args()
    if args.window < 2 or args.max_tokens < 2:
        ap.error("--window and --max-tokens must be at least 2 (a window's first token is not scored)")
    model = args.model
    if model is None:
        from engine.loader.bundled import bundled_model_path

        model = str(bundled_model_path())
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    variants = ["none"] + [v for v in variants if v != "none"]
    # Eager: scoring runs no decode step, and generate() would wait for the decode steps to compile (minutes)
    settings = {
        "max_model_len": args.window + 1,
        "enforce_eager": True,
        **({"dtype": args.dtype} if args.dtype else {}),
    }

    from transformers import AutoTokenizer

    from engine.loader import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model))
    prompts = windows(tokenizer.encode(args.text_file.read_text()), args.window, args.max_tokens)
    if not prompts:
        raise SystemExit(f"{args.text_file} has fewer than 2 tokens; give a longer text")
    print(f"{model}: {sum(len(p) - 1 for p in prompts)} scored tokens in {len(prompts)} windows of up to {args.window}")

    rows, reference = [], None
    for variant in variants:
        try:
            scores = score(model, variant, prompts, settings)
        except (TypeError, ValueError, NotImplementedError) as e:  # e.g. no quantization= setting on this engine
            print(f"variant {variant}: skipped ({type(e).__name__}: {e})")
            continue
        reference = reference or scores
        kl = sum(bucketed_kl(p, q) for p, q in zip(reference.entries, scores.entries, strict=True))
        rows.append((scores, kl / len(scores.entries)))

    have_bytes = any(s.weight_bytes is not None for s, _ in rows)
    header = f"{'variant':<10} {'perplexity':>11} {'Δppl %':>8} {'mean KL*':>10}" + (
        f" {'weight bytes':>14}" if have_bytes else ""
    )
    print(header)
    print("-" * len(header))
    for scores, kl in rows:
        delta = 100 * (scores.perplexity / reference.perplexity - 1)
        line = f"{scores.variant:<10} {scores.perplexity:>11.4f} {delta:>+8.2f} {kl:>10.5f}"
        if have_bytes:
            line += f" {scores.weight_bytes:>14,}" if scores.weight_bytes is not None else f" {'-':>14}"
        print(line)
    print(
        f"* KL(reference || variant) over each position's top {MAX_LOGPROBS} tokens plus one bucket for the rest: "
        "a lower bound of the exact KL (see the docstring)"
    )


if __name__ == "__main__":
    main()
