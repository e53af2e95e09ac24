"""Decode and prefill speed of GGUF files with the K-quant kernel (engine/quantization/kquant.py) against PyTorch's
kernels, alternating in one process (issue 38).

    python -m bench.kquant_decode --files a.gguf,b.gguf [--variants pytorch,native,avx2] [--rounds 3] [--eager]

Each variant loads every file as its own engine: `pytorch` with the K-quant kernel off (PAGODA_KQUANT_KERNELS=0:
HalvesSplitInt4Matmul, SplitInt4Matmul, Int4PackMatmul), `native` with it built for this CPU, `avx2` with its
AVX2-only build (PAGODA_KQUANT_ISA=avx2); the kernel chooser picks per weight as in any load. Then each round
measures every engine in turn, so a machine that slows down midway moves all alike; each keeps its best round.
Decode is one request of --decode tokens after a 32-token prompt; prefill one of --prefill tokens.
"""

import argparse
import os
from pathlib import Path

import torch

from bench.quantized import cpu_flags, decode_rate, prefill_rate
from engine import LLM
from engine.quantization import chooser

VARIANTS = {
    "pytorch": {"PAGODA_KQUANT_KERNELS": "0"},
    "native": {"PAGODA_KQUANT_KERNELS": "1", "PAGODA_KQUANT_ISA": "native"},
    "avx2": {"PAGODA_KQUANT_KERNELS": "1", "PAGODA_KQUANT_ISA": "avx2"},
}


def load(file: str, variant: str, eager: bool) -> LLM:
    os.environ.update(VARIANTS[variant])
    chooser._CHOICES.clear()  # choices made with other kernels on offer are not this variant's
    chooser._PREFILL_CHOICES.clear()
    llm = LLM(file, enable_prefix_caching=False, enforce_eager=eager)
    if not eager:
        llm.model_runner.wait_for_compiled_decode()
    decode_rate(llm, 8)  # first calls pay one-time setup
    prefill_rate(llm, 64)
    return llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", required=True, help="comma-separated GGUF files")
    ap.add_argument("--variants", default="pytorch,native,avx2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--eager", action="store_true", help="eager decode steps (default: compiled ones)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"CPU flags: {cpu_flags()}; threads {args.threads}; torch {torch.__version__}; "
        f"{'eager' if args.eager else 'compiled'} decode",
        flush=True,
    )
    engines = {}
    for file in args.files.split(","):
        for variant in args.variants.split(","):
            llm = engines[file, variant] = load(file, variant, args.eager)
            print(f"{Path(file).name} {variant}: {llm.stats().matmul}", flush=True)
    best = {key: [0.0, 0.0] for key in engines}
    for round_ in range(args.rounds):
        for key, llm in engines.items():
            tg, pp = decode_rate(llm, args.decode), prefill_rate(llm, args.prefill)
            best[key] = [max(best[key][0], tg), max(best[key][1], pp)]
            print(
                f"round {round_ + 1} {Path(key[0]).name} {key[1]}: decode {tg:.1f} tok/s, prefill {pp:.0f} tok/s",
                flush=True,
            )
    print("\n| file | variant | decode tok/s | vs pytorch | prefill tok/s | vs pytorch |\n|---|---|---|---|---|---|")
    for (file, variant), (tg, pp) in best.items():
        base = best.get((file, "pytorch"))
        ratio = (lambda a, b: f"{a / b:.2f}x") if base else (lambda a, b: "")
        print(
            f"| {Path(file).name} | {variant} | {tg:.1f} | {ratio(tg, base[0]) if base else ''} | {pp:.0f} | "
            f"{ratio(pp, base[1]) if base else ''} |"
        )


if __name__ == "__main__":
    main()
