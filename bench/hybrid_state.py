"""A Qwen3.5-shaped hybrid model on the CPU: the KV and recurrent-state bytes its chats hold against the same model
laid out as all-attention, and a second chat's time to first token when its system prompt comes from the prefix
cache (a state snapshot, engine/core/state_slots.py) against a cold one.

    python -m bench.hybrid_state [--chats 8] [--context 8192] [--system-tokens 2000]

The network has Qwen3.5's layer layout and the head shapes that set its cache (transformers' Qwen3_5TextConfig:
32 layers, a full-attention layer after every three Gated DeltaNet ones; 4 KV heads of 256; 16 key heads and 32
value heads of 128 in the linear layers) with tiny widths elsewhere (hidden 64, 4 query heads) and random weights:
the bytes are the model's, and the prefill runs on a laptop's CPU in minutes. Bytes come from `stats()`: the blocks
and state slots running requests hold, while all --chats chats of --context tokens are running; the all-attention
layout holds the same blocks in all 32 layers and no state.
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
import transformers

from engine import LLM, SamplingParams

QWEN3_5_LAYERS = 32


def build(folder: Path) -> Path:
    from tests.conftest import build_tokenizer  # the tests' tiny tokenizer: a bench is run from the repo

    config = transformers.Qwen3_5TextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=QWEN3_5_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(QWEN3_5_LAYERS)],
        max_position_embeddings=65536,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.1)
    model.to(torch.bfloat16).save_pretrained(folder)
    build_tokenizer(folder)
    return folder


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (length,), generator=g).tolist()


def memory(path: Path, chats: int, context: int) -> None:
    llm = LLM(str(path), dtype="bfloat16", max_num_seqs=chats, kv_cache_memory_bytes=8 << 30)
    peak = {}
    step = llm.step

    def recorded_step():
        out = step()
        s = llm.stats()
        if s.num_running == chats and s.held_bytes >= peak.get("held", 0):
            peak.update(held=s.held_bytes, blocks=s.used_blocks, slots=s.used_state_slots, stats=s)
        return out

    llm.step = recorded_step
    started = time.perf_counter()
    # Prefills take a step's token budget one after another: the first chats decode while the last ones prefill,
    # and all run together once the last one has (its context is then `context`, the first ones' a little more)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    llm.generate([prompt(context - 64, i) for i in range(chats)], params, use_tqdm=False)
    if not peak:
        raise RuntimeError(f"the {chats} chats never ran together; give them more tokens to decode")
    s = peak["stats"]
    # one KV-cache group (its full-attention layers alike): a block holds them all; all-attention, every layer
    per_layer = s.bytes_per_block // s.layers_per_block
    all_attention = peak["blocks"] * per_layer * QWEN3_5_LAYERS
    print(
        f"{chats} chats of {context} tokens ({time.perf_counter() - started:.0f} s): hybrid holds "
        f"{peak['held'] / 2**30:.2f} GiB ({peak['blocks']} blocks of {s.bytes_per_block / 2**20:.2f} MiB, "
        f"{peak['slots']} state slots of {s.state_slot_bytes / 2**20:.1f} MiB); all-attention "
        f"{all_attention / 2**30:.2f} GiB; ratio {peak['held'] / all_attention:.3f}"
    )


def first_token(path: Path, system_tokens: int) -> None:
    llm = LLM(str(path), dtype="bfloat16")
    system = prompt(system_tokens, 100)
    one = SamplingParams(max_tokens=1)
    llm.generate([prompt(64, 0)], one, use_tqdm=False)  # warm-up
    times, cached = [], []
    for question in (101, 102):
        started = time.perf_counter()
        out = llm.generate([system + prompt(20, question)], one, use_tqdm=False)[0]
        times.append(time.perf_counter() - started)
        cached.append(out["num_cached_tokens"])
    print(
        f"system prompt of {system_tokens} tokens: cold {times[0]:.2f} s, second chat {times[1]:.2f} s "
        f"({times[1] / times[0]:.3f}x), {cached[1]} tokens cached ({cached[1] / system_tokens:.0%})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--system-tokens", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as folder:
        path = build(Path(folder))
        first_token(path, args.system_tokens)
        memory(path, args.chats, args.context)


if __name__ == "__main__":
    main()
