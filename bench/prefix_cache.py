"""Time to first token for a new chat whose long system prompt is already in the prefix cache.

    python -m bench.prefix_cache [--system-tokens 1000] [--repeats 3]

A chat is the model's own chat template over a system prompt of about --system-tokens tokens and
a short user message. "Cold" runs each chat on an engine with an empty cache; "cached" runs a new
chat (a different user message) after another chat with the same system prompt. The median of
--repeats runs of each, on the bundled SmolLM2-135M-Instruct in float32 unless told otherwise.
"""

import argparse
import statistics
import time

from engine import LLM, SamplingParams

WORDS = (
    "the cache keeps keys and values of every token so a shared system prompt is computed once and "
    "reused by each new chat that starts with the same words "
).split()


def chat_ids(llm: LLM, system: str, user: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": user}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return llm.tokenizer.encode(text, add_special_tokens=False)


def ttft(llm: LLM, ids: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    return time.perf_counter() - start, out["num_cached_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model folder (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    if args.model is None:
        from engine.loader.bundled import bundled_model_path

        args.model = str(bundled_model_path())
    llm = LLM(args.model, dtype=args.dtype, device="cpu")
    words = []
    while len(llm.tokenizer.encode(" ".join(words))) < args.system_tokens:
        words += WORDS
    cold, warm = [], []
    for r in range(args.repeats):
        system = f"Session {r}. " + " ".join(words)  # a fresh system prompt: nothing of it is cached yet
        seconds, cached = ttft(llm, chat_ids(llm, system, f"First question {r}: what is a KV cache?"))
        cold.append(seconds)
        if cached:
            raise SystemExit(f"the cold run found {cached} cached tokens; the benchmark is broken")
        ids = chat_ids(llm, system, f"Another chat {r}: why share a system prompt?")
        seconds, cached = ttft(llm, ids)
        warm.append(seconds)
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    print(f"chat of {len(ids)} tokens, {cached} of them served by the prefix cache")
    print(f"TTFT cold:   {cold_s * 1000:8.1f} ms (median of {args.repeats})")
    print(f"TTFT cached: {warm_s * 1000:8.1f} ms")
    print(f"speed-up: {cold_s / warm_s:.1f}x")


if __name__ == "__main__":
    main()
