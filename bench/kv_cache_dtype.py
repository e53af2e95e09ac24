"""What a quantized KV cache (kv_cache_dtype) holds and costs on this CPU: the tokens a fixed budget holds, and decode
speed at a long context, against `auto` (the model's dtype) in the same run (issue 36).

    python -m bench.kv_cache_dtype [--model M] [--dtypes auto,int8,fp8,int4] [--context 4096] [--budget-mib 256]
                                   [--random-qwen3 FOLDER]

Each dtype loads the model (default: the bundled SmolLM2 Q4_1 GGUF) as its own engine with the same KV budget, and
its decode steps compile as they would for a user (--eager: they run eagerly). Decode speed: a --context-token
prompt is prefilled once; then each round times, for every engine in turn, the prompt answered with 1 token and
with 1 + --decode tokens (both hit the prefix cache for all but the prompt's last block), and takes the
difference; each engine keeps its best round. The first prefill of the prompt is timed once per engine (a cold
cache, so only a rough figure). `--random-qwen3`: a random-weight model of Qwen3-0.6B's shape (28
layers, 8 KV heads of 128) in bfloat16, for a GPU without the bundled model (bench/device_check.sh: 32k context).
"""

import argparse
import time
from pathlib import Path

import torch

from bench.common import qwen3_06b_config, save_random_model
from bench.quantized import cpu_flags
from engine import LLM, SamplingParams
from engine.attention.kv_format import KV_CACHE_DTYPES


def seconds(llm: LLM, prompt: list[int], tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder, hub id or GGUF (default: the bundled SmolLM2 Q4_1 GGUF)")
    ap.add_argument("--dtypes", default="auto,int8,fp8,int4")
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens before decoding")
    ap.add_argument("--decode", type=int, default=32, help="tokens timed per round")
    ap.add_argument("--budget-mib", type=int, default=256, help="the KV cache's memory, the same for every dtype")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", help="the model's dtype (default: the engine's choice for this CPU)")
    ap.add_argument("--eager", action="store_true", help="eager decode steps (default: compiled, which takes minutes)")
    ap.add_argument("--random-qwen3", metavar="FOLDER", help="build and load a random Qwen3-0.6B-shaped model there")
    args = ap.parse_args()
    dtypes = [d.strip() for d in args.dtypes.split(",")]
    unknown = sorted(set(dtypes) - set(KV_CACHE_DTYPES))
    if unknown:
        ap.error(f"unknown KV cache dtypes {unknown}; choose from {KV_CACHE_DTYPES}")
    dtypes = ["auto"] + [d for d in dtypes if d != "auto"]  # the baseline every ratio divides by
    torch.set_num_threads(args.threads)
    model = args.model
    if args.random_qwen3:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = str(save_random_model(qwen3_06b_config(), Path(args.random_qwen3), torch.bfloat16, device))
    elif model is None:
        from engine.loader.bundled import bundled_gguf_path

        model = str(bundled_gguf_path())
    print(f"CPU flags: {cpu_flags()}; threads {args.threads}; torch {torch.__version__}; {model}")

    engines = {}
    for name in dtypes:
        llm = LLM(
            model,
            kv_cache_dtype=name,
            kv_cache_memory_bytes=args.budget_mib << 20,
            max_model_len=args.context + args.decode + 1,
            enforce_eager=args.eager,
            **({"dtype": args.dtype} if args.dtype else {}),
        )
        llm.model_runner.wait_for_compiled_decode()
        engines[name] = llm
    prompt = [1000 + (i * 7919) % 20000 for i in range(args.context)]
    # prefill the context once (its time: one measurement, with the first calls' warm-up), and decode's first calls
    prefill = {name: seconds(llm, prompt, 2) for name, llm in engines.items()}

    best = {name: float("inf") for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            per_token = (seconds(llm, prompt, 1 + args.decode) - seconds(llm, prompt, 1)) / args.decode
            best[name] = min(best[name], per_token)

    base = engines["auto"].stats()
    print(
        f"{'kv_cache_dtype':<15} {'bytes/token':>12} {'tokens held':>12} {'x auto':>7} "
        f"{'decode tok/s @' + str(args.context):>19} {'x auto':>7} {'prefill s':>10} {'x auto':>7}"
    )
    for name, llm in engines.items():
        s = llm.stats()
        held, base_held = s.num_blocks * s.block_size, base.num_blocks * base.block_size
        print(
            f"{name:<15} {s.bytes_per_block // s.block_size:>12,} {held:>12,} {held / base_held:>7.2f} "
            f"{1 / best[name]:>19.1f} {best['auto'] / best[name]:>7.2f} {prefill[name]:>10.2f} "
            f"{prefill[name] / prefill['auto']:>7.2f}"
        )
    print(f"model dtype {base.dtype}; decode: {base.decode}; KV budget {args.budget_mib} MiB for every dtype")


if __name__ == "__main__":
    main()
