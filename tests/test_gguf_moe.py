"""A Qwen3-MoE GGUF (llama.cpp's qwen3moe: the router ffn_gate_inp, each projection's experts stacked in
ffn_{gate,up,down}_exps) served as stored: the experts stay in their blocks, each expert's kernel reads its rows of
the stacked tensor, and the tokens are those of transformers running the file's weights as gguf-py dequantizes
them (the same rounding)."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine.quantization import chooser
from engine.quantization.moe import QuantizedFusedMoE
from tests.quantized_weights import only_dequant
from tests.test_gguf_engine import (
    HEAD_DIM,
    SIZES,
    check_against_reference,
    encode,
    gguf_name,
    greedy,
    make_llm,
    prompt_ids,
    tokenizer_metadata,
)
from tests.test_gguf_families import new_writer
from tests.test_parity import hf_greedy

EXPERTS, PER_TOKEN, MOE_INTERMEDIATE = 8, 2, 256
STACKED = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps"}


def hf_moe_model():
    import transformers

    torch.manual_seed(21)
    config = transformers.Qwen3MoeConfig(
        **SIZES,
        head_dim=HEAD_DIM,
        moe_intermediate_size=MOE_INTERMEDIATE,
        num_experts=EXPERTS,
        num_experts_per_tok=PER_TOKEN,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                # experts and router at the embedding's scale, so that what the experts add decides the tokens
                p.normal_(0, 0.3 if any(k in name for k in ("embed", "lm_head", "mlp.gate", "experts")) else 0.1)
    return model.eval()


def write_moe_gguf(path: Path, model, expert_type: str, tokenizer_folder: Path) -> Path:
    """The model as convert_hf_to_gguf writes a qwen3moe file: attention and head in Q8_0, experts in `expert_type`,
    the router and norms in F32."""
    config = model.config
    writer = new_writer(path, "qwen3moe", config)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(PER_TOKEN)
    writer.add_expert_feed_forward_length(MOE_INTERMEDIATE)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(SIZES["vocab_size"])
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    tokenizer_metadata(writer, tokenizer_folder)
    for i, (name, p) in enumerate(model.state_dict().items()):
        w = p.detach().float().numpy()
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: llama.cpp keeps gate and up apart
            for j, (part, half) in enumerate((("gate", w[:, :MOE_INTERMEDIATE]), ("up", w[:, MOE_INTERMEDIATE:]))):
                # a seed each: random K-quant blocks of one seed would make gate and up the same matrix
                writer.add_tensor(f"blk.{layer}.{STACKED[part]}.weight", **stacked(half, expert_type, 1000 * j + i))
        elif name.endswith("mlp.experts.down_proj"):
            writer.add_tensor(f"blk.{layer}.{STACKED['down']}.weight", **stacked(w, expert_type, i))
        elif name.endswith("mlp.gate.weight"):
            writer.add_tensor(
                f"blk.{layer}.ffn_gate_inp.weight", w.astype(np.float32), raw_dtype=gguf.GGMLQuantizationType.F32
            )
        elif w.ndim == 1:
            writer.add_tensor(gguf_name(name), w.astype(np.float32), raw_dtype=gguf.GGMLQuantizationType.F32)
        else:
            data, qtype = encode(w, "Q8_0", seed=i)
            writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def stacked(w: np.ndarray, type_name: str, seed: int) -> dict:
    """add_tensor's arguments for a stack [E, R, K] of experts' matrices encoded row by row, written as a 3-D tensor
    as llama.cpp's are."""
    experts, rows, cols = w.shape
    data, qtype = encode(w.reshape(experts * rows, cols), type_name, seed)
    return dict(tensor=data.reshape(experts, rows, -1), raw_dtype=qtype)


def dequantized_reference(gguf_path: Path, model, tokenizer_folder: Path, out: Path):
    """transformers' Qwen3-MoE holding the file's weights as gguf-py dequantizes them."""
    reader = gguf.GGUFReader(gguf_path)
    weights = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        weights[t.name] = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    state = {}
    for name in model.state_dict():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("mlp.experts.gate_up_proj"):
            w = np.concatenate(
                [weights[f"blk.{layer}.ffn_gate_exps.weight"], weights[f"blk.{layer}.ffn_up_exps.weight"]], 1
            )
        elif name.endswith("mlp.experts.down_proj"):
            w = weights[f"blk.{layer}.ffn_down_exps.weight"]
        elif name.endswith("mlp.gate.weight"):
            w = weights[f"blk.{layer}.ffn_gate_inp.weight"]
        else:
            w = weights[gguf_name(name)]
        state[name] = torch.from_numpy(np.array(w, copy=True))
    model.load_state_dict(state)
    out.mkdir()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(out)
    for f in tokenizer_folder.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (out / f.name).write_bytes(f.read_bytes())
    return model


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    from tests.conftest import build_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(folder)
    return folder


@pytest.mark.parametrize("expert_type", ["Q4_K", "Q8_0", "Q4_0"])
def test_quantized_experts_give_transformers_tokens_on_the_dequantized_weights(
    expert_type, tokenizer_folder, tmp_path, monkeypatch
):
    path = write_moe_gguf(tmp_path / "moe.gguf", hf_moe_model(), expert_type, tokenizer_folder)
    reference = dequantized_reference(path, hf_moe_model(), tokenizer_folder, tmp_path / "reference")
    # Every kernel dequantizes to float32 (chooser's stand-in): the engine then computes the reference's products.
    monkeypatch.setattr(chooser, "_CHOICES", {})
    monkeypatch.setattr(chooser, "candidates", only_dequant)
    llm = make_llm(path)
    experts = llm.model_runner.model.model.layers[0].mlp.experts
    assert isinstance(experts, QuantizedFusedMoE) and len(experts.kernels["down_proj"]) == EXPERTS
    prompts = [prompt_ids(1, 5), prompt_ids(2, 30)]
    for prompt, result in zip(prompts, greedy(llm, prompts, max_tokens=24, k=1)):
        assert result["token_ids"] == hf_greedy(reference, prompt, 24)
    check_against_reference(llm, tmp_path / "reference", seed=5)  # logprobs too: the products are the reference's


def test_k_quant_experts_read_their_rows_of_the_stacked_blocks_in_place(tokenizer_folder, tmp_path, monkeypatch):
    """With the real kernels: a Q4_K expert's kernel holds a view of the file's stacked blocks, not a copy, and the
    layer's output is transformers' experts' on the dequantized weights, within the int8 activations' rounding."""
    from engine.quantization import kquant

    if kquant.ops() is None:
        pytest.skip("no C++ compiler for the K-quant kernel here")
    path = write_moe_gguf(tmp_path / "moe.gguf", hf_moe_model(), "Q4_K", tokenizer_folder)
    # The K-quant kernel alone (on shapes this small the chooser may measure PyTorch's int4 kernel faster)
    real = chooser.candidates
    monkeypatch.setattr(chooser, "_CHOICES", {})
    monkeypatch.setattr(
        chooser, "candidates", lambda qw, device, dtype: {"KQuantMatmul": real(qw, device, dtype)["KQuantMatmul"]}
    )
    llm = make_llm(path)
    experts = llm.model_runner.model.model.layers[1].mlp.experts
    kernels = experts.kernels["gate_proj"]
    assert all(type(k).__name__ == "KQuantMatmul" for k in kernels)
    base = kernels[0].blocks.untyped_storage().data_ptr()
    assert all(k.blocks.untyped_storage().data_ptr() == base for k in kernels)  # one stacked tensor, viewed
    # The layer against transformers' experts holding the dequantized weights, on tokens routed to every expert
    reference = dequantized_reference(path, hf_moe_model(), tokenizer_folder, tmp_path / "reference")
    g = torch.Generator().manual_seed(6)
    x = torch.randn(16, SIZES["hidden_size"], generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:PER_TOKEN] for _ in range(16)])
    weights = torch.rand(16, PER_TOKEN, generator=g)
    with torch.no_grad():
        want = reference.model.layers[1].mlp.experts(x, ids, weights)
    got = experts(x, weights, ids)
    # int8 activations (q8_K) against float32: about a percent of the output's scale
    torch.testing.assert_close(got, want, rtol=0, atol=0.03 * float(want.abs().max()))


@pytest.mark.parametrize("down_type", ["Q4_K", "Q6_K"])
def test_decode_steps_take_the_one_call_layer_and_it_equals_the_expert_by_expert_one(down_type):
    """K-quant experts without biases run a decode step's layer in one kquant.cpp call (kquant_moe): the same
    products as the per-expert kernels (x rounded alike, so to float32 sum order), for one token and for a few
    sharing experts; prefill-sized batches still go expert by expert."""
    experts, hidden = 8, 512
    layer = k_quant_experts(down_type, experts, hidden)
    assert layer.stacked is not None and all(type(k[0]).__name__ == "KQuantMatmul" for k in layer.kernels.values())
    g = torch.Generator().manual_seed(4)
    for tokens in (1, 5):
        x = torch.randn(tokens, hidden, generator=g)
        ids = torch.stack([torch.randperm(experts, generator=g)[:3] for _ in range(tokens)])
        weights = torch.rand(tokens, 3, generator=g)
        by_expert = layer._by_expert(x, weights, ids)
        fused = layer(x, weights, ids)
        torch.testing.assert_close(fused, by_expert, rtol=1e-5, atol=1e-5 * float(by_expert.abs().max()))
    calls = []
    layer._fused = lambda *a: calls.append(a)  # prefill's 17 tokens never reach it
    layer(torch.randn(17, hidden), torch.rand(17, 3), torch.randint(0, experts, (17, 3)))
    assert not calls


def test_a_one_call_layer_that_disagrees_on_its_check_is_not_used(monkeypatch, caplog):
    """The one-call layer is checked against the expert-by-expert one at load; off by more than the rounding,
    the layer runs expert by expert from then on, and says so."""
    real_fused = QuantizedFusedMoE._fused
    monkeypatch.setattr(QuantizedFusedMoE, "_fused", lambda self, x, w, ids: 2 * real_fused(self, x, w, ids))
    with caplog.at_level(logging.WARNING, logger="engine"):
        layer = k_quant_experts("Q4_K", 8, 512)
    assert layer.stacked is None and "one-call MoE kernel is off" in caplog.text
    x, ids, weights = torch.randn(1, 512), torch.tensor([[0, 3, 5]]), torch.rand(1, 3)
    torch.testing.assert_close(layer(x, weights, ids), layer._by_expert(x, weights, ids))


def k_quant_experts(down_type: str, experts: int, hidden: int, width: int = 256) -> QuantizedFusedMoE:
    """A CPU layer of random K-quant experts (Q4_K gate and up, `down_type` down); skips without the kernel."""
    from engine.quantization import kquant
    from engine.quantization.modules import KernelTarget
    from tests.shaped_gguf import _random_blocks

    if kquant.ops() is None:
        pytest.skip("no C++ compiler for the K-quant kernel here")
    rng = np.random.default_rng(3)
    layer = QuantizedFusedMoE(experts, hidden, width, KernelTarget(torch.device("cpu"), torch.float32, False))
    blocks = {
        "gate_proj": ("Q4_K", _random_blocks("Q4_K", experts * width, hidden, rng), hidden),
        "up_proj": ("Q4_K", _random_blocks("Q4_K", experts * width, hidden, rng), hidden),
        "down_proj": (down_type, _random_blocks(down_type, experts * hidden, width, rng), width),
    }
    for name, (type_name, stored, cols) in blocks.items():
        layer.load_checkpoint_tensor(f"{name}.weight", kquant_weight(type_name, stored, cols))
    return layer


def kquant_weight(type_name: str, stored: np.ndarray, cols: int):
    from functools import partial

    from engine.loader.gguf_blocks import QUANT_TYPES, decode_stored
    from engine.quantization.blocks import BlockWeight

    _, _, bits, group = QUANT_TYPES[type_name]
    blocks = torch.from_numpy(stored)
    return BlockWeight(blocks, type_name, (blocks.shape[0], cols), bits, group, partial(decode_stored, type_name))
