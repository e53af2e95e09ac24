"""KV blocks a Gemma-3-4B-shaped model holds at long context, with its KV-cache groups, against the same model laid
out as all-global (one group of every layer, as the engine ran it before the groups), from `stats()`.

    python -m bench.sliding_window_memory [--context 32768] [--system-tokens 2000]

The network has Gemma 3 4B's attention layout (34 layers, a global one after every five sliding ones, a 1,024-token
window) and tiny widths with random weights: the KV bookkeeping is the model's, and 32k tokens of prefill run on a
laptop's CPU in minutes. It prefills one --context-token prompt and records, after every step, the blocks running
requests hold and how many layers a block holds; the ratio is their product against the all-global layout's
(ceil(context / block_size) blocks of every layer). Then two chats share a --system-tokens system prompt: the second
must get it from the prefix cache (a sliding group needs the blocks of its last window before the hit).
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
import transformers

from engine import LLM, SamplingParams

GEMMA_3_4B = dict(num_hidden_layers=34, sliding_window=1024, sliding_window_pattern=6)


def build(folder: Path, window: int = GEMMA_3_4B["sliding_window"]) -> Path:
    """A Gemma-3-4B-shaped text model with tiny widths and random weights, and a tokenizer; `window`: its sliding
    window (a test's shorter context keeps the proportions with a shorter one)."""
    from tests.conftest import build_tokenizer  # the tests' tiny tokenizer: a bench is run from the repo

    layers = GEMMA_3_4B["num_hidden_layers"]
    kinds = [
        "full_attention" if (i + 1) % GEMMA_3_4B["sliding_window_pattern"] == 0 else "sliding_attention"
        for i in range(layers)
    ]
    config = transformers.Gemma3TextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=window,
        layer_types=kinds,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).save_pretrained(folder)
    build_tokenizer(folder)
    return folder


def held_after_each_step(llm: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    """The blocks running requests hold after each step of one request (its prefill chunks, then its decode; after
    the last step it has finished, and holds none)."""
    held, step = [], llm.step

    def recorded():
        outputs = step()
        held.append(llm.stats().used_blocks)
        return outputs

    llm.step = recorded
    try:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    finally:
        del llm.step
    return held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens (the CPU's default)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp) / "gemma3-4b-shaped")
        llm = LLM(
            str(path),
            dtype="float32",
            max_model_len=args.context + 64,
            # the full group's blocks, each sliding group's window and chunk, and room for the two chats
            num_kvcache_blocks=args.context // 16 + 6 * ((1024 + args.chunk) // 16 + 2) + 1024,
            max_num_batched_tokens=args.chunk,
        )
        stats = llm.stats()
        print(f"KV-cache groups: {', '.join(stats.kv_groups)}; a block holds {stats.layers_per_block} of 34 layers")
        start = time.perf_counter()
        held = held_after_each_step(llm, [(7 * i) % 500 + 3 for i in range(args.context)], max_tokens=4)
        seconds = time.perf_counter() - start
        all_global = -(-args.context // stats.block_size) * 34  # layer-blocks
        per_block = stats.layers_per_block
        print(
            f"{args.context:,}-token prompt in {args.chunk}-token chunks, then 4 tokens ({seconds:.0f} s): blocks of "
            f"{per_block} layers held at the peak (a prefill chunk) {max(held):,}, decoding at {args.context:,} tokens "
            f"{held[-2]:,}; all-global {all_global // 34:,} blocks of 34 layers. Ratio of layer-blocks: peak "
            f"{max(held) * per_block / all_global:.3f}, decoding {held[-2] * per_block / all_global:.3f}"
        )
        system = [(11 * i) % 500 + 3 for i in range(args.system_tokens)]
        first = llm.generate([system + [5, 6, 7]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
        second = llm.generate([system + [8, 9]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
        print(
            f"two chats sharing a {args.system_tokens:,}-token system prompt: the second got "
            f"{second['num_cached_tokens']:,} tokens from the prefix cache (the first {first['num_cached_tokens']:,})"
        )


if __name__ == "__main__":
    main()
