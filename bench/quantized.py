"""Quantized weights against full precision, in one run: weight bytes, batch-1 decode and prefill.

    python -m bench.quantized [--variants fp32,bf16,int8,int4,int4/g32,gguf] [--decode 128] [--prefill 512]

Variants: `fp32` and `bf16` are the dequantized bundled model (the HF folder) at that dtype; `int8`
and `int4` quantize it at load (`int4/gN`: groups of N columns); `gguf` serves the bundled
Q4_1 file as it is; a path to another .gguf file serves that. Every ratio is against `fp32`,
measured in the same run, so machines and loads compare. Decode is one request of
--decode tokens after a 32-token prompt (a warm-up request runs first); prefill is one
--prefill-token prompt that samples one token. State the CPU's flags next to the figures
(the script prints them).
"""
import argparse
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "avx_vnni", "fma")
    return " ".join(f for f in wanted if f in flags)


def load_settings(variant: str, folder: str, gguf: str) -> tuple[str, dict]:
    if variant == "fp32":
        return folder, {"dtype": "float32"}
    if variant == "bf16":
        return folder, {"dtype": "bfloat16"}
    if variant == "gguf":
        return gguf, {}
    if variant.endswith(".gguf"):
        return variant, {}
    method, _, group = variant.partition("/g")
    settings = {"quantization": method}
    if group:
        settings["quantization_group_size"] = int(group)
    return folder, settings


def measure(model: str, settings: dict, decode: int, prefill: int) -> dict:
    start = time.perf_counter()
    llm = LLM(model, **settings)
    load = time.perf_counter() - start
    try:
        greedy = SamplingParams(temperature=0, max_tokens=decode, ignore_eos=True)
        prompt = list(range(1000, 1032))
        llm.generate([prompt], greedy, use_tqdm=False)  # first calls pay one-time setup
        start = time.perf_counter()
        llm.generate([prompt], greedy, use_tqdm=False)
        decode_s = time.perf_counter() - start
        long_prompt = [1000 + i % 5000 for i in range(prefill)]
        one = SamplingParams(temperature=0, max_tokens=1)
        llm.generate([long_prompt[:64]], one, use_tqdm=False)
        start = time.perf_counter()
        llm.generate([long_prompt], one, use_tqdm=False)
        prefill_s = time.perf_counter() - start
        stats = llm.stats()
        return {"bytes": sum(llm.parameter_bytes()), "decode": decode / decode_s, "prefill": prefill / prefill_s,
                "load": load, "kernels": stats.matmul}
    finally:
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="fp32,bf16,int8,int4,gguf")
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from engine.loader.bundled import bundled_gguf_path, bundled_model_path

    folder, gguf = str(bundled_model_path()), str(bundled_gguf_path())
    variants = args.variants.split(",")
    if variants[0] != "fp32":
        variants.insert(0, "fp32")  # the baseline every ratio divides by
    print(f"CPU flags: {cpu_flags()}; threads {args.threads}; torch {torch.__version__}")
    rows, base = [], None
    for variant in variants:
        model, settings = load_settings(variant, folder, gguf)
        result = measure(model, settings, args.decode, args.prefill)
        base = base or result
        rows.append((variant, result))
        print(f"{variant:10s} {result['bytes'] / 2**20:8.1f} MiB ({result['bytes'] / base['bytes']:.2f}x)  "
              f"decode {result['decode']:6.1f} tok/s ({result['decode'] / base['decode']:.2f}x)  "
              f"prefill {result['prefill']:7.1f} tok/s ({result['prefill'] / base['prefill']:.2f}x)  "
              f"load {result['load']:.1f} s  [{result['kernels']}]", flush=True)


if __name__ == "__main__":
    main()
