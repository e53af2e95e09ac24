"""A Gemma 3 checkpoint with a vision tower (gemma-3-4b-it's layout): the engine serves its language model alone,
from the hub's tensor names and from transformers 5's own, and never reads the vision part."""

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine import SamplingParams
from tests.conftest import COMMON, build_tokenizer
from tests.test_parity import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3_multimodal(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3_mm")
    torch.manual_seed(9)
    text = transformers.Gemma3TextConfig(
        **COMMON,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4, image_token_index=5
    )
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # small embeddings: scaled by sqrt(hidden) and tied, large ones make the model repeat itself
        for name, p in model.named_parameters():
            p.normal_(0, 0.03 if "embed" in name else (0.1 if "norm" in name else 0.3))
    model.save_pretrained(folder)
    build_tokenizer(folder)
    return folder, model.eval()


def test_the_language_model_of_a_vision_checkpoint_gives_transformers_tokens(
    gemma3_multimodal, make_llm, random_prompt
):
    folder, model = gemma3_multimodal
    tensors = load_file(folder / "model.safetensors")
    assert any(name.startswith("vision_tower.") for name in tensors) and "language_model.model.norm.weight" in tensors
    llm = make_llm(folder)
    assert type(llm.model_runner.model).__name__ == "Gemma3ForConditionalGeneration"
    assert not any("vision" in name for name, _ in llm.model_runner.model.named_parameters())
    prompts = [random_prompt(n, 80 + n) for n in (4, 29)]
    for prompt, result in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert result["token_ids"] == hf_greedy(model, prompt, 40)


def test_transformers_5_tensor_names_load_alike(gemma3_multimodal, make_llm, random_prompt, tmp_path):
    folder, _ = gemma3_multimodal
    renamed = tmp_path / "v5"
    renamed.mkdir()
    for item in folder.iterdir():
        if item.name != "model.safetensors":
            (renamed / item.name).write_bytes(item.read_bytes())
    tensors = {
        name.replace("language_model.model.", "model.language_model.").replace(
            "vision_tower.", "model.vision_tower."
        ): t
        for name, t in load_file(folder / "model.safetensors").items()
    }
    save_file(tensors, renamed / "model.safetensors", metadata={"format": "pt"})
    prompt = random_prompt(17, 90)
    expected = make_llm(folder).generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"]
    assert make_llm(renamed).generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == expected
