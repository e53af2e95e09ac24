"""A visible chat's decode speed while long background requests run, with and without priority.

    python -m bench.background [--model PATH] [--background 3] [--context 8000] [--chat-tokens 128]
                               [--skip-same-priority]

Open WebUI sends titles, tags and follow-up suggestions as separate requests beside the user's chat.
This starts `--background` requests of `--context` prompt tokens each (priority 1: background), then
a chat (priority 0), and reports the chat's decode tokens/s against the same chat alone, measured in
the same run. The `same priority` row puts the background requests at the chat's priority, which is
what every request got before priorities. Default model: the bundled SmolLM2 (its Q4_1 GGUF).
"""

import argparse
import threading
import time

import torch

from engine import EngineThread, SamplingParams


def chat_rate(engine: EngineThread, prompt: list[int], tokens: int) -> float:
    """Decode tokens/s of one greedy chat reply, from its first token to its last."""
    stream = engine.submit(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    first = None
    count = 0
    for out in stream:
        count += len(out.new_token_ids)
        if first is None and count:
            first, first_count = time.perf_counter(), count
    return (count - first_count) / (time.perf_counter() - first)


def run(engine: EngineThread, args, chat: list[int], background_priority: int | None) -> float:
    """The chat's rate, beside background requests at `background_priority` (None: alone)."""
    streams = []
    if background_priority is not None:
        for i in range(args.background):
            prompt = [(1000 + 7 * i + j) % 40000 + 100 for j in range(args.context)]
            streams.append(
                engine.submit(
                    prompt,
                    SamplingParams(temperature=0, max_tokens=args.background_tokens, ignore_eos=True),
                    priority=background_priority,
                )
            )
        time.sleep(args.head_start)  # they are prefilling when the chat arrives
    rate = chat_rate(engine, chat, args.chat_tokens)
    for stream in streams:
        stream.cancel()
    return rate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="default: the bundled SmolLM2 GGUF")
    ap.add_argument("--background", type=int, default=3)
    ap.add_argument("--context", type=int, default=8000, help="prompt tokens of each background request")
    ap.add_argument("--background-tokens", type=int, default=256)
    ap.add_argument("--chat-tokens", type=int, default=128)
    ap.add_argument("--head-start", type=float, default=2.0, help="seconds the background requests run first")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--skip-same-priority",
        action="store_true",
        help="leave out the same-priority row (at 8k-token contexts it takes many minutes on a CPU)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from engine.loader.bundled import bundled_gguf_path

        args.model = str(bundled_gguf_path())
    # Built in a thread of its own (EngineThread.load): one built here would halve the engine's speed.
    engine = EngineThread.load(
        args.model,
        max_model_len=args.context + args.background_tokens + 16,
        enable_prefix_caching=False,
        max_num_seqs=args.background + 1,
    )
    chat = list(range(2000, 2040))
    try:
        # The compiled decode steps are chosen in the engine's own thread once they have compiled: step
        # until they are, so that "alone" and the rows after it run the same steps.
        while "compiling" in engine.stats().decode:
            chat_rate(engine, chat, 8)
            time.sleep(1)
        print(f"decode steps: {engine.stats().decode}")
        run(engine, args, chat, None)  # warm-up
        alone = run(engine, args, chat, None)
        rows = [("alone", alone)]
        modes = [("background, same priority", 0), ("background, priority 1", 1)]
        for label, priority in modes[1:] if args.skip_same_priority else modes:
            rows.append((label, run(engine, args, chat, priority)))
    finally:
        engine.shutdown()
    print(
        f"chat decode beside {args.background} requests of {args.context} prompt tokens "
        f"({torch.get_num_threads()} threads, {threading.active_count()} Python threads)"
    )
    for label, rate in rows:
        print(f"  {label:28s} {rate:7.1f} tok/s  {rate / alone:5.2f}x alone")


if __name__ == "__main__":
    main()
