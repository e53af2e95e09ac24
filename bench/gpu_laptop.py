"""Laptop GPUs (issue 16): the catalog's Qwen3-1.7B and Qwen3-4B, random weights in their exact shapes, on a GPU
capped at a laptop's memory with `torch.cuda.set_per_process_memory_fraction`. For each, what the app would do:

1. Ask the catalog which quantization fits this (capped) GPU and with how much context (`quantization_advice`,
   which measures the GPU as the Models tab does).
2. Load with the app's defaults (`max_num_seqs` of `--max-chats`, `gpu_memory_utilization` as set, CUDA graphs
   on) and that quantization: no out-of-memory error, graphs captured, the KV cache's tokens reported against
   the catalog's estimate.
3. Run a full batch of chats and a batch-1 decode, and report the peak memory against the cap.

    python -m bench.gpu_laptop [--budget-gib 8] [--models Qwen/Qwen3-1.7B,Qwen/Qwen3-4B] [--smoke]

`--smoke` runs a tiny shape on the CPU, to check the script itself.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from app.catalog import CatalogEntry, available_memory, entry_for_repo, quantization_advice
from bench.common import save_random_model
from bench.gpu_bench import VOCAB, decode_tps, release_memory
from engine import LLM, SamplingParams

ROWS: list[tuple[str, str, str]] = []
APP_MAX_CHATS = 16  # app/server.py's --max-chats default (the device has no gradio to import it from; a test compares)


def row(name: str, value: str, note: str = "") -> None:
    ROWS.append((name, value, note))
    print(f"{name}: {value}  {note}", flush=True)


def entry_config(entry: CatalogEntry, num_layers: int | None = None):
    """The transformers config of a catalog entry's architecture (its numbers come from the repo's config.json)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=entry.vocab_size,
        hidden_size=entry.hidden_size,
        intermediate_size=entry.intermediate_size,
        num_hidden_layers=num_layers or entry.num_hidden_layers,
        num_attention_heads=entry.num_attention_heads,
        num_key_value_heads=entry.num_key_value_heads,
        head_dim=entry.head_dim,
        max_position_embeddings=entry.max_position_embeddings,
        tie_word_embeddings=entry.tie_word_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        attention_bias=False,
        bos_token_id=151643,
        eos_token_id=151645,
        architectures=[entry.architecture],
    )


def check_model(entry: CatalogEntry, folder: Path, device: str, max_chats: int, budget_gib: float | None) -> None:
    name = entry.name
    device_name, free = available_memory(device)
    advice = quantization_advice(entry, device=device, free_bytes=free, device_name=device_name)
    row(f"{name}: the catalog's advice", advice.recommended or "nothing fits", advice.message)
    if advice.recommended is None:
        row(f"{name}: loads", "MISSED", "the catalog says it does not fit")
        return
    quantization = None if advice.recommended == "none" else advice.recommended
    predicted = next(o.max_context_len for o in advice.options if o.quantization == advice.recommended)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        llm = LLM(
            str(folder),
            quantization=quantization,
            device=device,
            max_num_seqs=max_chats,
            **({} if device == "cuda" else {"num_kvcache_blocks": 64}),
        )
    except (RuntimeError, torch.OutOfMemoryError) as e:
        row(f"{name}: loads", "MISSED", f"{type(e).__name__}: {str(e).splitlines()[0]}")
        return
    try:
        stats = llm.stats()
        kv_tokens = stats.num_blocks * stats.block_size
        row(
            f"{name}: loads ({advice.recommended})",
            f"{time.perf_counter() - start:.0f} s",
            f"decode: {stats.decode}; {stats.matmul}",
        )
        row(
            f"{name}: KV cache",
            f"{kv_tokens:,} tokens",
            f"the catalog estimated {predicted:,} tokens of context; max_model_len {stats.max_model_len:,}",
        )
        prompts = [[1000 + 37 * i + j for j in range(200)] for i in range(max_chats)]
        out = llm.generate(prompts, SamplingParams(temperature=0.8, max_tokens=64, ignore_eos=True), use_tqdm=False)
        row(
            f"{name}: {max_chats} chats at once",
            f"{sum(len(r['token_ids']) for r in out)} tokens",
            f"{llm.stats().num_preemptions} preemptions",
        )
        VOCAB[0] = min(VOCAB[0], entry.vocab_size if device == "cuda" else 2048)  # decode_tps's random prompt ids
        tps, _ = decode_tps(llm, 128, 64, 1)
        peak = torch.cuda.max_memory_reserved() / 2**30 if device == "cuda" else 0.0
        within = budget_gib is None or peak <= budget_gib
        row(
            f"{name}: batch-1 decode",
            f"{tps:.0f} tok/s",
            f"peak reserved {peak:.2f} GiB" + ("" if within else f" (MISSED: over the {budget_gib:g} GiB cap)"),
        )
    except (RuntimeError, torch.OutOfMemoryError) as e:
        row(f"{name}: serves", "MISSED", f"{type(e).__name__}: {str(e).splitlines()[0]}")
    finally:
        llm.close()
        del llm
        release_memory()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-gib", type=float, default=8.0)
    ap.add_argument("--models", default="Qwen/Qwen3-1.7B,Qwen/Qwen3-4B")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    max_chats = 2 if args.smoke else APP_MAX_CHATS
    root = Path(tempfile.gettempdir())
    models = []
    for repo in args.models.split(","):
        entry = entry_for_repo(repo)
        if entry is None:
            raise SystemExit(f"{repo} is not in the catalog (assets/)")
        config = entry_config(entry, num_layers=2 if args.smoke else None)
        if args.smoke:
            config.vocab_size, config.hidden_size, config.intermediate_size = 2048, 128, 256
            config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 32
        name = f"pagoda-laptop-{repo.split('/')[-1]}{'-smoke' if args.smoke else ''}"
        models.append((entry, save_random_model(config, root / name, torch.bfloat16, device)))
    release_memory()
    budget = None
    if device == "cuda":  # capped after the checkpoints are written: a 4B model in bf16 is 8 GB on its own
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.budget_gib * 2**30 / total))
        budget = args.budget_gib
    for entry, folder in models:
        check_model(entry, folder, device, max_chats, budget)
    print(f"\n| laptop GPU check ({args.budget_gib:g} GiB cap) | value | note |\n|---|---:|---|")
    for name, value, note in ROWS:
        print(f"| {name} | {value} | {note} |")
    return 0 if all("MISSED" not in v and "MISSED" not in n for _, v, n in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
