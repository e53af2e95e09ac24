"""Helpers shared by the benchmark scripts: random-weight checkpoints and timing."""

import time
from pathlib import Path

import torch


def qwen3_06b_config(num_layers: int | None = None):
    """Qwen3-0.6B's exact architecture (from its config.json), optionally with fewer layers."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=num_layers or 28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=151643,
        eos_token_id=151645,
        architectures=["Qwen3ForCausalLM"],
    )


def save_random_model(config, folder: Path, dtype: torch.dtype, device: str = "cpu") -> Path:
    """Write a random-weight checkpoint of `config` (plus the tiny test tokenizer) to `folder`."""
    import transformers

    from tests.conftest import build_tokenizer

    done = folder / ".complete"  # written last: a save cut short (a timeout) is redone, never loaded
    if done.is_file():
        return folder
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # init-scale weights give flat logits; widen them so greedy picks are decisive
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.02 if p.shape[-1] > 512 else 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer(folder)
    del model
    done.touch()
    return folder


def timed(fn, sync: bool):
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if sync:
        torch.cuda.synchronize()
    return time.perf_counter() - start, result
