"""Bad input gets a clear exception, and the engine keeps serving afterwards. Plus the online API."""

import json
import shutil

import pytest

from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["llama"]), dtype="float32", num_kvcache_blocks=16, max_model_len=64)


@pytest.fixture(scope="module")
def reference(llm):
    return llm.generate(["Hello world"], GREEDY, use_tqdm=False)[0]


def still_serves(llm, reference):
    s = llm.stats()
    assert (s.num_running, s.num_waiting, s.free_blocks) == (0, 0, s.num_blocks)
    assert llm.generate(["Hello world"], GREEDY, use_tqdm=False)[0]["token_ids"] == reference["token_ids"]


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


# ---- loading ------------------------------------------------------------------------------------
def test_missing_model_folder(tmp_path, tiny_llama, reference):
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path / 'nowhere'}.*does not exist"):
        LLM(str(tmp_path / "nowhere"), dtype="float32", num_kvcache_blocks=8)
    # The failed load left nothing behind that changes the next one's answer.
    again = LLM(str(tiny_llama), dtype="float32", num_kvcache_blocks=8).generate(
        ["Hello world"], GREEDY, use_tqdm=False
    )[0]
    assert again["token_ids"] == reference["token_ids"] and len(again["token_ids"]) == GREEDY.max_tokens


def test_folder_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path / "empty"), dtype="float32", num_kvcache_blocks=8)


def test_unsupported_architecture(tmp_path, tiny_llama):
    folder = copy_model(tiny_llama, tmp_path / "gpt2ish")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"unsupported model architecture \['GPT2LMHeadModel'\]; supported: .*LlamaForCausalLM.*Gemma 3",
    ):
        LLM(str(folder), dtype="float32", num_kvcache_blocks=8)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(damage, tmp_path, tiny_llama):
    folder = copy_model(tiny_llama, tmp_path / "broken")
    shard = sorted(folder.glob("*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 64 + data[64:])
    with pytest.raises(RuntimeError, match=rf"cannot read weights from .*{shard.name}.*corrupt or incomplete"):
        LLM(str(folder), dtype="float32", num_kvcache_blocks=8)


def test_missing_shard(tmp_path, tiny_llama):
    folder = copy_model(tiny_llama, tmp_path / "partial")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1  # the llama fixture is sharded
    shards[0].unlink()
    with pytest.raises(FileNotFoundError, match="missing weight shards"):
        LLM(str(folder), dtype="float32", num_kvcache_blocks=8)


@pytest.mark.parametrize(
    "settings, error, fragment",
    [
        ({"not_a_setting": 1}, TypeError, "unknown engine setting"),
        ({"max_num_seq": 4}, TypeError, r"max_num_seq"),
        ({"dtype": "float8"}, ValueError, "dtype must be one of"),
        ({"device": "tpu"}, ValueError, "device must be one of"),
        ({"kvcache_block_size": 0}, ValueError, "kvcache_block_size"),
        ({"max_num_seqs": 0}, ValueError, "max_num_seqs"),
        ({"num_kvcache_blocks": 4, "max_model_len": 65}, ValueError, "does not fit the KV cache"),
        ({"attention_backend": "flash"}, ValueError, "attention_backend"),
    ],
)
def test_bad_engine_settings(settings, error, fragment, tiny_llama):
    with pytest.raises(error, match=fragment):
        LLM(str(tiny_llama), **{"dtype": "float32", "num_kvcache_blocks": 8, **settings})


def test_a_kv_cache_larger_than_memory_is_refused_before_allocating(tiny_llama):
    from engine.runner.memory import available_host_memory

    too_much = 2 * available_host_memory()
    with pytest.raises(
        MemoryError, match=r"the KV cache would take .* GiB, but only .* GiB of memory is available; give it less"
    ):
        LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=too_much)


def test_weights_larger_than_memory_are_refused_before_loading(tiny_llama, monkeypatch):
    import engine.runner.memory

    monkeypatch.setattr(engine.runner.memory, "available_host_memory", lambda: 1000)  # a machine with 1 kB free
    with pytest.raises(MemoryError, match="the model.s weights would take .* use a smaller model or a lower precision"):
        LLM(str(tiny_llama), dtype="float32", num_kvcache_blocks=8)


# ---- requests -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompt, error, fragment",
    [
        (list(range(3, 67)), ValueError, "max_model_len is 64"),
        ("", ValueError, "empty"),
        ([], ValueError, "empty"),
        ([5, 320], ValueError, r"outside the vocabulary \(0..319\)"),
        ([-1, 5], ValueError, "outside the vocabulary"),
        ([5, "x"], TypeError, "string or a list of token ids"),
        ([[5]], TypeError, "string or a list of token ids"),
    ],
)
def test_bad_prompts_are_refused_and_change_nothing(prompt, error, fragment, llm, reference):
    for call in (lambda: llm.add_request(prompt, GREEDY), lambda: llm.generate([prompt], GREEDY, use_tqdm=False)):
        with pytest.raises(error, match=fragment):
            call()
        still_serves(llm, reference)


@pytest.mark.parametrize("prompts", [42, None, {"prompt": "Hello"}])
def test_prompts_of_the_wrong_type(prompts, llm, reference):
    with pytest.raises(TypeError, match="prompts must be a string, a list of token ids"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="string or a list of token ids"):
        llm.add_request(prompts, GREEDY)
    still_serves(llm, reference)


def test_one_bad_prompt_in_a_batch_queues_nothing(llm, reference):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(["Hello world", [999]], GREEDY, use_tqdm=False)
    assert llm.requests == {}
    still_serves(llm, reference)


def test_bad_sampling_values(llm, reference):
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        llm.generate(["Hello world"], SamplingParams(temperature=-1), use_tqdm=False)
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.add_request("Hello world", {"temperature": 0})
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate(["Hello world"], [{"temperature": 0}], use_tqdm=False)
    with pytest.raises(ValueError, match="got 1 sampling params for 2 prompts"):
        llm.generate(["Hello world", "Hi"], [GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="got 3 sampling params for 2 prompts"):
        llm.generate(["Hello world", "Hi"], [GREEDY] * 3, use_tqdm=False)
    still_serves(llm, reference)


def test_duplicate_request_id(llm, reference):
    rid = llm.add_request("Hello world", GREEDY, request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request("Hi", GREEDY, request_id="dup")
    assert llm.abort_request(rid)
    still_serves(llm, reference)


# ---- online API ---------------------------------------------------------------------------------
def test_abort_frees_blocks_and_other_requests_continue(llm, reference):
    keep = llm.add_request("Hello world", GREEDY)
    drop = llm.add_request(list(range(3, 40)), SamplingParams(temperature=0, max_tokens=20))
    llm.step()
    llm.step()
    s = llm.stats()
    assert s.num_running == 2 and s.free_blocks < s.num_blocks
    assert llm.abort_request(drop) is True
    assert llm.abort_request(drop) is False
    assert llm.abort_request("no-such-request") is False
    assert all(drop not in b.owners for b in llm.kv_blocks())
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()
    assert {o.request_id for o in outputs} == {keep}
    assert outputs[-1].finished and outputs[-1].token_ids == reference["token_ids"]
    s = llm.stats()
    assert s.free_blocks == s.num_blocks and s.used_blocks == 0


def test_abort_a_waiting_request(llm, reference):
    rid = llm.add_request("Hello world", GREEDY)
    assert llm.stats().num_waiting == 1
    assert llm.abort_request(rid)
    assert llm.stats().num_waiting == 0 and not llm.has_unfinished_requests()
    assert llm.step() == []
    still_serves(llm, reference)


def test_step_outputs_concatenate_to_the_final_text(llm):
    params = SamplingParams(temperature=0.8, max_tokens=30, seed=3)
    prompts = ["Hello world", "你好，世界。", "def main():"]
    rids = [llm.add_request(p, params) for p in prompts]
    new_text = {rid: [] for rid in rids}
    new_ids = {rid: [] for rid in rids}
    finals = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert out.request_id not in finals, "output after the request finished"
            assert len(out.new_token_ids) == 1
            new_text[out.request_id].append(out.new_text)
            new_ids[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out
    assert set(finals) == set(rids)
    offline = llm.generate(prompts, params, use_tqdm=False)
    for rid, prompt, result in zip(rids, prompts, offline):
        out = finals[rid]
        assert out.finish_reason in ("stop", "length")
        assert out.token_ids == new_ids[rid] == result["token_ids"]
        assert "".join(new_text[rid]) == result["text"]
        assert out.num_prompt_tokens == len(llm.tokenizer.encode(prompt))


def test_generate_accepts_one_prompt_or_token_ids(llm, reference):
    ids = llm.tokenizer.encode("Hello world")
    assert llm.generate("Hello world", GREEDY, use_tqdm=False)[0]["token_ids"] == reference["token_ids"]
    assert llm.generate(ids, GREEDY, use_tqdm=False)[0]["token_ids"] == reference["token_ids"]
    assert llm.generate([ids, "Hello world"], GREEDY, use_tqdm=False)[1]["token_ids"] == reference["token_ids"]
    assert llm.generate([], GREEDY, use_tqdm=False) == []
    result = llm.generate(["Hello world"], GREEDY, use_tqdm=False)[0]
    assert {"text", "token_ids", "finish_reason"} <= set(result)
