"""The model catalog: consistent numbers, memory arithmetic, fit sentences, estimates from a config.json."""

import json
import sys

import pytest

from app.catalog import (
    SUPPORTED_ARCHITECTURES,
    CatalogEntry,
    count_active_params,
    count_params,
    entry_for_repo,
    entry_from_config,
    load_catalog,
    sliding_layers,
)
from app.config_shapes import counted_params, kv_shape
from app.device_memory import GiB, MiB, available_memory
from app.memory_estimate import estimate_memory, fit_report, quantization_advice, weights_bytes

REQUESTED = {
    "HuggingFaceTB/SmolLM2-135M-Instruct",
    "HuggingFaceTB/SmolLM2-360M-Instruct",
    "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    "Qwen/Qwen2.5-0.5B-Instruct",
    "Qwen/Qwen2.5-1.5B-Instruct",
    "Qwen/Qwen2.5-3B-Instruct",
    "Qwen/Qwen3-0.6B",
    "Qwen/Qwen3-1.7B",
    "Qwen/Qwen3-4B",
    "meta-llama/Llama-3.2-1B-Instruct",
    "meta-llama/Llama-3.2-3B-Instruct",
    "Qwen/Qwen3-8B",
    "Qwen/Qwen3.5-4B",
    "Qwen/Qwen3.5-9B",
    "Qwen/Qwen3.6-35B-A3B",
    "meta-llama/Llama-3.1-8B-Instruct",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
    "Qwen/Qwen3-8B-GGUF",
    "bartowski/Meta-Llama-3.1-8B-Instruct-GGUF",
    "Qwen/Qwen2.5-0.5B-Instruct-GGUF",
    "ggml-org/gpt-oss-20b-GGUF",
    "Qwen/Qwen3-30B-A3B-GGUF",
    "HuggingFaceTB/SmolLM3-3B",
    "microsoft/Phi-4-mini-instruct",
    "google/gemma-3-4b-it",
    "google/gemma-3-12b-it",
    "mistralai/Ministral-8B-Instruct-2410",
}
# GGUF repos: the one file each entry downloads, and its quantization
GGUF = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": ("SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1"),  # bundled
    "Qwen/Qwen3-8B-GGUF": ("Qwen3-8B-Q4_K_M.gguf", "Q4_K_M"),
    "bartowski/Meta-Llama-3.1-8B-Instruct-GGUF": ("Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf", "Q4_K_M"),
    "Qwen/Qwen2.5-0.5B-Instruct-GGUF": ("qwen2.5-0.5b-instruct-q4_k_m.gguf", "Q4_K_M"),
    "ggml-org/gpt-oss-20b-GGUF": ("gpt-oss-20b-mxfp4.gguf", "MXFP4"),
    "Qwen/Qwen3-30B-A3B-GGUF": ("Qwen3-30B-A3B-Q4_K_M.gguf", "Q4_K_M"),
}

# (layers, kv heads, head_dim, max_position_embeddings) from each repo's config.json
KNOWN = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": (30, 3, 64, 8192),
    "Qwen/Qwen2.5-0.5B-Instruct": (24, 2, 64, 32768),
    "Qwen/Qwen2.5-1.5B-Instruct": (28, 2, 128, 32768),
    "Qwen/Qwen3-0.6B": (28, 8, 128, 40960),
    "Qwen/Qwen3-4B": (36, 8, 128, 40960),
    "meta-llama/Llama-3.2-1B-Instruct": (16, 8, 64, 131072),
    "meta-llama/Llama-3.2-3B-Instruct": (28, 8, 128, 131072),
    "Qwen/Qwen3-8B": (36, 8, 128, 40960),
    "meta-llama/Llama-3.1-8B-Instruct": (32, 8, 128, 131072),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": (28, 4, 128, 131072),
    "Qwen/Qwen3-8B-GGUF": (36, 8, 128, 40960),  # the model it was made from
    "google/gemma-3-12b-it": (48, 8, 256, 131072),  # its text_config
    "mistralai/Ministral-8B-Instruct-2410": (36, 8, 128, 32768),
}


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def test_catalog_has_the_requested_models_once(catalog):
    ids = [e.repo_id for e in catalog]
    assert len(ids) == len(set(ids))
    assert set(ids) == REQUESTED
    assert [e.repo_id for e in catalog if e.bundled] == ["HuggingFaceTB/SmolLM2-135M-Instruct"]


def test_every_entry_is_consistent(catalog):
    for e in catalog:
        assert e.supported, e.repo_id
        assert e.family == SUPPORTED_ARCHITECTURES[e.architecture]
        assert e.checkpoint_dtype == "bfloat16"
        assert e.num_attention_heads % e.num_key_value_heads == 0, e.repo_id
        assert e.head_dim * e.num_attention_heads == e.hidden_size or e.family in (
            "qwen3",
            "qwen3_moe",
            "gemma3",
            "gpt_oss",
            "qwen3_5",
            "qwen3_5_moe",
        )
        # The parameter count follows from the architecture numbers (tied embeddings counted once); a hybrid
        # model's, counted on transformers' own model of its config (its linear layers' sizes are not entry fields)
        counted = (
            counted_params(hybrid_config(e))
            if e.family in HYBRID_VALUE_HEADS
            else count_params(
                hidden_size=e.hidden_size,
                intermediate_size=e.intermediate_size,
                vocab_size=e.vocab_size,
                num_hidden_layers=e.num_hidden_layers,
                num_attention_heads=e.num_attention_heads,
                num_key_value_heads=e.num_key_value_heads,
                head_dim=e.head_dim,
                tie_word_embeddings=e.tie_word_embeddings,
                family=e.family,
                num_experts=e.num_experts,
                moe_intermediate_size=e.moe_intermediate_size,
            )
        )
        assert counted == e.params, e.repo_id
        if e.family in HYBRID_VALUE_HEADS:  # a quarter of the layers hold a KV cache, beside a fixed state
            shape = kv_shape(hybrid_config(e))
            assert (e.num_kv_layers, e.state_bytes) == (shape.num_kv_layers, shape.state_bytes), e.repo_id
        if e.num_experts:  # what a token's step reads: the routed experts, not the embedding table
            assert e.active_params == count_active_params(
                e.params,
                hidden_size=e.hidden_size,
                vocab_size=e.vocab_size,
                num_hidden_layers=e.num_hidden_layers,
                num_experts=e.num_experts,
                num_experts_per_tok=e.num_experts_per_tok,
                expert_intermediate_size=e.moe_intermediate_size or e.intermediate_size,
                family=e.family,
            )
        assert (e.gguf_file, e.gguf_type) == GGUF.get(e.repo_id, ("", "")), e.repo_id
        if e.is_gguf:
            # One quantized file: 4 to 8.5 bits a weight (small models keep their embedding at 8 bits).
            assert 0.5 * e.params <= e.download_bytes <= 1.1 * e.params, e.repo_id
            assert e.gguf_file.endswith(".gguf") and e.gguf_type in e.gguf_file.upper().replace(".", "_")
        else:
            # bf16 download: 2 bytes per stored parameter (a tied head may be stored twice) plus tokenizer files.
            low, high = 2 * e.params, 2 * (e.params + e.vocab_size * e.hidden_size) + 30 * MiB
            assert low <= e.download_bytes <= high, e.repo_id
        assert e.size_is_approximate != e.bundled  # the bundled file's size is known exactly
        assert e.gated == e.repo_id.startswith(("meta-llama/", "google/gemma", "mistralai/Ministral")), e.repo_id
        assert e.license and e.description and e.params_label
        assert e.params_label[:-1].replace(".", "").isdigit() and e.params_label[-1] in "MB"


# Qwen3.5's linear layers (16 key heads and this many value heads, of 128): the checkpoints' configs, as copied in
# public code (the hub is not reachable here); Qwen3.6-35B-A3B's parameter count matches llama.cpp's for its GGUF
HYBRID_VALUE_HEADS = {"qwen3_5": 32, "qwen3_5_moe": 32}


def hybrid_config(e) -> dict:
    experts = {}
    if e.num_experts:  # Qwen3.6-35B-A3B's shared expert is as wide as one routed expert
        experts = dict(num_experts=e.num_experts, num_experts_per_tok=e.num_experts_per_tok)
        experts.update(moe_intermediate_size=e.moe_intermediate_size, shared_expert_intermediate_size=512)
    return dict(
        model_type=f"{e.family}_text",
        vocab_size=e.vocab_size,
        hidden_size=e.hidden_size,
        intermediate_size=e.intermediate_size,
        num_hidden_layers=e.num_hidden_layers,
        num_attention_heads=e.num_attention_heads,
        num_key_value_heads=e.num_key_value_heads,
        head_dim=e.head_dim,
        linear_num_key_heads=16,
        linear_num_value_heads=HYBRID_VALUE_HEADS[e.family],
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(e.num_hidden_layers)],
        tie_word_embeddings=e.tie_word_embeddings,
        **experts,
    )


@pytest.mark.parametrize("repo_id", sorted(KNOWN))
def test_known_config_values(catalog, repo_id):
    e = next(x for x in catalog if x.repo_id == repo_id)
    assert (e.num_hidden_layers, e.num_key_value_heads, e.head_dim, e.max_position_embeddings) == KNOWN[repo_id]


def test_licenses(catalog):
    lic = {e.repo_id: e.license for e in catalog}
    assert lic["meta-llama/Llama-3.2-1B-Instruct"] == "llama3.2"
    assert lic["Qwen/Qwen2.5-3B-Instruct"] == "qwen-research"
    assert lic["Qwen/Qwen3-0.6B"] == "apache-2.0"
    assert lic["meta-llama/Llama-3.1-8B-Instruct"] == lic["bartowski/Meta-Llama-3.1-8B-Instruct-GGUF"] == "llama3.1"
    assert lic["deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"] == "mit"


def test_the_8b_models_have_their_known_sizes(catalog):
    params = {e.repo_id: e.params for e in catalog}
    # Unique parameters as published: Qwen3-8B 8.19B, Llama 3.1 8B 8.03B, DeepSeek-R1-Distill-Qwen-7B 7.62B.
    assert params["Qwen/Qwen3-8B"] == params["Qwen/Qwen3-8B-GGUF"] == 8_190_735_360
    assert params["meta-llama/Llama-3.1-8B-Instruct"] == 8_030_261_248
    assert params["deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"] == 7_615_616_512
    assert params["mistralai/Ministral-8B-Instruct-2410"] == 8_019_808_256
    assert params["google/gemma-3-12b-it"] == 11_765_640_960  # its text part (Gemma 3 12B's 12.2B has the vision's)
    # the large models untie their head, but Gemma, which ties it at every size
    assert not any(e.tie_word_embeddings for e in catalog if e.params > 7e9 and e.family != "gemma3")


def test_an_old_catalog_without_gguf_keys_still_loads(tmp_path):
    old = tmp_path / "catalog.json"
    old.write_text(
        json.dumps(
            {
                "models": [
                    dict(
                        repo_id="a/b",
                        params=10**9,
                        checkpoint_dtype="bfloat16",
                        download_bytes=2 * 10**9,
                        num_hidden_layers=2,
                        num_key_value_heads=1,
                        head_dim=64,
                        max_position_embeddings=1024,
                    )
                ]
            }
        )
    )
    (entry,) = load_catalog(old)
    assert entry.gguf_file == entry.gguf_type == "" and not entry.is_gguf


def test_entry_for_repo():
    assert entry_for_repo("qwen/QWEN3-0.6b").repo_id == "Qwen/Qwen3-0.6B"
    assert entry_for_repo("nobody/nothing") is None
    entry_for_repo("Qwen/Qwen3-0.6B").params = 1  # callers get copies
    assert entry_for_repo("Qwen/Qwen3-0.6B").params > 1


def test_estimate_arithmetic():
    e = entry_for_repo("Qwen/Qwen2.5-0.5B-Instruct")
    est = estimate_memory(e, 4096)
    assert est.weights_bytes == e.params * 2
    assert est.kv_bytes == 2 * 24 * 2 * 64 * 2 * 4096 == 50_331_648
    assert est.overhead_bytes == 256 * MiB + int(0.1 * est.weights_bytes)
    assert est.total_bytes == est.weights_bytes + est.kv_bytes + est.overhead_bytes
    four = estimate_memory(e, 4096, "float32", num_seqs=4)
    assert four.weights_bytes == e.params * 4
    assert four.kv_bytes == est.kv_bytes * 2 * 4
    assert estimate_memory(e, 4096, "auto").weights_bytes == est.weights_bytes  # checkpoint dtype: bf16
    with pytest.raises(ValueError, match="dtype"):
        estimate_memory(e, 4096, "int3")
    with pytest.raises(ValueError, match="context_len"):
        estimate_memory(e, 0)


def test_fit_report_fits():
    e = entry_for_repo("Qwen/Qwen3-0.6B")
    r = fit_report(e, 4096, "bfloat16", "cpu", free_bytes=16 * GiB, device_name="CPU (31.2 GiB RAM)")
    assert r.fits and not r.tight and r.free_bytes == 16 * GiB
    assert r.message.startswith("Qwen3 0.6B needs about 1.9 GiB (weights 1.1 + KV 0.44 at 4,096 tokens + 0.36 runtime")
    assert r.message.endswith("16.0 GiB free on CPU (31.2 GiB RAM): fits.")
    assert r.max_context_len == 40960  # capped at what the model was trained for


def test_fit_report_does_not_fit_suggests_a_context():
    e = entry_for_repo("Qwen/Qwen3-0.6B")
    r = fit_report(e, 32768, "bfloat16", free_bytes=3 * GiB, device_name="NVIDIA Test GPU (4.0 GiB)")
    assert not r.fits
    assert "KV 3.5 at 32,768 tokens" in r.message
    assert "3.0 GiB free on NVIDIA Test GPU (4.0 GiB): does not fit" in r.message
    assert r.max_context_len is not None and 4096 <= r.max_context_len < 32768
    assert f"about {r.max_context_len:,} tokens would fit" in r.message
    assert fit_report(e, r.max_context_len, free_bytes=3 * GiB, device_name="x").fits  # the suggestion holds

    tiny = fit_report(e, 4096, "float32", free_bytes=1 * GiB, device_name="CPU (1.0 GiB RAM)")
    assert not tiny.fits and tiny.max_context_len is None
    assert "even with a short context" in tiny.message and "16-bit dtype" in tiny.message


def test_cpu_float32_counts_the_packed_copy_of_a_tied_head():
    e = entry_for_repo("Qwen/Qwen3-0.6B")
    head = e.vocab_size * e.hidden_size * 4
    assert estimate_memory(e, 4096, "float32", on_cpu=True).weights_bytes == e.params * 4 + head
    assert estimate_memory(e, 4096, "bfloat16", on_cpu=True).weights_bytes == e.params * 2
    cpu = fit_report(e, 4096, "float32", free_bytes=64 * GiB, device_name="CPU (64.0 GiB RAM)")
    gpu = fit_report(e, 4096, "float32", free_bytes=64 * GiB, device_name="NVIDIA Test GPU (80.0 GiB)")
    assert cpu.estimate.weights_bytes - gpu.estimate.weights_bytes == head
    untied = entry_for_repo("Qwen/Qwen2.5-0.5B-Instruct")
    untied.tie_word_embeddings = False
    assert estimate_memory(untied, 4096, "float32", on_cpu=True).weights_bytes == untied.params * 4


def test_fit_report_tight_and_too_long_context():
    e = entry_for_repo("HuggingFaceTB/SmolLM2-135M-Instruct")
    need = estimate_memory(e, 8192).total_bytes
    r = fit_report(e, 8192, free_bytes=int(need * 1.05), device_name="CPU (x)")
    assert r.fits and r.tight and "only just" in r.message
    long = fit_report(e, 16384, free_bytes=64 * GiB, device_name="CPU (x)")
    assert "trained for at most 8,192 tokens" in long.message


def test_available_memory_cpu_and_fallbacks(monkeypatch):
    desc, free = available_memory("cpu")
    assert desc.startswith("CPU (") and desc.endswith(" GiB RAM)") and free > 0
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil now fails: /proc/meminfo or sysconf
    desc2, free2 = available_memory("cpu")
    assert desc2.startswith("CPU (") and free2 > 0
    with pytest.raises(ValueError, match="unknown device"):
        available_memory("tpu")


def test_available_memory_auto_without_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert available_memory("auto")[0].startswith("CPU (")
    assert "no CUDA GPU found" in available_memory("cuda")[0]


def test_available_memory_cuda_reads_mem_get_info(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (6 * GiB, 8 * GiB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA GeForce RTX 4060 Laptop GPU")
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 0)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)
    assert available_memory("auto") == ("NVIDIA GeForce RTX 4060 Laptop GPU (8.0 GiB)", 6 * GiB)
    # A model of ours holds 5 GiB of the 7 in use: it is unloaded before the next one loads, so it counts as free.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (1 * GiB, 8 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 5 * GiB)
    assert available_memory("auto")[1] == 6 * GiB


def test_available_memory_cuda_stays_within_the_process_memory_cap(monkeypatch):
    """A cap set with torch.cuda.set_per_process_memory_fraction (an 8 GiB laptop modelled on a big GPU) is
    what the process may use, however much the device has free."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (14 * GiB, 16 * GiB))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.5)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 3 * GiB)
    name, free = available_memory("auto")
    assert name == "NVIDIA H200 (8.0 GiB)"
    assert free == 8 * GiB  # 5 GiB left under the cap, plus the 3 this process holds for the model it serves


QWEN3_06B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "vocab_size": 151936,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def test_entry_from_config_matches_the_catalog():
    e = entry_from_config("someone/qwen3-copy", QWEN3_06B_CONFIG, 1_514_700_000)
    ref = entry_for_repo("Qwen/Qwen3-0.6B")
    assert e.params == ref.params  # counted from dims: the stored tied head does not inflate it
    assert (e.num_hidden_layers, e.num_key_value_heads, e.head_dim, e.max_position_embeddings) == (28, 8, 128, 40960)
    assert e.supported and e.family == "qwen3" and e.download_bytes == 1_514_700_000 and not e.size_is_approximate
    assert estimate_memory(e, 4096).total_bytes == estimate_memory(ref, 4096).total_bytes


def test_entry_from_config_fallbacks():
    # No head_dim: hidden / heads; no kv heads: MHA; dims missing: params from size and dtype.
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2048,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
        "dtype": "float32",
    }
    e = entry_from_config("x/llama", cfg, 4_000_000_000)
    assert e.head_dim == 64 and e.num_key_value_heads == 32 and e.params == 1_000_000_000
    assert e.checkpoint_dtype == "float32"

    other = entry_from_config("x/falcon", {**QWEN3_06B_CONFIG, "architectures": ["FalconForCausalLM"]}, 10**9)
    assert not other.supported and "cannot run FalconForCausalLM" in other.description
    assert "Gemma 3" in other.description  # what it can run instead

    # A mixture of experts: supported, its size from the file (the dense count is far off), and nothing to pick
    # but full precision, since the engine does not quantize experts yet.
    moe_config = {**QWEN3_06B_CONFIG, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128}
    moe = entry_from_config("x/moe", moe_config, 60 * 10**9)
    assert moe.supported and moe.num_experts == 128 and moe.params == 30 * 10**9 and not moe.quantizable
    advice = quantization_advice(moe, 4096, device="cpu", free_bytes=100 * GiB, device_name="CPU")
    assert [o.quantization for o in advice.options] == ["none"]

    wrapped = entry_from_config("x/vl", {"architectures": ["Qwen3ForCausalLM"], "text_config": QWEN3_06B_CONFIG}, 0)
    assert wrapped.num_hidden_layers == 28

    with pytest.raises(ValueError, match="num_hidden_layers"):
        entry_from_config("x/broken", {"hidden_size": 64}, 1000)


def test_load_catalog_errors_name_the_entry(tmp_path):
    bad = tmp_path / "catalog.json"
    bad.write_text(json.dumps({"models": [{"repo_id": "a/b", "params": 10}]}))
    with pytest.raises(ValueError, match=r"entry 0 \(a/b\) lacks checkpoint_dtype"):
        load_catalog(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_catalog(bad)
    good = tmp_path / "good.json"
    good.write_text(
        json.dumps(
            {
                "models": [
                    dict(
                        repo_id="a/b",
                        params=10**9,
                        checkpoint_dtype="bfloat16",
                        download_bytes=2 * 10**9,
                        num_hidden_layers=2,
                        num_key_value_heads=1,
                        head_dim=64,
                        max_position_embeddings=1024,
                        future_key=1,
                    )
                ]
            }
        )
    )
    (entry,) = load_catalog(good)
    assert isinstance(entry, CatalogEntry) and entry.name == "b" and entry.params_label == "1B"


# ---- quantization ---------------------------------------------------------------------------------------------

GB = 10**9


def test_weights_of_qwen3_8b_at_each_quantization():
    e = entry_for_repo("Qwen/Qwen3-8B")
    full = weights_bytes(e, "bfloat16")
    int8 = weights_bytes(e, "bfloat16", "int8")
    int4 = weights_bytes(e, "bfloat16", "int4")
    assert full == e.params * 2
    # int8: a byte a weight plus a bf16 scale per row, about 8.2 GB (7.6 GiB).
    assert abs(int8 - 8.2 * GB) <= 0.1 * 8.2 * GB and int8 > e.params
    # int4: half a byte plus a bf16 scale and zero per 32 columns (0.625 bytes), with the untied head
    # (151,936 x 4,096) at int8: about 5.35 GB (5.0 GiB).
    head = e.vocab_size * e.hidden_size
    assert abs(int4 - 5.35 * GB) <= 0.05 * 5.35 * GB
    assert int4 == pytest.approx((e.params - head) * (0.5 + 4 / 32) + head, rel=0.001)
    assert estimate_memory(e, 4096, quantization="int4").weights_bytes == int4
    with pytest.raises(ValueError, match="use none, int8 or int4"):
        weights_bytes(e, "bfloat16", "int3")


def test_a_tied_table_is_counted_once_and_an_untied_embedding_is_int4_under_int4():
    e = entry_for_repo("Qwen/Qwen3-0.6B")  # tied embeddings
    head = e.vocab_size * e.hidden_size
    untied = entry_for_repo("Qwen/Qwen3-0.6B")
    untied.tie_word_embeddings = False
    untied.params += head  # the same model with a head of its own
    # under int4 the head is int8 (a byte a weight) and a tied embedding is that table; untied, it is int4
    assert weights_bytes(untied, "bfloat16", "int4") - weights_bytes(e, "bfloat16", "int4") == pytest.approx(
        head * (0.5 + 4 / 32), rel=1e-6
    )
    assert weights_bytes(e, "bfloat16", "int8") < weights_bytes(untied, "bfloat16", "int8") - head


def test_a_gguf_entry_weighs_its_file_whatever_is_asked():
    e = entry_for_repo("Qwen/Qwen3-8B-GGUF")
    assert e.is_gguf and weights_bytes(e, "bfloat16", "int8") == weights_bytes(e, "float32") == e.download_bytes
    est = estimate_memory(e, 4096, quantization="int4")
    assert est.weights_bytes == e.download_bytes and est.quantization == "GGUF Q4_K_M"
    report = fit_report(e, 4096, free_bytes=8 * GiB, device_name="NVIDIA Test GPU (8.0 GiB)")
    assert "GGUF Q4_K_M weights, bfloat16" in report.message and report.fits


def test_advice_recommends_the_most_precise_that_leaves_room():
    e = entry_for_repo("Qwen/Qwen3-8B")
    gpu = "NVIDIA Test GPU (8.0 GiB)"
    a = quantization_advice(e, 4096, free_bytes=int(7.1 * GiB), device_name=gpu)
    assert a.recommended == "int4"
    assert a.message == (
        "Fits in 7.1 GiB free: int4 leaves room for 4,608 tokens of context (recommended); "
        "int8 does not fit; full precision does not fit."
    )
    assert [o.quantization for o in a.options] == ["none", "int8", "int4"]

    a = quantization_advice(e, 4096, free_bytes=12 * GiB, device_name=gpu)
    assert a.recommended == "int8"
    assert a.message.startswith(
        "Fits in 12.0 GiB free: int8 leaves room for 15,616 tokens of context (recommended); "
        "int4 fits 36,864; full precision does not fit"
    )

    roomy = quantization_advice(e, 4096, free_bytes=40 * GiB, device_name=gpu)
    assert roomy.recommended == "none" and roomy.message.startswith("Fits in 40.0 GiB free: full precision leaves")

    nothing = quantization_advice(e, 4096, free_bytes=4 * GiB, device_name=gpu)
    assert nothing.recommended is None
    assert nothing.message == "Does not fit in 4.0 GiB free, even at int4 with a short context: pick a smaller model."


def test_advice_takes_what_fits_when_the_asked_context_does_not():
    e = entry_for_repo("Qwen/Qwen3-8B")
    a = quantization_advice(e, 32768, free_bytes=int(7.1 * GiB), device_name="NVIDIA Test GPU (8.0 GiB)")
    assert a.recommended == "int4"
    assert "int4 leaves room for 4,608 tokens of context (recommended; less than the 32,768 asked)" in a.message
    # The asked context never exceeds what the model was trained for.
    small = entry_for_repo("HuggingFaceTB/SmolLM2-360M-Instruct")
    assert quantization_advice(small, 100_000, free_bytes=64 * GiB, device_name="x").recommended == "none"


def test_advice_for_a_gguf_has_only_its_own_types():
    e = entry_for_repo("Qwen/Qwen3-8B-GGUF")
    a = quantization_advice(e, 4096, free_bytes=8 * GiB, device_name="CPU (16.0 GiB RAM)")
    assert a.recommended == "none" and [o.quantization for o in a.options] == ["none"]
    assert a.message.startswith("The GGUF Q4_K_M file is already quantized: it leaves room for ")
    assert a.message.endswith(" tokens of context in 8.0 GiB free.")
    tiny = quantization_advice(e, 4096, free_bytes=2 * GiB, device_name="x")
    assert tiny.recommended is None and "pick a smaller model" in tiny.message


def test_the_fit_sentence_names_the_quantization_and_suggests_int4():
    e = entry_for_repo("Qwen/Qwen3-8B")
    r = fit_report(e, 4096, free_bytes=8 * GiB, device_name="NVIDIA Test GPU (8.0 GiB)", quantization="int4")
    assert r.fits and "(weights 5.0 + KV 0.56 at 4,096 tokens + 0.75 runtime, int4 weights, bfloat16)" in r.message
    full = fit_report(e, 4096, free_bytes=8 * GiB, device_name="NVIDIA Test GPU (8.0 GiB)")
    assert not full.fits and full.message.endswith("Pick a smaller model or int4 quantization.")


GEMMA_3_4B_CONFIG = {  # google/gemma-3-4b-it's config.json, the keys that matter here
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "text_config": {
        "model_type": "gemma3_text",
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
    },
}


def test_sliding_window_layers_count_their_window_where_the_engine_gives_the_rest_back(catalog):
    """The engine's KV-cache groups keep a sliding layer's window, not its whole context (on the CPU; CUDA graphs
    keep one group for now). Gemma 3 4B at 32k tokens: 4.25 GiB of KV as all-global, under 1 GiB so."""
    from_hub = entry_from_config("google/gemma-3-4b-it", GEMMA_3_4B_CONFIG, 8_600_000_000)
    listed = entry_for_repo("google/gemma-3-4b-it")
    assert (from_hub.sliding_window, from_hub.num_sliding_layers) == (listed.sliding_window, listed.num_sliding_layers)
    assert (listed.sliding_window, listed.num_sliding_layers) == (1024, 29)
    everything = listed.kv_bytes(32768)
    assert everything == listed.kv_bytes_per_token() * 32768 == 4.25 * GiB
    windowed = listed.kv_bytes(32768, windows_release=True)
    assert windowed == listed.kv_bytes_per_token() // 34 * (5 * 32768 + 29 * (1024 + 2048))
    assert windowed < 0.25 * everything and listed.kv_bytes(1000, windows_release=True) == listed.kv_bytes(1000)
    cpu = fit_report(listed, 32768, free_bytes=8 * GiB, device_name="CPU", quantization="int4")
    gpu = fit_report(listed, 32768, free_bytes=8 * GiB, device_name="NVIDIA GeForce RTX 4060", quantization="int4")
    assert cpu.estimate.kv_bytes == windowed and "sliding-window layers holding only their window" in cpu.message
    assert gpu.estimate.kv_bytes == everything and "still to come" in gpu.message
    assert cpu.max_context_len == 131072 and gpu.max_context_len < 40000
    for config in ({"model_type": "llama", "num_hidden_layers": 2}, {"model_type": "no-such-model"}):
        assert sliding_layers(config) == (None, 0)
    assert sliding_layers({"model_type": "mistral", "num_hidden_layers": 3, "sliding_window": 4096}) == (4096, 3)


def test_a_mixture_of_experts_is_held_whole_and_read_in_part(catalog):
    """Memory counts every expert, speed the experts a token runs through: the fit sentence says both, and so does
    the model picker's label; an arbitrary repo's config gives the same counts as the catalog's entry."""
    gpt_oss = entry_for_repo("ggml-org/gpt-oss-20b-GGUF")
    assert (gpt_oss.params_label, gpt_oss.active_label) == ("20.9B", "3.6B active")
    report = fit_report(gpt_oss, 4096, free_bytes=32 * GiB, device_name="CPU")
    assert report.fits and report.estimate.weights_bytes == gpt_oss.download_bytes
    assert "All 20.9B parameters are held; each token runs through 3.6B of them" in report.message
    assert not fit_report(gpt_oss, 4096, free_bytes=8 * GiB, device_name="NVIDIA GeForce RTX 4060").fits
    config = {
        "architectures": ["GptOssForCausalLM"],
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 201088,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "tie_word_embeddings": False,
        "max_position_embeddings": 131072,
    }
    from_hub = entry_from_config("openai/gpt-oss-20b", config, 2 * gpt_oss.params)
    assert (from_hub.params, from_hub.active_params) == (gpt_oss.params, gpt_oss.active_params)
    qwen = entry_for_repo("Qwen/Qwen3-30B-A3B-GGUF")
    assert (qwen.params_label, qwen.active_label) == ("30.5B", "3B active")
    dense = entry_for_repo("Qwen/Qwen3-8B-GGUF")
    assert (
        dense.active_label == "" and "parameters are held" not in fit_report(dense, 4096, free_bytes=32 * GiB).message
    )


@pytest.mark.parametrize("moe", [False, True])
def test_a_gemma_4_config_counts_the_cache_the_engine_holds(moe, tiny_models, make_llm):
    """Gemma 4's layers differ: global ones wider, the last ones sharing an earlier layer's cache, experts beside
    the MLP. The estimate from its config.json counts the parameters transformers' model has and the KV bytes a
    token takes in the engine's own cache (every layer of a block as wide as the widest)."""
    import transformers

    from tests.conftest import gemma4_config

    config = gemma4_config(moe)
    hub_config = config.to_dict() | {"architectures": ["Gemma4ForCausalLM"]}
    entry = entry_from_config("google/gemma-4-tiny", hub_config, 0)
    assert entry.supported and entry.family == "gemma4"
    assert entry.params == sum(p.numel() for p in transformers.Gemma4ForCausalLM(config).parameters())
    runner = make_llm(tiny_models["gemma4_moe" if moe else "gemma4"]).model_runner
    tokens_per_block, groups = runner.block_size, len(runner.kv_groups.windows)
    assert entry.kv_bytes_per_token("float32") == runner.kv_layout.bytes_per_block * groups // tokens_per_block
    assert (entry.num_kv_layers, entry.kv_width) == ((3, 64) if not moe else (0, 32))
    assert entry.num_sliding_layers == 2
    assert entry.active_label == ("" if not moe else f"{entry.active_params / 1e6:.0f}M active")
    if moe:
        idle = 3 * (8 - 2) * 3 * 64 * 32  # per layer, the 6 experts a token skips: gate, up and down of 64 x 32
        assert entry.active_params == entry.params - idle - 320 * 64


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_a_qwen3_5_config_counts_kv_for_its_full_attention_layers_only(family, tiny_models, make_llm):
    """Its linear layers keep a fixed-size state instead of a KV history: the estimate's KV is the one
    full-attention layer's of four, as the engine's cache."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(tiny_models[family])
    entry = entry_from_config("Qwen/Qwen3.5-tiny", config.to_dict(), 0)
    assert entry.supported and entry.family == family and entry.num_kv_layers == 1
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert entry.params == sum(p.numel() for p in model.parameters())
    if family != "qwen3_5":  # 6 of 8 experts idle a token, in each layer of experts; and the embedding
        assert entry.active_params == entry.params - (4 if family == "qwen3_5_moe" else 2) * 6 * 3 * 64 * 32 - 320 * 64
    llm = make_llm(tiny_models[family], dtype="bfloat16")  # the conv state in bf16, the recurrent one in float32
    runner = llm.model_runner
    assert entry.kv_bytes_per_token("float32") == 2 * runner.kv_layout.bytes_per_block // runner.block_size
    assert entry.state_bytes == llm.stats().state_slot_bytes  # a chat's slot, whatever its length
    assert entry.kv_bytes(1000) - entry.kv_bytes(100) == 900 * entry.kv_bytes_per_token()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "int4"])
def test_a_quantized_kv_cache_is_counted_as_the_engine_holds_it(kv_cache_dtype, tiny_llama, make_llm):
    """The estimate's KV bytes for kv_cache_dtype are the bytes a token takes in the engine's quantized cache, and
    the context that fits grows by as much."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(tiny_llama)
    entry = entry_from_config("someone/tiny-llama", config.to_dict(), 0)
    runner = make_llm(tiny_llama, kv_cache_dtype=kv_cache_dtype).model_runner
    per_token = runner.kv_layout.bytes_per_block // runner.block_size
    assert entry.kv_bytes_per_token("float32", kv_cache_dtype) == per_token
    plain = estimate_memory(entry, 4096, "float32", on_cpu=True)
    quantized = estimate_memory(entry, 4096, "float32", on_cpu=True, kv_cache_dtype=kv_cache_dtype)
    assert quantized.kv_bytes == 4096 * per_token < plain.kv_bytes
    assert quantized.weights_bytes == plain.weights_bytes
    report = fit_report(entry, 4096, "float32", free_bytes=GiB, device_name="CPU", kv_cache_dtype=kv_cache_dtype)
    assert f"tokens in {kv_cache_dtype}" in report.message
