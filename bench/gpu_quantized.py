"""The GPU goals of quantized weights (issue 14), run by bench/device_check.sh after the main bench:

1. Qwen3-8B's shape with random weights, int4, serves within a laptop's 8 GiB: the allocator is
   capped with `torch.cuda.set_per_process_memory_fraction` and gpu_memory_utilization matches,
   and the KV cache must hold at least 8,192 tokens.
2. Its batch-1 decode against the same model in bf16 (uncapped), in the same run: goal >= 2.5x.
3. Qwen3-0.6B's shape in int4 gives the same greedy tokens as its dequantized reference: a bf16
   checkpoint of exactly the weights the int4 codes stand for, run through the plain path.

    python -m bench.gpu_quantized [--budget-gib 8] [--skip-8b] [--smoke]

`--smoke` runs tiny shapes on the CPU, to check the script itself.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import qwen3_06b_config, save_random_model
from bench.gpu_bench import decode_tps, release_memory
from engine import LLM, SamplingParams

ROWS: list[tuple[str, str, str]] = []


def row(name: str, value: str, note: str = "") -> None:
    ROWS.append((name, value, note))
    print(f"{name}: {value}  {note}", flush=True)


def qwen3_8b_config(num_layers: int | None = None):
    """Qwen3-8B's architecture (from its config.json), optionally with fewer layers."""
    config = qwen3_06b_config(num_layers or 36)
    config.hidden_size, config.intermediate_size = 4096, 12288
    config.num_attention_heads, config.num_key_value_heads = 32, 8
    config.tie_word_embeddings = False
    return config


def dequantized_reference(folder: Path, out: Path, group_size: int) -> Path:
    """A bf16 copy of `folder` whose linear weights are exactly what int4 codes in `group_size` groups
    stand for (the embedding and head too, as the int4 pass quantizes them)."""
    from safetensors.torch import load_file, save_file

    from engine.quantization import quantize_int4

    if (out / ".complete").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for file in folder.iterdir():
        if file.suffix == ".safetensors":
            tensors = load_file(file)
            for name, t in tensors.items():
                if t.dim() == 2:
                    tensors[name] = quantize_int4(t.cuda().float(), group_size).dequantize(torch.bfloat16).cpu()
            save_file(tensors, out / file.name, metadata={"format": "pt"})
        elif file.is_file() and not file.name.startswith("."):
            (out / file.name).write_bytes(file.read_bytes())
    (out / ".complete").touch()
    return out


def serve_8b_in_budget(folder: Path, budget_gib: float, device: str, new_tokens: int) -> float | None:
    total = torch.cuda.get_device_properties(0).total_memory
    share = budget_gib * 2**30 / total
    torch.cuda.set_per_process_memory_fraction(share)
    try:
        start = time.perf_counter()
        llm = LLM(str(folder), quantization="int4", device=device, gpu_memory_utilization=share, max_num_seqs=8)
        load = time.perf_counter() - start
        stats = llm.stats()
        kv_tokens = stats.num_blocks * stats.block_size
        peak = torch.cuda.max_memory_allocated() / 2**30
        row(
            "Qwen3-8B shape int4, load within the budget",
            f"{load:.0f} s",
            f"{budget_gib:g} GiB budget; peak allocated {peak:.2f} GiB; {stats.matmul}",
        )
        row(
            "Qwen3-8B shape int4, KV cache",
            f"{kv_tokens} tokens",
            "goal >= 8,192" + ("" if kv_tokens >= 8192 else " (MISSED)"),
        )
        tps, steps = decode_tps(llm, 128, new_tokens, 1)
        row("Qwen3-8B shape int4, batch-1 decode", f"{tps:.0f} tok/s", steps)
        del llm
        return tps
    finally:
        release_memory()
        torch.cuda.set_per_process_memory_fraction(1.0)


def greedy_matches_reference(folder: Path, reference: Path, device: str, tokens: int) -> None:
    prompts = [[1000 + 37 * i + j for j in range(24)] for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    quantized = LLM(str(folder), quantization="int4", device=device, dtype="bfloat16", max_num_seqs=8)
    got = [r["token_ids"] for r in quantized.generate(prompts, greedy, use_tqdm=False)]
    kernels = quantized.stats().matmul
    del quantized
    release_memory()
    plain = LLM(str(reference), device=device, dtype="bfloat16", max_num_seqs=8)
    want = [r["token_ids"] for r in plain.generate(prompts, greedy, use_tqdm=False)]
    del plain
    release_memory()
    same = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(g)) for g, w in zip(got, want)]
    row(
        "Qwen3-0.6B shape int4 vs dequantized reference, greedy",
        "same" if got == want else "DIFFERS",
        f"tokens equal before the first difference, per prompt: {same} of {tokens}; {kernels}",
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-gib", type=float, default=8.0)
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    root = Path(tempfile.gettempdir())
    layers = 2 if args.smoke else None
    small = qwen3_06b_config(num_layers=layers)
    if args.smoke:
        small.vocab_size, small.hidden_size, small.intermediate_size = 2048, 128, 256
        small.num_attention_heads, small.num_key_value_heads, small.head_dim = 4, 2, 32
    folder = save_random_model(
        small, root / f"pagoda-q-{'smoke' if args.smoke else 'qwen3-0.6b'}", torch.bfloat16, device
    )
    reference = dequantized_reference(folder, root / f"{folder.name}-int4-dequantized", 64) if not args.smoke else None
    if reference is not None:
        greedy_matches_reference(folder, reference, device, 32)
    if not args.skip_8b and not args.smoke:
        big = save_random_model(qwen3_8b_config(), root / "pagoda-qwen3-8b", torch.bfloat16, device)
        int4 = serve_8b_in_budget(big, args.budget_gib, device, 128)
        bf16 = LLM(str(big), device=device, dtype="bfloat16", max_num_seqs=8)
        tps, _ = decode_tps(bf16, 128, 128, 1)
        del bf16
        release_memory()
        row(
            "Qwen3-8B shape bf16, batch-1 decode",
            f"{tps:.0f} tok/s",
            f"int4 is {int4 / tps:.2f}x (goal >= 2.5x)" if int4 else "",
        )
    if args.smoke:
        llm = LLM(str(folder), quantization="int4", device=device, num_kvcache_blocks=64)
        row("smoke: int4 on the CPU", llm.stats().matmul)
    print("\n| quantized GPU check | value | note |\n|---|---:|---|")
    for name, value, note in ROWS:
        print(f"| {name} | {value} | {note} |")
    return 0 if all("MISSED" not in n and "DIFFERS" not in v for _, v, n in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
