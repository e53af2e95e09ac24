"""Peak memory of loading a gpt-oss checkpoint whose experts are MXFP4, as OpenAI ships them (issue 30): the experts
must stay 4.25 bits a weight, never widened as a whole.

    python -m bench.mxfp4_load_memory [--layers 2] [--vocab 32000]

Writes a random-weight checkpoint with gpt-oss-20b's widths (hidden 2,880, 32 experts of 2,880, 64 query and 8 KV
heads of 64) and --layers layers, in transformers' MXFP4 layout (`*_blocks`, `*_scales` uint8 beside bf16
attention, router and embeddings), then measures `LLM(folder)` in a fresh process as bench/gguf_load_memory.py
does: the load's peak resident memory over (the files' size + the KV cache budget).
"""

import argparse
import json
import tempfile
from pathlib import Path

import torch

from bench.gguf_load_memory import measure_load

GPT_OSS_20B = dict(
    hidden_size=2880,
    intermediate_size=2880,
    num_local_experts=32,
    num_experts_per_tok=4,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
)


def write_checkpoint(folder: Path, layers: int, vocab: int) -> int:
    """The checkpoint and its tokenizer in `folder`; returns the weights' bytes on disk."""
    import transformers
    from safetensors.torch import save_file

    from tests.conftest import build_tokenizer

    config = transformers.GptOssConfig(
        **GPT_OSS_20B,
        num_hidden_layers=layers,
        vocab_size=vocab,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2),
        tie_word_embeddings=False,
        architectures=["GptOssForCausalLM"],
    )
    config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    hidden, inter, experts = config.hidden_size, config.intermediate_size, config.num_local_experts
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    generator = torch.Generator().manual_seed(0)

    def dense(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    def codes(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)

    tensors = {
        "model.embed_tokens.weight": dense(vocab, hidden),
        "lm_head.weight": dense(vocab, hidden),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    for i in range(layers):
        p = f"model.layers.{i}"
        tensors |= {
            f"{p}.input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            f"{p}.post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            f"{p}.self_attn.q_proj.weight": dense(q, hidden),
            f"{p}.self_attn.q_proj.bias": dense(q),
            f"{p}.self_attn.k_proj.weight": dense(kv, hidden),
            f"{p}.self_attn.k_proj.bias": dense(kv),
            f"{p}.self_attn.v_proj.weight": dense(kv, hidden),
            f"{p}.self_attn.v_proj.bias": dense(kv),
            f"{p}.self_attn.o_proj.weight": dense(hidden, q),
            f"{p}.self_attn.o_proj.bias": dense(hidden),
            f"{p}.self_attn.sinks": dense(config.num_attention_heads),
            f"{p}.mlp.router.weight": dense(experts, hidden),
            f"{p}.mlp.router.bias": dense(experts),
            f"{p}.mlp.experts.gate_up_proj_blocks": codes(experts, 2 * inter, hidden // 32, 16),
            f"{p}.mlp.experts.gate_up_proj_scales": torch.full(
                (experts, 2 * inter, hidden // 32), 120, dtype=torch.uint8
            ),
            f"{p}.mlp.experts.gate_up_proj_bias": dense(experts, 2 * inter),
            f"{p}.mlp.experts.down_proj_blocks": codes(experts, hidden, inter // 32, 16),
            f"{p}.mlp.experts.down_proj_scales": torch.full((experts, hidden, inter // 32), 120, dtype=torch.uint8),
            f"{p}.mlp.experts.down_proj_bias": dense(experts, hidden),
        }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(folder)
    build_tokenizer(folder)
    return (folder / "model.safetensors").stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "gpt-oss-shaped-mxfp4"
        size = write_checkpoint(folder, args.layers, args.vocab)
        figures = measure_load(folder)
    added = figures["peak_bytes"] - figures["baseline_bytes"]
    print(
        json.dumps(
            {
                "file_mb": round(size / 2**20),
                "kv_mb": round(figures["kv_bytes"] / 2**20),
                "peak_added_mb": round(added / 2**20),
                "ratio_to_file_plus_kv": round(added / (size + figures["kv_bytes"]), 3),
                "load_s": round(figures["load_s"], 1),
            }
        )
    )


if __name__ == "__main__":
    main()
