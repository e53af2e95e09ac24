"""Offline throughput: the engine against transformers' `generate`, same model, same run.

    python -m bench.throughput [--num-requests 32] [--input 32 384] [--output 16 160]

nano-vllm's workload: random-token prompts with per-request input and output lengths, and
ignore_eos, so every request produces exactly the tokens it asked for. transformers runs static
batches (padded prompts, every row decoding to the batch's longest request); only the requested
tokens are counted for it. A batch-1 decode comparison follows. Defaults: the bundled
SmolLM2-135M-Instruct in float32 on the CPU.
"""

import argparse
import random
import time

import torch

from engine import LLM, SamplingParams


def hf_static_batches(model, prompts, outputs, batch_size, pad_id) -> float:
    """Seconds for transformers to produce every requested token, in static left-padded batches."""
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk, lens = prompts[i : i + batch_size], outputs[i : i + batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        n = max(lens)
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad_id
        )
    return time.perf_counter() - start


def decode_rate(run, n: int, repeats: int = 3) -> float:
    """Tokens/s of decoding alone: time(prompt + n tokens) - time(prompt + 1 token), the median of
    `repeats` measurements, because one run on two shared cores can be off by 15%."""
    run(n)  # warm-up
    rates = sorted((n - 1) / (run(n) - run(1)) for _ in range(repeats))
    return rates[len(rates) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model folder (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--input", type=int, nargs=2, default=(32, 384), metavar=("MIN", "MAX"))
    ap.add_argument("--output", type=int, nargs=2, default=(16, 160), metavar=("MIN", "MAX"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--hf-batch-size", type=int, default=None, help="static batch size for transformers (default: all requests)"
    )
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from engine.loader.bundled import bundled_model_path

        args.model = str(bundled_model_path())
    import transformers

    rng = random.Random(args.seed)
    llm = LLM(args.model, dtype=args.dtype, device="cpu")
    vocab = llm.model_runner.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*args.input))] for _ in range(args.num_requests)]
    outputs = [rng.randint(*args.output) for _ in range(args.num_requests)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    total = sum(outputs)
    print(
        f"{args.num_requests} requests, {sum(map(len, prompts))} prompt tokens, {total} output tokens, "
        f"{args.dtype}, {torch.get_num_threads()} threads",
        flush=True,
    )

    warmup = [[rng.randrange(vocab) for _ in range(64)] for _ in range(2)]  # random: shares no prefix with the run
    llm.generate(warmup, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    engine_s = time.perf_counter() - start
    if sum(len(r["token_ids"]) for r in results) != total:
        raise SystemExit("the engine produced a different number of tokens than requested")

    hf = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    pad_id = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    with torch.inference_mode():
        hf_s = hf_static_batches(hf, prompts, outputs, args.hf_batch_size or args.num_requests, pad_id)

    print(f"engine:       {total / engine_s:8.1f} output tok/s ({engine_s:.1f} s)")
    print(
        f"transformers: {total / hf_s:8.1f} output tok/s ({hf_s:.1f} s, static batches of "
        f"{args.hf_batch_size or args.num_requests})"
    )
    print(f"throughput ratio engine / transformers: {hf_s / engine_s:.2f}x")

    prompt = prompts[0][:128]

    def engine_run(n):
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    def hf_run(n):
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(
                torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad_id
            )
        return time.perf_counter() - t

    ours, theirs = decode_rate(engine_run, args.decode_tokens), decode_rate(hf_run, args.decode_tokens)
    print(f"batch-1 decode: engine {ours:.1f} tok/s, transformers {theirs:.1f} tok/s, ratio {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
