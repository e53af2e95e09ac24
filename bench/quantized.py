"""Quantized weights against full precision, in one run: weight bytes, batch-1 decode and prefill.

    python -m bench.quantized [--variants fp32,bf16,int8,int4,int4/g32,gguf] [--decode 128] [--prefill 512]

Variants: `fp32` and `bf16` are the dequantized bundled model (the HF folder) at that dtype; `int8`
and `int4` quantize it at load (`int4/gN`: groups of N columns); `gguf` serves the bundled
Q4_1 file as it is; a path to another .gguf file serves that. `@dtype` sets the activations'
dtype (`int4@float32`); without it the engine's `auto` applies. Every ratio is against `fp32`,
measured in the same run, so machines and loads compare. Decode is one request of
--decode tokens after a 32-token prompt; prefill is one --prefill-token prompt that samples one
token. All variants stay loaded (prefix caching off, so repeats recompute) and are measured in
--rounds rounds; each keeps its best. State the CPU's flags next to the figures (printed).
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
    if "@" in variant:  # activations' dtype, e.g. int4@float32
        variant, dtype = variant.split("@")
        model, settings = load_settings(variant, folder, gguf)
        return model, {**settings, "dtype": dtype}
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


def decode_rate(llm: LLM, tokens: int) -> float:
    """Tokens a second after the first, as llama-bench's tg counts: the time of `tokens` less that of one (the
    32-token prompt's prefill and first token, which is 5% of a 128-token decode on a 30B-A3B-shaped file)."""

    def seconds(count: int) -> float:
        greedy = SamplingParams(temperature=0, max_tokens=count, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([list(range(1000, 1032))], greedy, use_tqdm=False)
        return time.perf_counter() - start

    first = seconds(1)
    return (tokens - 1) / (seconds(tokens) - first)


def prefill_rate(llm: LLM, tokens: int) -> float:
    prompt = [1000 + i % 5000 for i in range(tokens)]
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="fp32,bf16,int8,int4,gguf")
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=3, help="measurements of each variant; the best counts")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from engine.loader.bundled import bundled_gguf_path, bundled_model_path

    folder, gguf = str(bundled_model_path()), str(bundled_gguf_path())
    variants = args.variants.split(",")
    if variants[0] != "fp32":
        variants.insert(0, "fp32")  # the baseline every ratio divides by
    print(f"CPU flags: {cpu_flags()}; threads {args.threads}; torch {torch.__version__}")
    engines, loads, ready = {}, {}, {}
    for variant in variants:
        model, settings = load_settings(variant, folder, gguf)
        start = time.perf_counter()
        engines[variant] = LLM(model, enable_prefix_caching=False, **settings)
        loads[variant] = time.perf_counter() - start
        engines[variant].model_runner.wait_for_compiled_decode()  # compiled CPU decode steps, where they pay
        ready[variant] = time.perf_counter() - start
        decode_rate(engines[variant], 8)  # first calls pay one-time setup
        prefill_rate(engines[variant], 64)
    # Rounds over every variant, keeping each one's best: a burst of load from elsewhere on the machine
    # then costs one round of one variant, not a variant's whole figure.
    decode, prefill = dict.fromkeys(variants, 0.0), dict.fromkeys(variants, 0.0)
    for _ in range(args.rounds):
        for variant, llm in engines.items():
            decode[variant] = max(decode[variant], decode_rate(llm, args.decode))
            prefill[variant] = max(prefill[variant], prefill_rate(llm, args.prefill))
    base = variants[0]
    weight_bytes = {v: sum(llm.parameter_bytes()) for v, llm in engines.items()}
    for variant, llm in engines.items():
        size = weight_bytes[variant]
        print(
            f"{variant:14s} {size / 2**20:7.1f} MiB ({size / weight_bytes[base]:.2f}x)"
            f"  decode {decode[variant]:6.1f} tok/s ({decode[variant] / decode[base]:.2f}x)"
            f"  prefill {prefill[variant]:7.1f} tok/s ({prefill[variant] / prefill[base]:.2f}x)"
            f"  load {loads[variant]:.1f} s (decode ready {ready[variant]:.1f} s)"
            f"  [{llm.stats().quantization}: {llm.stats().matmul}; decode {llm.stats().decode}]"
        )
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
