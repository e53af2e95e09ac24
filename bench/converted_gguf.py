"""Random-weight GGUF files in real models' shapes, made by llama.cpp's own tools (issue 38's bench files).

    python -m bench.converted_gguf --llama-cpp DIR --model qwen3-4b|llama-3.1-8b|qwen3.5-4b --out DIR
                                   [--types Q4_K_M,Q5_K_M,Q6_K]

DIR is a llama.cpp source tree with `build/bin/llama-quantize` built (bench/RESULTS.md has the recipe). Writes a
Hugging Face folder of the model's config and random bf16 weights (std 0.02; norms near 1), with the tokenizer
transformers rebuilds from llama.cpp's vocabulary-only test file of that family (`models/ggml-vocab-qwen2.gguf`,
`ggml-vocab-llama-bpe.gguf`, so convert_hf_to_gguf.py recognises its pre-tokenizer), converts it to a bf16 GGUF with
`convert_hf_to_gguf.py` (which needs the `gguf` package from the tree and `sentencepiece`), then quantizes that with
`llama-quantize` to each type. The folder and the bf16 file are deleted as soon as they are used: an 8B model's take
16 GB each.

qwen3.5-4b: Qwen3.5-4B's shapes as its config gives them (32 layers, a gated full-attention one after every three
Gated DeltaNet ones), with its multi-token-prediction head (`mtp.*`), which the converter keeps as one more block.
"""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

MODELS = {
    "qwen3-4b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_bias=False,
        bos_token_id=151643,
        eos_token_id=151645,
        torch_dtype="bfloat16",
    ),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_scaling=dict(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
            rope_type="llama3",
        ),
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=128000,
        eos_token_id=128009,
        torch_dtype="bfloat16",
    ),
    "qwen3.5-4b": dict(
        architectures=["Qwen3_5ForCausalLM"],
        model_type="qwen3_5_text",
        hidden_size=2560,
        intermediate_size=9216,
        num_hidden_layers=32,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8,
        full_attention_interval=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        attn_output_gate=True,
        mtp_num_hidden_layers=1,
        vocab_size=248320,
        tie_word_embeddings=True,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=10000000,
            partial_rotary_factor=0.25,
            mrope_section=[11, 11, 10],
            mrope_interleaved=True,
        ),
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        bos_token_id=248044,
        eos_token_id=248046,
        torch_dtype="bfloat16",
    ),
}
VOCABULARY = {
    "qwen3-4b": "ggml-vocab-qwen2.gguf",
    "llama-3.1-8b": "ggml-vocab-llama-bpe.gguf",
    "qwen3.5-4b": "ggml-vocab-qwen35.gguf",
}


def write_tokenizer(llama_cpp: Path, model: str, folder: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(llama_cpp / "models"), gguf_file=VOCABULARY[model])
    tokenizer.save_pretrained(folder)
    size = MODELS[model]["vocab_size"]
    saved = json.loads((folder / "tokenizer.json").read_text())
    # transformers adds a pad token past Llama 3's 128,256, which convert_hf_to_gguf.py refuses
    saved["added_tokens"] = [t for t in saved["added_tokens"] if t["id"] < size]
    saved["model"]["vocab"] = {text: i for text, i in saved["model"]["vocab"].items() if i < size}
    (folder / "tokenizer.json").write_text(json.dumps(saved))


def write_weights(model: str, folder: Path) -> None:
    """One safetensors file per layer, so no more than a layer is ever in memory."""
    c = MODELS[model]
    hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    generator = torch.Generator().manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    def norm(n: int) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, generator=generator)).to(torch.bfloat16)

    index = {}

    def save(tensors: dict, part: int) -> None:
        name = f"model-{part:05d}.safetensors"
        save_file(tensors, folder / name, metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, name))

    outer = {"model.embed_tokens.weight": weight(c["vocab_size"], hidden), "model.norm.weight": norm(hidden)}
    if not c["tie_word_embeddings"]:
        outer["lm_head.weight"] = weight(c["vocab_size"], hidden)
    save(outer, 0)
    if c["model_type"] == "qwen3_5_text":
        write_qwen3_5_layers(c, weight, norm, save)
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
        (folder / "config.json").write_text(json.dumps(c, indent=1))
        return
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors = {
            p + "self_attn.q_proj.weight": weight(q, hidden),
            p + "self_attn.k_proj.weight": weight(kv, hidden),
            p + "self_attn.v_proj.weight": weight(kv, hidden),
            p + "self_attn.o_proj.weight": weight(hidden, q),
            p + "mlp.gate_proj.weight": weight(inter, hidden),
            p + "mlp.up_proj.weight": weight(inter, hidden),
            p + "mlp.down_proj.weight": weight(hidden, inter),
            p + "input_layernorm.weight": norm(hidden),
            p + "post_attention_layernorm.weight": norm(hidden),
        }
        if c["model_type"] == "qwen3":
            tensors[p + "self_attn.q_norm.weight"] = norm(head_dim)
            tensors[p + "self_attn.k_norm.weight"] = norm(head_dim)
        save(tensors, layer + 1)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (folder / "config.json").write_text(json.dumps(c, indent=1))


def write_qwen3_5_layers(c: dict, weight, norm, save) -> None:
    """Qwen3.5's layers, then its MTP head (a full-attention layer, its fc over [embedding, hidden] and three norms),
    a layer to a file."""
    hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    keys = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    values = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim

    def full_attention(p: str) -> dict:
        return {
            p + "self_attn.q_proj.weight": weight(2 * q, hidden),  # each head's query, then its gate
            p + "self_attn.k_proj.weight": weight(kv, hidden),
            p + "self_attn.v_proj.weight": weight(kv, hidden),
            p + "self_attn.o_proj.weight": weight(hidden, q),
            p + "self_attn.q_norm.weight": norm(head_dim),
            p + "self_attn.k_norm.weight": norm(head_dim),
        }

    def mlp_and_norms(p: str) -> dict:
        return {
            p + "mlp.gate_proj.weight": weight(inter, hidden),
            p + "mlp.up_proj.weight": weight(inter, hidden),
            p + "mlp.down_proj.weight": weight(hidden, inter),
            p + "input_layernorm.weight": norm(hidden),
            p + "post_attention_layernorm.weight": norm(hidden),
        }

    for layer, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{layer}."
        if kind == "full_attention":
            tensors = full_attention(p)
        else:
            heads, conv = c["linear_num_value_heads"], 2 * keys + values
            tensors = {
                p + "linear_attn.in_proj_qkv.weight": weight(conv, hidden),
                p + "linear_attn.in_proj_z.weight": weight(values, hidden),
                p + "linear_attn.in_proj_b.weight": weight(heads, hidden),
                p + "linear_attn.in_proj_a.weight": weight(heads, hidden),
                p + "linear_attn.conv1d.weight": weight(conv, 1, c["linear_conv_kernel_dim"]),
                p + "linear_attn.dt_bias": norm(heads),
                p + "linear_attn.A_log": norm(heads),
                p + "linear_attn.norm.weight": norm(c["linear_value_head_dim"]),
                p + "linear_attn.out_proj.weight": weight(hidden, values),
            }
        save(tensors | mlp_and_norms(p), layer + 1)
    head = full_attention("mtp.layers.0.") | mlp_and_norms("mtp.layers.0.")
    head |= {"mtp.fc.weight": weight(hidden, 2 * hidden), "mtp.norm.weight": norm(hidden)}
    head |= {f"mtp.pre_fc_norm_{part}.weight": norm(hidden) for part in ("embedding", "hidden")}
    save(head, c["num_hidden_layers"] + 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree, llama-quantize built")
    ap.add_argument("--model", choices=sorted(MODELS), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--types", default="Q4_K_M,Q5_K_M,Q6_K")
    args = ap.parse_args()
    folder, bf16 = args.out / args.model, args.out / f"{args.model}-bf16.gguf"
    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(args.llama_cpp, args.model, folder)
    write_weights(args.model, folder)
    convert = [sys.executable, str(args.llama_cpp / "convert_hf_to_gguf.py"), str(folder), "--outtype", "bf16"]
    subprocess.run([*convert, "--outfile", str(bf16)], check=True)  # with the tree's own gguf-py
    shutil.rmtree(folder)
    for type_name in args.types.split(","):
        out = args.out / f"{args.model}-{type_name}.gguf"
        subprocess.run([str(args.llama_cpp / "build/bin/llama-quantize"), str(bf16), str(out), type_name], check=True)
        print(out, flush=True)
    bf16.unlink()


if __name__ == "__main__":
    main()
