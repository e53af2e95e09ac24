"""Pagoda against llama.cpp on the same GGUF files, batch-1 decode (tg) and prefill (pp), in one run.

    python -m bench.vs_llama_cpp --llama-bench PATH [--files a.gguf,b.gguf] [--rounds 3] [--threads 2]
                                 [--moe-layers N] [--isas native,avx2]

llama.cpp is not a dependency: build it for this bench only (bench/RESULTS.md has the recipe) and pass its
`llama-bench`. Without --files, the bundled Q4_1 file is used. Each round runs llama-bench (`-p 512 -n 128 -r 1`)
and then Pagoda's same-sized decode and prefill on every file, alternating, so a machine that slows down or speeds
up midway (shared VMs do, by 20%) moves both sides of a ratio alike. Each keeps its best round. Pagoda's decode is
one request of --decode tokens after a 32-token prompt, as tg128 is 128 tokens after an empty one. --isas
native,avx2 measures the K-quant kernel's AVX2-only build beside the CPU's own, each in its own engine, in the same
rounds (PAGODA_KQUANT_ISA; an AVX2 machine on an AVX-512 one). Files are measured one at a time.

--moe-layers N adds a random-weight file of Qwen3-30B-A3B's shapes (128 experts of 768, 8 a token; Q4_K_M's mix of
types) cut to N of its 48 layers, written to a temporary folder (the whole model, 18.6 GB, does not fit beside two
engines in a 24 GB machine; each layer is 0.37 GB).
"""

import argparse
import dataclasses
import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from bench.quantized import cpu_flags, decode_rate, prefill_rate
from engine import LLM


def llama_bench(binary: str, file: str, threads: int, prefill: int, decode: int) -> tuple[float, float]:
    """(tg tokens/s, pp tokens/s) of one llama-bench repetition."""
    out = subprocess.run(
        [binary, "-m", file, "-t", str(threads), "-p", str(prefill), "-n", str(decode), "-r", "1", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    results = json.loads(out)
    tg = next(r["avg_ts"] for r in results if r["n_gen"] > 0)
    pp = next(r["avg_ts"] for r in results if r["n_prompt"] > 0)
    return tg, pp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", required=True, help="path of llama.cpp's llama-bench binary")
    ap.add_argument("--files", default="", help="comma-separated GGUF files (default: the bundled Q4_1 file)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--moe-layers", type=int, default=0, help="add a Qwen3-30B-A3B-shaped file of this many layers")
    ap.add_argument(
        "--isas", default="native", help="K-quant kernel builds to measure, each its own engine: native,avx2"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from engine.loader.bundled import bundled_gguf_path

    files = args.files.split(",") if args.files else []
    with tempfile.TemporaryDirectory() as tmp:
        if args.moe_layers:
            files.append(str(moe_file(Path(tmp), args.moe_layers)))
        compare(args, files or [str(bundled_gguf_path())])


def moe_file(folder: Path, layers: int) -> Path:
    from tests.conftest import build_tokenizer
    from tests.shaped_gguf import QWEN3_30B_A3B, write_shaped_gguf

    tokenizer = folder / "tokenizer"
    tokenizer.mkdir()
    build_tokenizer(tokenizer)
    shape = dataclasses.replace(QWEN3_30B_A3B, layers=layers)
    return write_shaped_gguf(folder / f"qwen3-30b-a3b-shaped-{layers}-layers-Q4_K_M.gguf", shape, tokenizer)


def compare(args: argparse.Namespace, files: list[str]) -> None:
    """One file at a time (two engines of an 8B file and llama.cpp's map of it fill a 24 GB machine): its engines,
    one per --isas build of the K-quant kernel, then the rounds."""
    torch.set_num_threads(args.threads)  # again: writing a shaped file imports the tests' conftest, which sets 1
    print(f"CPU flags: {cpu_flags()}; threads {args.threads}; torch {torch.__version__}", flush=True)
    sides = ["llama.cpp"] + [f"pagoda {isa}" for isa in args.isas.split(",")]
    rows = []
    for file in files:
        engines = {}
        for side in sides[1:]:
            os.environ["PAGODA_KQUANT_ISA"] = side.split()[1]
            llm = engines[side] = LLM(file, enable_prefix_caching=False)
            llm.model_runner.wait_for_compiled_decode()
            decode_rate(llm, 8)  # first calls pay one-time setup
            prefill_rate(llm, 64)
        best = {side: [0.0, 0.0] for side in sides}
        for round_ in range(args.rounds):
            measured = {"llama.cpp": llama_bench(args.llama_bench, file, args.threads, args.prefill, args.decode)}
            for side, llm in engines.items():
                measured[side] = (decode_rate(llm, args.decode), prefill_rate(llm, args.prefill))
            for side, (tg, pp) in measured.items():
                best[side] = [max(best[side][0], tg), max(best[side][1], pp)]
            print(
                f"round {round_ + 1} {Path(file).name}: "
                + ", ".join(f"{side} tg {tg:.1f} pp {pp:.0f}" for side, (tg, pp) in measured.items()),
                flush=True,
            )
        (ltg, lpp) = best["llama.cpp"]
        for side, llm in engines.items():
            ptg, ppp = best[side]
            rows.append(
                f"| {Path(file).name} | {side.split()[1]} | {ltg:.1f} | {ptg:.1f} | {ptg / ltg:.2f}x | {lpp:.0f} | "
                f"{ppp:.0f} | {ppp / lpp:.2f}x | {llm.stats().matmul}; decode {llm.stats().decode} |"
            )
            llm.close()
        del engines, llm  # the next file's engines load in this memory
    print(
        f"\n| file | Pagoda's kernel build | llama.cpp tg{args.decode} | Pagoda decode | ratio | llama.cpp "
        f"pp{args.prefill} | Pagoda prefill | ratio | Pagoda's kernels |\n|---|---|---:|---:|---:|---:|---:|---:|---|"
    )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
