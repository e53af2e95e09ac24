"""Qwen3.5 on a GPU (issue 31): the delta-rule Triton kernels against the torch reference at Qwen3.5-4B's
linear-layer shapes, then the engine's batch-1 and 16-chat decode and a 2,000-token prompt's time to first token
on a random-weight model of Qwen3.5-4B's shape.

    python -m bench.gpu_hybrid [--smoke]

The shape (hidden 2,560, 32 layers with a full-attention layer after every three Gated DeltaNet ones, 16 key and
32 value heads of 128, MLP 9,216) is my reading of the 4B model; the hub's config is not reachable here, and the
figures are about the layers' cost, not about the checkpoint. `--smoke` runs every path on the CPU with tiny sizes
(the kernels under TRITON_INTERPRET=1), for checking the script.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

if "--smoke" in sys.argv:  # the kernels run in Triton's interpreter, which must be chosen before Triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from bench.common import save_random_model  # noqa: E402
from bench.gpu_bench import FAILURES, ROWS, VOCAB, decode_tps, row, section, sync  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def qwen3_5_4b_config(smoke: bool):
    import transformers

    layers = 4 if smoke else 32
    return transformers.Qwen3_5TextConfig(
        vocab_size=2048 if smoke else 248320,
        hidden_size=64 if smoke else 2560,
        intermediate_size=128 if smoke else 9216,
        num_hidden_layers=layers,
        num_attention_heads=4 if smoke else 16,
        num_key_value_heads=2 if smoke else 4,
        head_dim=32 if smoke else 256,
        linear_num_key_heads=2 if smoke else 16,
        linear_num_value_heads=4 if smoke else 32,
        linear_key_head_dim=16 if smoke else 128,
        linear_value_head_dim=16 if smoke else 128,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        architectures=["Qwen3_5ForCausalLM"],
    )


def timed_ms(fn, device: str, repeats: int = 5) -> float:
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - start) / repeats * 1000


def kernel_rows(device: str, smoke: bool) -> None:
    """The kernels and the torch reference on the same inputs: their largest difference, and their times."""
    from engine.layers.gated_deltanet import chunked_delta_rule, l2norm, recurrent_delta_rule
    from engine.layers.gated_deltanet_triton import CHUNK, DeltaRulePlan, delta_rule

    key_heads, heads, dim = (2, 4, 16) if smoke else (16, 32, 128)
    g = torch.Generator(device=device).manual_seed(0)

    def inputs(tokens: int):
        q = l2norm(torch.randn(tokens, key_heads, dim, device=device, generator=g)) * dim**-0.5
        k = l2norm(torch.randn(tokens, key_heads, dim, device=device, generator=g))
        v = torch.randn(tokens, heads, dim, device=device, generator=g)
        decay = -torch.rand(tokens, heads, device=device, generator=g) * 0.1
        return q, k, v, decay, torch.rand(tokens, heads, device=device, generator=g)

    groups = heads // key_heads
    for name, lengths, chunked in (
        ("prefill of 2 x 1,000 tokens", [1000, 1000], True),
        ("decode of 16", [1] * 16, False),
    ):
        if smoke:
            lengths = [min(n, 70) for n in lengths]
        q, k, v, decay, beta = inputs(sum(lengths))
        states = torch.randn(len(lengths), heads, dim, dim, device=device, generator=g) * 0.1
        plan = DeltaRulePlan.build(
            lengths, list(range(len(lengths))), [False] * len(lengths), [[]] * len(lengths), torch.device(device),
            CHUNK if chunked else None,
        )  # fmt: skip
        wide_q, wide_k = (t.repeat_interleave(groups, dim=1) for t in (q, k))

        def reference():
            outs, finals, start = [], [], 0
            for i, n in enumerate(lengths):
                rows = slice(start, start + n)
                if chunked:
                    o, s = chunked_delta_rule(
                        *(t[rows].transpose(0, 1) for t in (wide_q, wide_k, v, decay, beta)), states[i]
                    )
                    outs.append(o.transpose(0, 1))
                else:
                    o, s = recurrent_delta_rule(
                        wide_q[rows], wide_k[rows], v[rows], decay[rows], beta[rows], states[i : i + 1]
                    )
                    outs.append(o)
                    s = s[0]
                finals.append(s)
                start += n
            return torch.cat(outs), torch.stack(finals)

        expected_out, expected_states = reference()
        pool = states.clone()
        out = delta_rule(q, k, v, decay, beta, pool, plan, chunked=chunked)
        error = max((out - expected_out).abs().max().item(), (pool - expected_states).abs().max().item())
        scale = expected_out.abs().max().item()
        kernel_ms = timed_ms(lambda: delta_rule(q, k, v, decay, beta, states.clone(), plan, chunked=chunked), device)
        reference_ms = timed_ms(reference, device, repeats=2)
        row(
            f"delta rule, {name}",
            f"{kernel_ms:.2f} ms",
            f"torch reference {reference_ms:.2f} ms ({reference_ms / kernel_ms:.1f}x); largest difference "
            f"{error:.1e} (outputs up to {scale:.1f})",
        )
        if error > 2e-2 * max(scale, 1.0):
            raise RuntimeError(f"the kernels' {name} is off the reference by {error:.3g}")


def engine_rows(device: str, smoke: bool) -> None:
    config = qwen3_5_4b_config(smoke)
    VOCAB[0] = min(100000, config.vocab_size)
    name = "pagoda-smoke-qwen3.5" if smoke else "pagoda-qwen3.5-4b-shape"
    folder = save_random_model(config, Path(tempfile.gettempdir()) / name, torch.bfloat16, device)
    settings = dict(dtype="bfloat16", device=device, max_num_seqs=16)
    settings.update(num_kvcache_blocks=256) if smoke else settings.update(gpu_memory_utilization=0.5)
    llm = LLM(str(folder), **settings)
    stats = llm.stats()
    row(
        "Qwen3.5-4B shape: engine",
        stats.attention_backend,
        f"decode {stats.decode}; {stats.num_state_slots} state slots",
    )
    new_tokens, prompt_len = (8, 32) if smoke else (128, 128)
    for batch in (1, 16):
        tps, steps = decode_tps(llm, prompt_len, new_tokens, batch)
        row(f"Qwen3.5-4B shape: batch-{batch} decode", f"{tps:.0f} tok/s", steps)
    prompt = [100 + i % 1000 for i in range(200 if smoke else 2000)]
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([[7] * 40], one, use_tqdm=False)  # a first prefill compiles what prefills use
    sync(device)
    start = time.perf_counter()
    llm.generate([prompt], one, use_tqdm=False)
    sync(device)
    row(f"Qwen3.5-4B shape: TTFT, {len(prompt):,}-token prompt", f"{(time.perf_counter() - start) * 1000:.0f} ms")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: checks the script runs")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    with section("delta-rule kernels"):
        kernel_rows(device, args.smoke)
    with section("Qwen3.5-4B shape"):
        engine_rows(device, args.smoke)
    print("\n| benchmark | value | note |\n|---|---:|---|")
    for name, value, note in ROWS:
        print(f"| {name} | {value} | {note} |")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
