"""The engine's own host work per decode step: scheduling, step inputs, sampling bookkeeping.

    python -m bench.host_overhead [--batch 256] [--repeats 7] [--async-scheduling]

On a GPU this work runs between the graph replays, so it adds to every step. Here the model
runner's `execute` (moving the inputs to the device, the forward, the logits) is replaced by
zero logits, so what is timed is the Python around it, at a batch of running requests. Prints
the fastest and the median of `repeats` rounds of 40 steps (the fastest is the least disturbed
by other processes), and the garbage collector's pauses.
"""

import argparse
import gc
import random
import tempfile
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--async-scheduling", action="store_true", help="the GPU's default mode (the CPU's is synchronous)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from tests.conftest import build_model

    folder = Path(tempfile.gettempdir()) / "pagoda-bench-tiny-qwen3"
    if not (folder / "config.json").is_file():
        build_model(folder, "qwen3")
    llm = LLM(
        str(folder),
        device="cpu",
        dtype="float32",
        max_num_seqs=args.batch,
        num_kvcache_blocks=40000,
        max_model_len=4096,
        async_scheduling=args.async_scheduling,
    )
    runner = llm.model_runner
    runner.execute = lambda step: torch.zeros(len(step.logits_index), runner.vocab_size)
    mode = "async" if args.async_scheduling else "sync"
    rng = random.Random(0)
    for _ in range(args.batch):
        params = SamplingParams(temperature=0, max_tokens=10**5, ignore_eos=True)
        rid = llm.add_request([rng.randrange(5, 200) for _ in range(500)], params)
        llm.requests[rid].stream_text = False  # as in generate(): text is decoded once, at the end
    while llm.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in llm.scheduler.running):
        llm.step()

    pauses, started = [], [0.0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - started[0])

    gc.callbacks.append(on_gc)
    rounds = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        for _ in range(40):
            llm.step()
        rounds.append((time.perf_counter() - t) / 40 * 1000)
    rounds.sort()
    print(
        f"decode step host work at batch {args.batch} ({mode}): fastest {rounds[0]:.2f} ms, median "
        f"{rounds[len(rounds) // 2]:.2f} ms ({1000 * rounds[0] / args.batch:.1f} us a request); "
        f"{len(pauses)} GC pauses, longest {1000 * max(pauses, default=0):.1f} ms"
    )


if __name__ == "__main__":
    main()
