"""The cost of constrained decoding: a decode step with every row held to a JSON schema against the same
step free, at batch 1 and batch 32, in one run on the bundled SmolLM2 (its real 49k-token vocabulary).

    python -m bench.structured_output [--batches 1,32] [--tokens 96] [--rounds 5] [--compare-xgrammar]
                                      [--random-qwen3 FOLDER]

Each constrained row writes one long JSON string (minLength keeps every row running for --tokens tokens),
so both runs step the same batch the same number of times. Reported: the mean decode step, free and
constrained, their ratio, and the host time to fill the batch's masks alone. The goal (issue 15):
under 10% added per step at batch 32. `--compare-xgrammar` also times xgrammar's mask on the same schema
(pip install xgrammar first; Pagoda does not depend on it). `--random-qwen3`: a random-weight model of
Qwen3-0.6B's shape (151,936-token logits) with the tests' tiny tokenizer, for a device without the bundled
model: its masks are cheap to fill, so it measures what masking costs the device, not the grammar.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from bench.common import qwen3_06b_config, save_random_model
from bench.quantized import cpu_flags
from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.loader.bundled import bundled_gguf_path
from engine.sample.structured_output import fill_bitmask

SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 40}, "story": {"type": "string", "minLength": 600}},
    "required": ["title", "story"],
    "additionalProperties": False,
}


def mean_decode_step(llm: LLM, prompt: list[int], batch: int, tokens: int, constrained: bool) -> float:
    """Seconds per decode step once every row has its first token (prefill excluded). Steps are read back
    one by one (llm.step()), so on a GPU this includes the wait for each step."""
    constraint = StructuredOutputsParams(json=SCHEMA) if constrained else None
    for _ in range(batch):
        llm.add_request(
            prompt, SamplingParams(temperature=0.8, max_tokens=tokens, ignore_eos=True, structured_outputs=constraint)
        )
    while llm.scheduler.waiting or any(s.num_output_tokens == 0 for s in llm.scheduler.running):
        llm.step()
    steps, start = 0, time.perf_counter()
    while llm.has_unfinished_requests():
        llm.step()
        steps += 1
    return (time.perf_counter() - start) / max(steps, 1)


def mask_fill_seconds(llm: LLM, batch: int, prefix: list[int], repeats: int = 20) -> float:
    """Host time to fill `batch` rows of masks, each grammar partway into its reply."""
    grammars = [llm.structured_outputs.grammar(StructuredOutputsParams(json=SCHEMA)) for _ in range(batch)]
    for g in grammars:
        g.matcher.consume_tokens(prefix)
    fill_bitmask(grammars, llm.model_runner.vocab_size)  # warm
    start = time.perf_counter()
    for _ in range(repeats):
        fill_bitmask(grammars, llm.model_runner.vocab_size)
    return (time.perf_counter() - start) / repeats


def xgrammar_row_seconds(tokenizer, vocab_size: int, prefix: list[int], repeats: int = 200) -> float | None:
    try:
        import xgrammar
    except ImportError:
        print("xgrammar is not installed: pip install xgrammar to compare")
        return None
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    matcher = xgrammar.GrammarMatcher(compiled)
    for t in prefix:
        matcher.accept_token(t)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    start = time.perf_counter()
    for _ in range(repeats):
        matcher.fill_next_token_bitmask(bitmask)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compare-xgrammar", action="store_true")
    parser.add_argument("--random-qwen3", type=Path, default=None, metavar="FOLDER")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device {device}; CPU flags: {cpu_flags()}; torch threads {torch.get_num_threads()}")
    if args.random_qwen3 is not None:
        model = str(save_random_model(qwen3_06b_config(), args.random_qwen3, torch.bfloat16, device))
        llm = LLM(model, max_model_len=1024, enable_prefix_caching=False)
    else:
        llm = LLM(str(bundled_gguf_path()), num_kvcache_blocks=1024, max_model_len=1024, enable_prefix_caching=False)
    llm.model_runner.wait_for_compiled_decode()
    prompt = llm.encode_chat([{"role": "user", "content": "Write a short story as JSON with a title."}])
    prefix = llm.tokenizer.encode('{"title": "The Fox", "story": "Once upon a time, a', add_special_tokens=False)
    print(f"{'batch':>5} {'free ms/step':>13} {'constrained':>12} {'added':>7} {'mask fill ms':>13}")
    for batch in [int(b) for b in args.batches.split(",")]:
        runs = {False: [], True: []}
        for _ in range(args.rounds):  # interleaved, so drift in the machine's speed hits both alike
            for constrained in (False, True):
                runs[constrained].append(mean_decode_step(llm, prompt, batch, args.tokens, constrained))
        free, held = min(runs[False]), min(runs[True])
        fill = mask_fill_seconds(llm, batch, prefix)
        print(f"{batch:>5} {free * 1e3:>13.2f} {held * 1e3:>12.2f} {held / free - 1:>+7.1%} {fill * 1e3:>13.3f}")
    per_row = mask_fill_seconds(llm, 1, prefix)
    print(f"llguidance: one mask row {per_row * 1e6:.0f} us")
    if args.compare_xgrammar:
        seconds = xgrammar_row_seconds(llm.tokenizer, llm.model_runner.vocab_size, prefix)
        if seconds is not None:
            print(f"xgrammar: one mask row {seconds * 1e6:.0f} us")


if __name__ == "__main__":
    main()
