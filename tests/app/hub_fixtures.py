"""The `hub` and `manager` fixtures (tests/app/conftest.py makes them available): a fake hub serving a small
safetensors repo and a GGUF repo with two quantizations, huggingface_hub pointed at it with its cache under
tmp_path, and a DownloadManager for that cache."""

import json
import os

import pytest
from fake_hub import FakeHub

from app.download_jobs import DownloadManager

REPO = "pagoda-test/tiny-chat"
BIG = 4 * 1024 * 1024
GGUF_REPO = "pagoda-test/tiny-chat-GGUF"
GGUF_FILES = {"tiny-chat-Q4_K_M.gguf": 2 * 1024 * 1024, "tiny-chat-Q8_0.gguf": 3 * 1024 * 1024}
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "vocab_size": 320,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
}


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A fake hub with one small repo; huggingface_hub pointed at it, its cache under tmp_path."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    if hasattr(constants, "AGENT_HARNESSES_PATH"):  # 2.x fetches a small registry once a day: keep it out of ~
        monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "agent_harnesses.json"))
    # 128 KiB pieces: several progress updates for a 4 MiB file (the manager lowers 10 MiB to 1 MiB, never raises).
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 128 * 1024)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)  # the manager sets it; restore it afterwards
    fake = FakeHub(chunk_size=32 * 1024)
    fake.add_repo(
        REPO,
        {
            "config.json": json.dumps(CONFIG).encode(),
            "tokenizer.json": json.dumps({"model": {"type": "BPE"}}).encode(),
            "model.safetensors": os.urandom(BIG),
            "README.md": b"# not downloaded: the engine patterns skip it\n",
        },
    )
    fake.add_repo(
        GGUF_REPO,
        {  # like Qwen/Qwen3-8B-GGUF: one file per quantization, no config.json
            **{name: b"GGUF" + os.urandom(size - 4) for name, size in GGUF_FILES.items()},
            "params.json": b"{}",
            "README.md": b"# a GGUF repo\n",
        },
    )
    with fake:
        # HF_ENDPOINT is read at import time into these two constants; the manager also passes endpoint= itself.
        monkeypatch.setattr(constants, "ENDPOINT", fake.url)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", fake.url + "/{repo_id}/resolve/{revision}/{filename}"
        )
        yield fake


@pytest.fixture
def manager(hub, tmp_path):
    return DownloadManager(tmp_path / "hub", endpoint=hub.url, token=False)


def expected_size(hub) -> int:
    files = hub.repos[REPO].files
    return sum(len(files[n]) for n in ("config.json", "tokenizer.json", "model.safetensors"))
