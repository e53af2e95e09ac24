"""The multi-token-prediction head Qwen3.5 checkpoints ship (`mtp.*`, engine/models/qwen3_5_mtp.py): a checkpoint
that has one loads and generates as transformers does (which skips the head too), and `load_mtp_head` puts every
one of its tensors where the head's layers read them: the projections packed as the model packs its own, the
experts of the MoE models. A checkpoint without a head, or with one missing a tensor, is refused with the reason."""

import pytest
import torch
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.layers.rotary_embedding import RotaryEmbedding
from engine.models.qwen3_5_mtp import load_mtp_head
from tests.conftest import build_tokenizer, qwen3_5_model, widen_weights
from tests.test_parity import hf_greedy


def checkpoint_with_mtp(folder, moe: bool, drop: str | None = None) -> dict[str, torch.Tensor]:
    """A tiny Qwen3.5 checkpoint and, in a file of its own, a head whose decoder layer has the names and shapes of
    the model's full-attention layer (its last); returns the head's tensors."""
    torch.manual_seed(7)
    model = qwen3_5_model(moe)
    widen_weights(model)
    model.save_pretrained(folder)
    build_tokenizer(folder)
    head = {f"mtp.{name}": t for name, t in random_head(model).items() if f"mtp.{name}" != drop}
    save_file({n: t.contiguous() for n, t in head.items()}, str(folder / "mtp.safetensors"))
    return head


def random_head(model) -> dict[str, torch.Tensor]:
    """Random tensors for `model`'s head, named as `mtp.*` is without the prefix: its decoder layer has the names
    and shapes of the model's full-attention layer (its last)."""
    size = model.config.hidden_size
    last = f"model.layers.{model.config.num_hidden_layers - 1}."
    head = {f"layers.0.{n.removeprefix(last)}": t for n, t in model.state_dict().items() if n.startswith(last)}
    head |= {"fc.weight": torch.empty(size, 2 * size)}
    head |= {f"{norm}.weight": torch.empty(size) for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    return {name: torch.randn_like(t) for name, t in head.items()}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_checkpoint_with_a_head_serves_the_model_and_loads_the_head(tmp_path, moe, hf_model, random_prompt):
    tensors = checkpoint_with_mtp(tmp_path, moe)
    llm = LLM(str(tmp_path), dtype="float32", num_kvcache_blocks=32)
    prompt = random_prompt(20, 160)
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert got[0]["token_ids"] == hf_greedy(hf_model(tmp_path), prompt, 16)

    runner = llm.model_runner
    head = load_mtp_head(runner.model, runner.hf_config, tmp_path)
    assert torch.equal(head.fc.weight, tensors["mtp.fc.weight"])
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        assert torch.equal(getattr(head, norm).weight, tensors[f"mtp.{norm}.weight"])
    layer, names = head.layers[0], ("q_proj", "k_proj", "v_proj")
    packed = torch.cat([tensors[f"mtp.layers.0.self_attn.{n}.weight"] for n in names])
    assert torch.equal(layer.self_attn.qkv_proj.weight, packed)
    assert layer.linear_attn is None
    if moe:  # expert 3's down projection, stacked with the others'
        down = tensors["mtp.layers.0.mlp.experts.down_proj"][3]
        assert torch.equal(layer.mlp.experts.down_proj[3], down)
    else:
        assert torch.equal(layer.mlp.down_proj.weight, tensors["mtp.layers.0.mlp.down_proj.weight"])
    assert head.embed_tokens is runner.model.model.embed_tokens  # shared with the model, not a copy
    # the model's rotary table serves the head's attention, outside the head's modules (which a GGUF load moves)
    assert layer.self_attn.rotary is runner.model.model.layers[-1].self_attn.rotary
    assert not any(isinstance(m, RotaryEmbedding) for m in head.modules())
    assert not any(name.startswith("embed") for name, _ in head.named_parameters())


def test_a_checkpoint_without_a_head_or_with_half_of_one_is_refused(tmp_path):
    (tmp_path / "none").mkdir()
    torch.manual_seed(7)
    model = qwen3_5_model(False)
    model.save_pretrained(tmp_path / "none")
    build_tokenizer(tmp_path / "none")
    llm = LLM(str(tmp_path / "none"), dtype="float32", num_kvcache_blocks=32)
    with pytest.raises(ValueError, match="has no multi-token-prediction head"):
        load_mtp_head(llm.model_runner.model, llm.model_runner.hf_config, tmp_path / "none")
    (tmp_path / "half").mkdir()
    checkpoint_with_mtp(tmp_path / "half", moe=False, drop="mtp.norm.weight")
    with pytest.raises(ValueError, match="lacks 1 tensors, e.g. \\['norm.weight'\\]"):
        load_mtp_head(llm.model_runner.model, llm.model_runner.hf_config, tmp_path / "half")
