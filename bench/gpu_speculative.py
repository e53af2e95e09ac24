"""Speculative decoding on a GPU (issue 32): decode tok/s with drafts against plain decoding, at batch 1 and 16, on
a random-weight model of Qwen3-0.6B's shape, in the same run.

    python -m bench.gpu_speculative [--smoke]

Random weights repeat nothing, so drafts are chosen for what they show:
- the model as its own draft (k = 4): every draft is accepted, k + 1 tokens a step, so the ratio is what checking
  rows and running a draft cost on this GPU at best;
- n-gram (k = 4, never sitting out): its drafts all fail, so the ratio is what checking useless rows costs;
- n-gram at the GPU's default threshold: what a user gets when drafts do not pay.
`--smoke` runs every path on the CPU with a 2-layer model, for checking the script.
"""

import argparse
import tempfile
from pathlib import Path

import torch

from bench.common import qwen3_06b_config, save_random_model
from bench.gpu_bench import FAILURES, ROWS, decode_tps, row, section
from engine import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script, measures nothing")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    new_tokens, prompt_len = (8, 16) if args.smoke else (128, 512)
    with tempfile.TemporaryDirectory() as tmp:
        config = qwen3_06b_config(2 if args.smoke else None)
        folder = save_random_model(config, Path(tmp) / "model", torch.bfloat16, device)
        settings = {"device": device, "dtype": "bfloat16", "max_model_len": 2048}
        if args.smoke:
            settings |= {"num_kvcache_blocks": 256, "enforce_eager": True}
        variants = {
            "plain": None,
            "itself as draft k=4": {"method": "draft", "model": str(folder), "num_speculative_tokens": 4},
            "ngram k=4, min 0": {"method": "ngram", "num_speculative_tokens": 4, "min_acceptance_rate": 0},
            "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4},
        }
        base: dict[int, float] = {}
        for name, spec in variants.items():
            with section(f"speculative {name}"):
                llm = LLM(str(folder), speculative_config=spec, **settings)
                for batch in (1, 16):
                    tps, note = decode_tps(llm, prompt_len, new_tokens, batch)
                    base.setdefault(batch, tps)
                    stats = llm.stats()
                    per_step = stats.spec_mean_accepted_length if stats.spec_steps else 1.0
                    row(
                        f"{name}, batch {batch}",
                        f"{tps:,.0f} tok/s",
                        f"{tps / base[batch]:.2f}x plain; {per_step:.2f} tokens/step; {note}",
                    )
                llm.close()
    print("\n" + "\n".join(f"{n:<44} {v:>16}  {x}" for n, v, x in ROWS))
    if FAILURES:
        raise SystemExit(f"failed: {', '.join(FAILURES)}")


if __name__ == "__main__":
    main()
