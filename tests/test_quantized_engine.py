"""Weight-only quantization through the engine: a quantized engine against a float32 model whose checkpoint holds
the dequantized weights (exactly, on the float32 DequantMatmul; within bf16 on the kernels chosen by measurement),
the bytes a tied model holds, the kernels print(model) and stats() name, and the settings the engine refuses."""

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.quantization import chooser
from engine.quantization.kernels import DequantMatmul, Int8PackMatmul
from engine.quantization.layout import quantize_int4, quantize_int8
from engine.quantization.methods import head_method
from tests.quantized_weights import logprob_differences, only_dequant

# what the pass swaps: the linear layers, the head and the table
QUANTIZED_TENSORS = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")


def dequantized_copy(src: Path, dst: Path, method: str, group_size: int) -> Path:
    """`src` with every tensor the engine quantizes replaced by its quantized-then-dequantized value,
    in float32: what a quantized engine computes, as a plain checkpoint."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tied = json.loads((src / "config.json").read_text()).get("tie_word_embeddings", False)
    for file in sorted(src.glob("*.safetensors")):
        tensors = load_file(file)
        for name, t in tensors.items():
            if name.endswith(QUANTIZED_TENSORS):
                # the engine's rule: under int4 the head (and a tied embedding, its table) is int8
                table = name.endswith("lm_head.weight") or (tied and name.endswith("embed_tokens.weight"))
                how = head_method(method) if table else method
                qw = quantize_int8(t) if how == "int8" else quantize_int4(t, group_size)
                tensors[name] = qw.dequantize()
            else:
                tensors[name] = t.float()
        save_file(tensors, dst / file.name, metadata={"format": "pt"})
    return dst


@pytest.fixture
def forced_dequant(monkeypatch):
    """Every quantized weight on the float32 DequantMatmul: the engine then computes with exactly the
    dequantized weights, so it must equal a float32 model holding them up to summation order."""
    monkeypatch.setattr(chooser, "_CHOICES", {})
    monkeypatch.setattr(chooser, "candidates", only_dequant)


@pytest.fixture(scope="module")
def references(tiny_models, tmp_path_factory):
    """`references(family, method, group_size)`: (dequantized folder, its float32 LLM), built once."""
    cache = {}

    def get(family: str, method: str, group_size: int):
        key = (family, method, group_size)
        if key not in cache:
            folder = dequantized_copy(tiny_models[family], tmp_path_factory.mktemp("deq") / family, method, group_size)
            cache[key] = folder, LLM(str(folder), dtype="float32", num_kvcache_blocks=64)
        return cache[key]

    return get


def run(llm, prompts, max_tokens=8, k=20):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=k, prompt_logprobs=k)
    return llm.generate(prompts, params, use_tqdm=False)


def logprob_rows(result) -> list[dict[int, float]]:
    """Every position's {token: logprob}: the prompt's (after the first token), then the output's."""
    return [*result["prompt_logprobs"][1:], *result["logprobs"]]


def compare_rows(got: list[dict], want: list[dict], atol: float, min_common: int, mean_atol: float | None = None):
    """Values agree within `atol` (and on average within `mean_atol`) on the tokens both rows list: a
    top-k can swap members that tie within the tolerance."""
    diffs = logprob_differences(got, want, min_common)
    worst, mean = max(diffs), sum(diffs) / len(diffs)
    assert worst <= atol, f"logprobs differ by up to {worst:.3g} (allowed {atol})"
    assert mean_atol is None or mean <= mean_atol, f"logprobs differ by {mean:.3g} on average (allowed {mean_atol})"


METHODS = [("int4", 32), ("int8", 64)]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("method,group_size", METHODS, ids=[m for m, _ in METHODS])
def test_quantized_engine_equals_float32_model_of_dequantized_weights(
    family, method, group_size, tiny_models, references, forced_dequant, random_prompt
):
    _, reference = references(family, method, group_size)
    llm = LLM(
        str(tiny_models[family]),
        dtype="float32",
        num_kvcache_blocks=64,
        quantization=method,
        quantization_group_size=group_size,
    )
    assert "DequantMatmul" in llm.stats().matmul and "DequantMatmul" in str(llm.model_runner.model)
    prompts = [random_prompt(21, 7), random_prompt(5, 8)]
    got, want = run(llm, prompts), run(reference, prompts)
    for g, w in zip(got, want):
        assert g["token_ids"] == w["token_ids"]
        # float32 both sides; only the order of the sums differs (oneDNN's packed matmul vs F.linear)
        compare_rows(logprob_rows(g), logprob_rows(w), atol=2e-5, min_common=20)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("method,group_size", METHODS, ids=[m for m, _ in METHODS])
def test_quantized_engine_with_chosen_kernels_agrees_within_bf16(
    family, method, group_size, tiny_models, references, random_prompt
):
    """The kernels chosen by measurement run bf16 activations: the same positions (teacher-forced on the
    reference's greedy reply, so a near-tie flipping a token cannot shift them) give logprobs within a
    bf16 tolerance. Measured: up to 0.09 apart, 0.019 on average, over logprobs spanning 0..-12. The
    original (unquantized) weights differ from the reference by 0.26 / 0.05 (int8) and 2.5 / 0.5
    (int4): the mean bound would catch even a kernel computing the unquantized weights."""
    _, reference = references(family, method, group_size)
    llm = LLM(
        str(tiny_models[family]),
        dtype="float32",
        num_kvcache_blocks=64,
        quantization=method,
        quantization_group_size=group_size,
    )
    # int4's groups of 32 may go to Pagoda's own kernel (8-bit rounded rows) where it measures faster here
    kernels_run = {"int4": ("Int4PackMatmul", "GroupedInt8Matmul"), "int8": ("Int8PackMatmul",)}[method]
    assert any(k in llm.stats().matmul and k in str(llm.model_runner.model) for k in kernels_run)
    prompt = random_prompt(21, 7)
    sequence = prompt + run(reference, [prompt])[0]["token_ids"]
    got, want = run(llm, [sequence], max_tokens=1), run(reference, [sequence], max_tokens=1)
    compare_rows(logprob_rows(got[0])[:-1], logprob_rows(want[0])[:-1], atol=0.2, min_common=15, mean_atol=0.035)


@pytest.mark.parametrize("method,ratio", [("int8", 0.30), ("int4", 0.22)])
def test_tied_model_bytes(method, ratio, tiny_llama, monkeypatch):
    """The tiny llama ties its head to a 320 x 64 table; its linear weights and table hold 94k values
    against 320 norm values, so norms are 0.3% of the float32 bytes and the ratio is the weights'.
    int8: 1 byte a weight plus a scale per row, the table counted once (shared with the head's codes),
    about 0.26x; a second copy of the table would push it past 0.30x. int4: half a byte plus a bf16
    scale and zero per group of 64 in the kernels, the table's own codes apart, about 0.18x.
    These are the packed kernels' layouts: a loaded CI machine once timed the dequantizing fallback
    faster at these tiny shapes (0.32x and 0.24x), so the timer ranks it last here."""
    monkeypatch.setattr(chooser, "_CHOICES", {})
    monkeypatch.setattr(
        chooser, "_seconds_per_call", lambda kernel, x, calls=20: 1.0 if isinstance(kernel, DequantMatmul) else 0.5
    )
    fp32_bytes = 4 * sum(t.numel() for f in tiny_llama.glob("*.safetensors") for t in load_file(f).values())
    llm = LLM(str(tiny_llama), dtype="float32", num_kvcache_blocks=64, quantization=method)
    held = llm.parameter_bytes()[0]
    assert held <= ratio * fp32_bytes, f"{held} bytes is {held / fp32_bytes:.3f}x float32"
    model = llm.model_runner.model
    head, embedding = model.lm_head.parts[0], model.model.embed_tokens
    assert isinstance(head, Int8PackMatmul)  # int8 under int4 too (head_method)
    # the table is the head's codes, not a copy: the embedding reads its rows there
    assert embedding.table is None and embedding.rows_from_head == head.looked_up_rows
    assert f"{method}:" in str(model)  # print(model) says what the weights are


def test_print_model_and_stats_name_the_kernels(tiny_qwen2, monkeypatch):
    # Kernels are chosen by timing, and a loaded machine once timed the slab fallback faster at these tiny
    # shapes: a timer that ranks it last (and no choices left from earlier tests) makes the names certain.
    monkeypatch.setattr(chooser, "_CHOICES", {})
    monkeypatch.setattr(
        chooser, "_seconds_per_call", lambda kernel, x, calls=20: 1.0 if isinstance(kernel, DequantMatmul) else 0.5
    )
    llm = LLM(str(tiny_qwen2), dtype="float32", num_kvcache_blocks=64, quantization="int4", quantization_group_size=32)
    text, matmul = str(llm.model_runner.model), llm.stats().matmul
    assert "Int4PackMatmul(" in text and "int4: 4-bit, groups of 32" in text and "QuantizedEmbedding(" in text
    # qkv, o, gate_up, down per layer (2 layers) at int4, and the head at int8: named with their counts
    assert matmul == "Int4PackMatmul x8, Int8PackMatmul x1", matmul
    assert llm.stats().quantization == "int4 (groups of 32; LM head int8)"


# ---- errors ----------------------------------------------------------------------------------------------------------


def test_unknown_quantization_names_the_choices(tiny_llama):
    with pytest.raises(ValueError, match=r"quantization must be one of \('int8', 'int4'\).*'fp4'"):
        LLM(str(tiny_llama), quantization="fp4")


def test_quantization_with_tensor_parallel_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(tiny_llama), quantization="int8", tensor_parallel_size=2, device="cpu")


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_checkpoint_quantized_by_another_tool_is_refused(quantization, tiny_llama, tmp_path):
    folder = tmp_path / "gptq"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"already quantized with gptq.*full-precision checkpoint"):
        LLM(str(folder), quantization=quantization)
