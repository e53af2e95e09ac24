"""gpt-oss (engine/models/gpt_oss.py) beyond the greedy parity of tests/test_parity.py: its YaRN rotary, the engine's
paths parity does not take (a prefix-cache hit over the sliding layer, preemption), which attention backends can
compute its sinks, and the checkpoints and passes it refuses, each with a message that says what to do."""

import json
import shutil

import pytest
import torch

from engine import SamplingParams
from engine.attention import select_backend
from engine.layers.rotary_embedding import _inv_freq, attention_factor, rope_parameters
from engine.models.gpt_oss import GptOssQuantizedExperts
from engine.quantization import chooser
from tests.quantized_weights import only_dequant
from tests.test_parity import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_and_attention_factor_equal_transformers(truncate):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    rope = {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
        "rope_theta": 150000.0,
        "truncate": truncate,
    }
    config = GptOssConfig(
        hidden_size=64, num_attention_heads=4, head_dim=64, max_position_embeddings=131072, rope_parameters=rope
    )
    expected, factor = _compute_yarn_parameters(config)
    params = rope_parameters(config)
    assert torch.equal(_inv_freq(64, params), expected)
    assert attention_factor(params) == pytest.approx(factor)


def test_a_prefix_cache_hit_and_preemption_keep_transformers_tokens(
    tiny_models, make_llm, hf_model, random_prompt, monkeypatch
):
    path = tiny_models["gpt_oss"]
    model = hf_model(path)
    # 4 requests of up to 78 tokens need 20 blocks of 16 of both layers as one group; with a group per layer kind
    # (engine/runner/kv_cache.py) a block holds one layer, and the sliding layer holds only its window: 24 are the
    # same memory as 12 were, and still too few for all four at once
    llm = make_llm(path, num_kvcache_blocks=24)
    system = random_prompt(40, 60)
    llm.generate([system + random_prompt(5, 61)], GREEDY, use_tqdm=False)
    second = system + random_prompt(9, 62)
    hit = llm.generate([second], GREEDY, use_tqdm=False)[0]
    assert hit["num_cached_tokens"] >= 32, "the shared 40-token prefix should have come from the cache"
    assert hit["token_ids"] == hf_greedy(model, second, 48)

    preempted = []
    preempt = llm.scheduler._preempt
    monkeypatch.setattr(llm.scheduler, "_preempt", lambda seq: (preempted.append(seq.request_id), preempt(seq)))
    prompts = [random_prompt(n, 70 + n) for n in (30, 12, 25, 5)]
    results = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert preempted, "the cache was meant to be too small for every request at once"
    for prompt, result in zip(prompts, results):
        assert result["token_ids"] == hf_greedy(model, prompt, 48)


def test_attention_sinks_take_a_backend_that_computes_them():
    """flash-attn 2 has no sinks: `auto` takes Triton's kernels on CUDA (tests/test_triton_attention.py checks their
    sinks), and flash-attn asked for by name is refused with what to use."""
    pytest.importorskip("triton")
    cuda = torch.device("cuda")  # only chosen here, never used: the choice needs no GPU
    assert select_backend("auto", cuda, torch.bfloat16, 256, sinks=True).name == "triton"
    assert select_backend("auto", torch.device("cpu"), torch.float32, 16, sinks=True).name == "torch"
    with pytest.raises(ValueError, match="does not compute attention sinks yet.*'torch' or 'triton'"):
        select_backend("flash-attn", cuda, torch.bfloat16, 256, sinks=True)


def test_the_model_shows_its_sinks_window_and_experts(tiny_models, make_llm):
    shown = str(make_llm(tiny_models["gpt_oss"]).model_runner.model)
    assert "sliding_window=10, sinks" in shown and "experts=8, hidden=64, intermediate=32, swiglu_limit=7.0" in shown


def test_quantizing_its_experts_at_load_is_refused_with_what_to_do(tiny_models, make_llm):
    with pytest.raises(ValueError, match="does not cover mixture-of-experts layers yet"):
        make_llm(tiny_models["gpt_oss"], quantization="int8")


def mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, columns] as MXFP4 blocks and scales, each group of 32 scaled so its largest value is at most 6
    (the largest E2M1 value) and rounded to the nearest code: how OpenAI's checkpoints store experts."""
    from engine.quantization.mxfp4 import FP4_VALUES

    groups = weight.float().unflatten(-1, (-1, 32))
    exponent = (torch.floor(torch.log2(groups.abs().amax(-1).clamp(min=2**-100))) - 2).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - torch.tensor(FP4_VALUES)).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tiny_models, tmp_path_factory):
    """The tiny gpt-oss with its experts in MXFP4 as transformers names them (`*_blocks`, `*_scales`), and the
    transformers model with those experts widened by transformers' own dequantizer: the reference."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder = shutil.copytree(tiny_models["gpt_oss"], tmp_path_factory.mktemp("mxfp4") / "gpt-oss")
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(file)
    reference = AutoModelForCausalLM.from_pretrained(tiny_models["gpt_oss"], dtype=torch.float32).eval()
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # transformers holds [experts, in, out]; MXFP4 groups each output row's inputs
        blocks, scales = mxfp4(tensors.pop(name).transpose(1, 2))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        widened = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        reference.get_parameter(name).data.copy_(widened)
    save_file(tensors, file)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, reference


def test_mxfp4_experts_load_as_shipped_and_give_transformers_tokens(
    mxfp4_gpt_oss, make_llm, random_prompt, monkeypatch
):
    """OpenAI's checkpoints were refused ("already quantized with mxfp4"). Now the experts stay MXFP4 in memory,
    repacked losslessly into GGUF's layout: with every kernel the float32 dequantizing one (the chooser's stand-in),
    the engine computes transformers' products on transformers' own widening of the codes."""
    folder, reference = mxfp4_gpt_oss
    monkeypatch.setattr(chooser, "_CHOICES", {})
    monkeypatch.setattr(chooser, "candidates", only_dequant)
    llm = make_llm(folder, max_num_batched_tokens=16)  # chunked prefill too
    experts = llm.model_runner.model.model.layers[0].mlp.experts
    assert isinstance(experts, GptOssQuantizedExperts) and not hasattr(experts, "gate_up_proj")
    assert {k.source for p in experts.kernels.values() for k in p} == {"MXFP4"}
    assert llm.stats().quantization == "MXFP4 experts, as the checkpoint stores them"
    prompts = [random_prompt(n, 90 + n) for n in (5, 23, 40)]
    for prompt, result in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert result["token_ids"] == hf_greedy(reference, prompt, 48)
    # The same checkpoint read by transformers (its own MXFP4 loader, dequantizing) agrees with the reference.
    from transformers import AutoModelForCausalLM, Mxfp4Config

    theirs = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    assert hf_greedy(theirs, prompts[1], 48) == hf_greedy(reference, prompts[1], 48)


def test_the_cpu_kernel_reads_mxfp4_experts_as_stored(mxfp4_gpt_oss, make_llm):
    """With the real kernels: each expert's kernel is kquant.cpp's over its rows of one stacked tensor of 17-byte
    blocks (4.25 bits a weight, not a byte a code), and the layer's output is transformers' experts' on the widened
    weights within the int8 activations' rounding."""
    from engine.quantization import kquant

    if kquant.ops() is None:
        pytest.skip("no C++ compiler for the CPU kernel here")
    folder, reference = mxfp4_gpt_oss
    experts = make_llm(folder).model_runner.model.model.layers[1].mlp.experts
    kernels = experts.kernels["gate_proj"]
    assert all(type(k).__name__ == "KQuantMatmul" for k in kernels)
    assert kernels[0].blocks.shape == (32, 64 // 32 * 17)
    base = kernels[0].blocks.untyped_storage().data_ptr()
    assert all(k.blocks.untyped_storage().data_ptr() == base for k in kernels)  # one stacked tensor, viewed
    g = torch.Generator().manual_seed(6)
    x = torch.randn(16, 64, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(16)])
    weights = torch.rand(16, 2, generator=g)
    with torch.no_grad():
        want = reference.model.layers[1].mlp.experts(x, ids, weights)
        got = experts(x, weights, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0.03 * float(want.abs().max()))


def test_a_broken_mxfp4_checkpoint_is_refused_naming_the_tensor(mxfp4_gpt_oss, make_llm, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(mxfp4_gpt_oss[0], tmp_path / "broken")
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(file)
    name = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name][:, :3].contiguous()  # a scale row for only 3 of the 64 rows
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"down_proj_scales.*has shape \(8, 3, 1\), the model expects \(8, 64, 1\)"):
        make_llm(folder)


def test_mxfp4_blocks_without_their_scales_are_named_missing(mxfp4_gpt_oss, make_llm, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(mxfp4_gpt_oss[0], tmp_path / "no-scales")
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"lacks 1 tensors, e.g. \['model.layers.0.mlp.experts.down_proj_scales'\]"):
        make_llm(folder)
