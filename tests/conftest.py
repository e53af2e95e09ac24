"""Shared fixtures: tiny random-weight checkpoints of each supported family, built on the fly."""

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
# Engines built here run their CPU decode steps eagerly: compiling them (engine/runner/compiled_decode.py) costs
# each of the suite's many small engines seconds to save milliseconds. tests/test_compiled_decode.py
# tests the compiled steps, and PAGODA_CPU_COMPILE=1 runs the whole suite compiled. App and server
# processes the tests start inherit it.
os.environ.setdefault("PAGODA_CPU_COMPILE", "0")
# Without a GPU, Triton's kernels run under its interpreter. The switch is read when triton is first
# imported, and importing torch._dynamo (the engine does, for engine/runner/tracing.py) imports it: set by the
# kernel tests' own modules, it came after test_compiled_decode.py's collection and every kernel failed.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

VOCAB = 320


def build_tokenizer(folder: Path) -> None:
    """A small byte-level BPE tokenizer with a ChatML template, trained on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Hello world, this is a test of the tiny tokenizer.",
        "def main():\n    return 42",
        "你好，世界。今天天气很好。",
        "Paged attention stores keys and values in blocks.",
    ] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token=None, pad_token="<|endoftext|>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(folder)


COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=2,
    bos_token_id=None,
    pad_token_id=0,
)


FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "smollm3", "phi3", "gemma3", "gpt_oss", "gemma4")
FAMILIES += ("gemma4_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next")


def gemma4_config(moe: bool):
    """Gemma 4 text, W = 10, global layers with heads twice as wide (32) and proportional RoPE. Dense (E2B's kind):
    per-layer inputs, and the last 2 of 5 layers reading the KV cache of the last earlier layer of their kind with
    an MLP twice as wide. MoE (26B-A4B's kind): one KV head on the global layer, whose keys serve as values, and
    8 experts (2 a token) beside each layer's MLP."""
    import transformers

    sliding, full = "sliding_attention", "full_attention"
    common = {**COMMON, "head_dim": 16, "global_head_dim": 32, "sliding_window": 10, "tie_word_embeddings": False}
    common["final_logit_softcapping"] = 30.0
    if not moe:
        return transformers.Gemma4TextConfig(
            **{**common, "num_hidden_layers": 5},
            layer_types=[sliding, full, sliding, sliding, full],
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=VOCAB,
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
        )
    return transformers.Gemma4TextConfig(
        **{**common, "num_hidden_layers": 3},
        layer_types=[sliding, sliding, full],
        hidden_size_per_layer_input=0,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=32,
    )


def qwen3_5_model(moe: bool, qwen3_next: bool = False):
    """Three Gated DeltaNet layers, then a gated full-attention one (rotary over a quarter of each head); MoE: 8
    experts (2 a token) and a shared expert in every layer. Qwen3-Next: experts in the even layers (decoder sparse
    step 2), a dense MLP in the others."""
    import transformers

    hybrid = dict(
        **{**COMMON, "num_hidden_layers": 4},
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        tie_word_embeddings=False,
    )
    if not moe:
        return transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**hybrid))
    experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    if qwen3_next:
        config = transformers.Qwen3NextConfig(**hybrid, **experts, decoder_sparse_step=2)
        return transformers.Qwen3NextForCausalLM(config)
    return transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**hybrid, **experts))


def widen_weights(model) -> None:
    """Random weights at init scale give near-uniform logits; widen them so greedy picks are decisive."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3 if "embed" in name or "lm_head" in name else 0.15)
            if "bias" in name:
                p.normal_(0, 0.5)
            if name.endswith("per_expert_scale"):  # Gemma 4's learned scales, ones at init
                p.uniform_(0.5, 1.5)
            if name.endswith("A_log"):  # Gated DeltaNet: slow decays, so the state remembers ~100 tokens and more
                p.uniform_(-6, -3)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # a buffer, saved in the checkpoint
                b.uniform_(0.5, 1.5)


def build_model(folder: Path, family: str) -> Path:
    import transformers

    torch.manual_seed(
        {
            "llama": 1,
            "qwen2": 2,
            "qwen3": 3,
            "qwen3_moe": 4,
            "mistral": 5,
            "smollm3": 6,
            "phi3": 7,
            "gemma3": 8,
            "gpt_oss": 9,
            "gemma4": 10,
            "gemma4_moe": 11,
            "qwen3_5": 12,
            "qwen3_5_moe": 13,
            "qwen3_next": 14,
        }[family]
    )
    if family == "llama":
        rope_scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        }
        config = transformers.LlamaConfig(
            **COMMON, tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=rope_scaling
        )
        model, dtype, shard = transformers.LlamaForCausalLM(config), torch.float32, "60KB"
    elif family == "qwen2":
        config = transformers.Qwen2Config(**COMMON, tie_word_embeddings=False)
        model, dtype, shard = transformers.Qwen2ForCausalLM(config), torch.float32, None
    elif family == "mistral":
        # Every layer attends through a 12-token window, far shorter than the tests' prompts and replies.
        config = transformers.MistralConfig(**COMMON, sliding_window=12, tie_word_embeddings=False)
        model, dtype, shard = transformers.MistralForCausalLM(config), torch.float32, None
    elif family == "smollm3":
        # Layer 1 has no rotary (NoPE), as every fourth layer of the real model
        config = transformers.SmolLM3Config(**COMMON, no_rope_layers=[1, 0], tie_word_embeddings=True)
        model, dtype, shard = transformers.SmolLM3ForCausalLM(config), torch.float32, None
    elif family == "phi3":
        # q/k/v and gate/up fused in the checkpoint, rotary over 3/4 of each head, LongRoPE (its short factors here;
        # the attention factor from the 512 / 128 context growth)
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.2 * i for i in range(6)],
            "long_factor": [3.0 + 0.5 * i for i in range(6)],
            "original_max_position_embeddings": 128,
        }
        config = transformers.Phi3Config(
            **COMMON, original_max_position_embeddings=128, rope_parameters=rope, tie_word_embeddings=False
        )
        model, dtype, shard = transformers.Phi3ForCausalLM(config), torch.float32, None
    elif family == "gemma3":
        # Two sliding layers (W = 10) then a global one, each kind with its rotary (the global one linear-scaled),
        # queries scaled by query_pre_attn_scalar, logits soft-capped
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        }
        config = transformers.Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 3},
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=10,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters=rope,
            final_logit_softcapping=30.0,
            tie_word_embeddings=False,
        )
        model, dtype, shard = transformers.Gemma3ForCausalLM(config), torch.float32, None
    elif family in ("gemma4", "gemma4_moe"):
        model, dtype, shard = transformers.Gemma4ForCausalLM(gemma4_config(family == "gemma4_moe")), torch.float32, None
    elif family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        model, dtype, shard = qwen3_5_model(family != "qwen3_5", family == "qwen3_next"), torch.float32, None
    elif family == "gpt_oss":
        # A 10-token window on layer 0 and full attention on layer 1, attention sinks, YaRN (factor 8 over a
        # 64-token pretraining length), 8 biased experts (2 a token) with the clamped SwiGLU
        rope = {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        }
        config = transformers.GptOssConfig(
            **{**COMMON, "intermediate_size": 32},
            head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=10,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=rope,
            attention_bias=True,
            tie_word_embeddings=False,
        )
        model, dtype, shard = transformers.GptOssForCausalLM(config), torch.float32, None
    elif family == "qwen3_moe":
        # Experts in layer 0, a dense MLP in layer 1 (mlp_only_layers); 8 experts, 2 a token, renormalized.
        config = transformers.Qwen3MoeConfig(
            **{**COMMON, "intermediate_size": 96},
            head_dim=16,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        )
        model, dtype, shard = transformers.Qwen3MoeForCausalLM(config), torch.float32, None
    else:
        config = transformers.Qwen3Config(
            **{**COMMON, "num_attention_heads": 4, "num_key_value_heads": 1}, head_dim=32, tie_word_embeddings=True
        )
        model, dtype, shard = transformers.Qwen3ForCausalLM(config), torch.bfloat16, None
    widen_weights(model)
    model = model.to(dtype)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    build_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {f: build_model(root / f, f) for f in FAMILIES}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


# ---- helpers shared by the engine tests --------------------------------------------------------
NUM_SPECIAL = 3  # <|endoftext|>, <|im_start|>, <|im_end|> (= eos, id 2)


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_models) -> Path:
    return tiny_models["qwen2"]


@pytest.fixture
def make_llm():
    """`make_llm(path, **settings)`: an LLM in float32 with a small explicit KV cache unless told otherwise."""

    def make(path, **settings):
        from engine import LLM

        return LLM(str(path), **{"dtype": "float32", "num_kvcache_blocks": 64, **settings})

    return make


@pytest.fixture(scope="session")
def random_prompt():
    """`random_prompt(length, seed)`: reproducible token ids that avoid the special tokens."""

    def make(length: int, seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(NUM_SPECIAL, VOCAB, (length,), generator=g).tolist()

    return make


@pytest.fixture(scope="session")
def hf_model():
    """`hf_model(path)`: the transformers reference model in float32, loaded once per session."""
    cache = {}

    def load(path):
        from transformers import AutoModelForCausalLM

        key = str(path)
        if key not in cache:
            cache[key] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[key]

    return load


@pytest.fixture(scope="session")
def bundled_build(tmp_path_factory):
    """The bundled SmolLM2-135M-Instruct, built once per test session into a private PAGODA_HOME.

    Returns (folder, progress messages, seconds the build took)."""
    import time

    from engine.loader.bundled import bundled_model_path

    home = tmp_path_factory.mktemp("pagoda_home")
    messages: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGODA_HOME", str(home))
        started = time.monotonic()
        path = bundled_model_path(progress=messages.append)
        seconds = time.monotonic() - started
    return path, messages, seconds


@pytest.fixture(scope="session")
def bundled_model(bundled_build):
    return bundled_build[0]
