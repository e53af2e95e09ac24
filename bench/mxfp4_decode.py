"""Decode and prefill speed of gpt-oss's MXFP4 experts on the CPU: kquant.cpp reading the 17-byte blocks as stored
against the dequantizing fallback (what runs without a C++ compiler), alternating in one process (issue 30).

    python -m bench.mxfp4_decode [--layers 2] [--rounds 3] [--decode 16] [--prefill 128]

The checkpoint is bench/mxfp4_load_memory.py's: gpt-oss-20b's widths (32 experts of 2,880, 4 a token) in
transformers' MXFP4 layout, random codes, --layers layers. `kernel` loads it with the kernel on offer, `fallback`
with PAGODA_KQUANT_KERNELS=0 (the chooser then has only the dequantizing kernel). Each round measures both in turn;
each keeps its best round. Decode: one request of --decode tokens after a 32-token prompt.
"""

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

from bench.mxfp4_load_memory import write_checkpoint
from bench.quantized import cpu_flags, decode_rate, prefill_rate
from engine import LLM
from engine.quantization import chooser, kquant

VARIANTS = {"kernel": "1", "fallback": "0"}


def load(folder: Path, variant: str) -> LLM:
    os.environ["PAGODA_KQUANT_KERNELS"] = VARIANTS[variant]
    chooser._CHOICES.clear()  # choices made with other kernels on offer are not this variant's
    chooser._PREFILL_CHOICES.clear()
    llm = LLM(str(folder), enable_prefix_caching=False, enforce_eager=True, kv_cache_memory_bytes=64 << 20)
    experts = llm.model_runner.model.model.layers[0].mlp.experts
    kinds = {type(k).__name__ for p in experts.kernels.values() for k in p}
    print(f"{variant}: experts run {', '.join(sorted(kinds))}", flush=True)
    decode_rate(llm, 2)  # first calls pay one-time setup
    return llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=128)
    args = ap.parse_args()
    if kquant.ops() is None:
        raise SystemExit("the CPU kernel cannot be built here (it needs a C++ compiler and ninja on x86)")
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "gpt-oss-shaped-mxfp4"
        write_checkpoint(folder, args.layers, 32000)
        torch.set_num_threads(threads)  # writing imports the tests' conftest, which sets one thread
        engines = {variant: load(folder, variant) for variant in VARIANTS}
        best = {v: {"decode": 0.0, "prefill": 0.0} for v in VARIANTS}
        for _ in range(args.rounds):
            for variant, llm in engines.items():
                best[variant]["decode"] = max(best[variant]["decode"], decode_rate(llm, args.decode))
                best[variant]["prefill"] = max(best[variant]["prefill"], prefill_rate(llm, args.prefill))
    print(
        json.dumps(
            {
                "cpu": cpu_flags(),
                "threads": torch.get_num_threads(),
                "layers": args.layers,
                **{f"{v}_{k}_tok_s": round(r, 2) for v, rates in best.items() for k, r in rates.items()},
                "decode_ratio": round(best["kernel"]["decode"] / best["fallback"]["decode"], 2),
                "prefill_ratio": round(best["kernel"]["prefill"] / best["fallback"]["prefill"], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
