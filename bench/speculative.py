"""Speculative decoding on this CPU: decode speed with n-gram drafts against plain decoding, in the same run and the
same engine (issue 32).

    python -m bench.speculative [--model M] [--k 4,8] [--draft D] [--mtp] [--rounds 2] [--threads 2] [--eager]

Two workloads, one request at a time (a chat):
- edit: the prompt holds a ~400-token code file and asks for it back with one change; the reply repeats the
  file, which is where n-gram drafts pay;
- chat: free questions, whose replies repeat little; drafts must then cost (almost) nothing.

One engine (default: the bundled SmolLM2 Q4_1 GGUF), its decode steps compiled as a user gets them (--eager: not),
serves every variant: plain (no speculator), n-gram with each --k, then a draft model (--draft; default: the
model as its own draft, which accepts every token and so shows what checking drafts costs) with the largest k.
--mtp adds the model's own MTP head (a Qwen3.5 or Qwen3-Next model that ships one) with the smallest k, at the CPU's
default threshold. Decode speed excludes the prompt: each
prompt is answered once with 1 token and once in full (both hit the prefix cache for all but the prompt's last
block), and the difference in time is divided by the difference in tokens. Each variant keeps its best round.
Greedy replies must be the same in every variant: the script says so if they are not.
"""

import argparse
import time
from pathlib import Path

import torch

from bench.quantized import cpu_flags
from engine import LLM, SamplingParams
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft_loader import load_draft_model
from engine.spec_decode.mtp import load_mtp_proposer
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.speculator import DEFAULT_MIN_ACCEPTANCE, Speculator

EDIT_SOURCE = Path(__file__).resolve().parents[1] / "engine" / "core" / "scheduler.py"
CHAT = [
    "What are three good habits for learning a new language?",
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about the sea at night.",
    "Why do leaves change colour in autumn?",
]


def edit_prompt(llm: LLM, tokens: int = 400) -> list[int]:
    """A request to return a ~`tokens`-token piece of code with one name changed."""
    lines, code = EDIT_SOURCE.read_text().splitlines(keepends=True), ""
    start = next(i for i, line in enumerate(lines) if line.startswith("class Scheduler"))
    for line in lines[start:]:
        if len(llm.tokenizer.encode(code + line)) > tokens:
            break
        code += line
    ask = (
        f"Here is a Python file:\n\n```python\n{code}```\n\n"
        "Return the whole file unchanged, except rename `budget` to `token_budget`."
    )
    return llm.encode_chat([{"role": "user", "content": ask}])


def decode_rate(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """(decode tokens per second, the reply's token ids) for one request."""
    one = SamplingParams(temperature=0, max_tokens=1)
    full = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    llm.generate([prompt], one, use_tqdm=False)
    middle = time.perf_counter()
    reply = llm.generate([prompt], full, use_tqdm=False)[0]["token_ids"]
    end = time.perf_counter()
    return (len(reply) - 1) / max(1e-9, (end - middle) - (middle - start)), reply


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder, hub id or GGUF (default: the bundled SmolLM2 Q4_1 GGUF)")
    ap.add_argument("--k", default="4,8", help="num_speculative_tokens to try, comma-separated")
    ap.add_argument("--draft", help="draft model for the draft variant (default: the model itself; 'none': skip it)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mtp", action="store_true", help="add the model's MTP head as a variant")
    ap.add_argument("--chat-tokens", type=int, default=160, help="reply length cap for the chat prompts")
    ap.add_argument("--edit-tokens", type=int, default=600, help="reply length cap for the edit prompt")
    ap.add_argument("--eager", action="store_true", help="eager decode steps (default: compiled, which takes minutes)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from engine.loader.bundled import bundled_gguf_path

        model = str(bundled_gguf_path())
    ks = [int(k) for k in args.k.split(",")]
    llm = LLM(
        model, enforce_eager=args.eager, speculative_config={"method": "ngram", "num_speculative_tokens": max(ks)}
    )
    llm.model_runner.wait_for_compiled_decode()
    stats = llm.stats()
    print(
        f"model {model}\nCPU flags: {cpu_flags()}; threads {args.threads}; decode {stats.decode}; dtype {stats.dtype}"
    )
    workloads = {
        "edit": [(edit_prompt(llm), args.edit_tokens)],
        "chat": [(llm.encode_chat([{"role": "user", "content": q}]), args.chat_tokens) for q in CHAT],
    }
    print(f"edit prompt: {len(workloads['edit'][0][0])} tokens")
    least = DEFAULT_MIN_ACCEPTANCE["cpu"]  # what a user gets: requests that gain too little sit out
    ngram = {f"ngram k={k}": Speculator(SpeculativeConfig("ngram", k), NgramProposer(2, 4), least) for k in ks}
    # and the same without sitting out, to show what the threshold saves
    ngram[f"ngram k={max(ks)} min=0"] = Speculator(SpeculativeConfig("ngram", max(ks)), NgramProposer(2, 4))
    variants = {"plain": None} | ngram
    if (args.draft or "").lower() != "none":
        draft = args.draft or model
        config = SpeculativeConfig("draft", max(ks), model=draft)
        variants[f"draft k={max(ks)}"] = speculator = Speculator(config, load_draft_model(draft, llm))
        speculator.proposer.runner.wait_for_compiled_decode()
        print(f"draft {draft}: decode {speculator.proposer.runner.decode_kind}")
    if args.mtp:
        config = SpeculativeConfig("mtp", min(ks))
        variants[f"mtp k={min(ks)}"] = Speculator(config, load_mtp_proposer(llm), least)
    best: dict[tuple[str, str], float] = {}
    replies: dict[tuple[str, str], list[list[int]]] = {}
    accepted: dict[tuple[str, str], tuple[int, int, int]] = {}
    for _ in range(args.rounds):
        for name, speculator in variants.items():
            for workload, prompts in workloads.items():
                # the same engine for every variant: its speculator swapped, so only speculation differs
                if speculator is not None:
                    speculator.stats = type(speculator.stats)()
                llm.speculator = speculator
                rates, outs = [], []
                for prompt, max_tokens in prompts:
                    rate, reply = decode_rate(llm, prompt, max_tokens)
                    rates.append(rate)
                    outs.append(reply)
                tokens = sum(len(r) - 1 for r in outs)
                # tokens over the summed time: each prompt's decode time is tokens / rate
                rate = tokens / sum((len(r) - 1) / x for r, x in zip(outs, rates, strict=True))
                key = (name, workload)
                best[key] = max(best.get(key, 0.0), rate)
                replies[key] = outs
                if llm.speculator is not None:
                    s = llm.speculator.stats
                    accepted[key] = (s.steps, s.draft_tokens, s.accepted_tokens)
    print(f"\n{'variant':<18}{'workload':<10}{'tok/s':>8}{'x plain':>9}{'tok/step':>10}{'accepted':>10}  same reply")
    for (name, workload), rate in best.items():
        steps, drafted, took = accepted.get((name, workload), (0, 0, 0))
        per_step = f"{(took + steps) / steps:.2f}" if steps else "-"
        share = f"{took / drafted:.0%}" if drafted else "-"
        same = replies[(name, workload)] == replies[("plain", workload)]
        ratio = rate / best[("plain", workload)]
        print(f"{name:<18}{workload:<10}{rate:>8.1f}{ratio:>8.2f}x{per_step:>10}{share:>10}  {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
