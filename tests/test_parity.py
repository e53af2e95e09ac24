"""The engine against transformers, in float32, for every supported family.

The engine's logits are captured by wrapping the model runner's `launch` (which requests sample
this step) and the model's `compute_logits` (their logits), so the comparison covers the real
paged path: prefill, decode, mixed prefill/decode batches and chunked prefill.
"""

import pytest
import torch

from engine import SamplingParams
from tests.conftest import FAMILIES


class LogitRecorder:
    """Records, for every step that samples, the sampled request ids and their logits rows."""

    def __init__(self, llm, monkeypatch):
        runner = llm.model_runner
        self.records: list[tuple[list[str], torch.Tensor]] = []
        orig_launch, orig_logits = runner.launch, runner.model.compute_logits
        current: list[str] = []

        def launch(batch):
            current[:] = [item.seq.request_id for item in batch if item.samples]
            return orig_launch(batch)

        def compute_logits(hidden):
            logits = orig_logits(hidden)
            assert logits.shape[0] == len(current)
            self.records.append((list(current), logits.detach().float().clone()))
            return logits

        monkeypatch.setattr(runner, "launch", launch)
        monkeypatch.setattr(runner.model, "compute_logits", compute_logits)

    def per_request(self) -> dict[str, torch.Tensor]:
        rows: dict[str, list[torch.Tensor]] = {}
        for ids, logits in self.records:
            for i, rid in enumerate(ids):
                rows.setdefault(rid, []).append(logits[i])
        return {rid: torch.stack(r) for rid, r in rows.items()}


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def hf_greedy(model, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """transformers' greedy `generate`, never stopping early (`eos_token_id=[]` turns eos off)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=[],
            pad_token_id=0,
            **kwargs,
        )
    new = out[0, len(prompt) :].tolist()
    assert len(new) == max_new_tokens
    return new


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_at_prefill_and_every_decode_step(
    family, tiny_models, make_llm, hf_model, random_prompt, monkeypatch
):
    path = tiny_models[family]
    llm = make_llm(path, num_kvcache_blocks=32)
    recorder = LogitRecorder(llm, monkeypatch)
    steps = 24
    greedy = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    prompts = {"a": random_prompt(5, 1), "b": random_prompt(23, 2), "c": random_prompt(40, 3)}
    llm.add_request(prompts["a"], greedy, request_id="a")
    llm.add_request(prompts["b"], greedy, request_id="b")
    outputs: dict[str, list[int]] = {}
    num_steps = 0
    while llm.has_unfinished_requests():
        if num_steps == 3:  # a late arrival: its prefill shares a batch with the others' decodes
            llm.add_request(prompts["c"], greedy, request_id="c")
        for out in llm.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        num_steps += 1
    assert any(len(ids) == 3 for ids, _ in recorder.records), (
        "expected a batch mixing c's prefill with a and b's decodes"
    )

    model = hf_model(path)
    captured = recorder.per_request()
    for rid, prompt in prompts.items():
        tokens = outputs[rid]
        assert len(tokens) == steps
        ours = captured[rid]
        assert ours.shape == (steps, model.config.vocab_size)
        # One teacher-forced forward gives the reference logits for the prefill and every decode step.
        ref = hf_logits(model, prompt + tokens)[len(prompt) - 1 : len(prompt) - 1 + steps]
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4, msg=lambda m: f"{family} request {rid}: {m}")
        assert ours.argmax(-1).tolist() == tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_greedy_generate_equals_transformers(family, tiny_models, make_llm, hf_model, random_prompt):
    path = tiny_models[family]
    llm = make_llm(path, num_kvcache_blocks=48)
    text = "The quick brown fox jumps over the lazy dog."
    prompts = [text, random_prompt(1, 10), random_prompt(16, 11), random_prompt(31, 12), random_prompt(57, 13)]
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    results = llm.generate(prompts, greedy, use_tqdm=False)

    model = hf_model(path)
    for prompt, result in zip(prompts, results):
        ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        assert result["token_ids"] == hf_greedy(model, ids, 64)
        assert result["finish_reason"] == "length"
    # Batching must not change anything: each prompt alone gives the same tokens.
    for prompt, result in zip(prompts, results):
        assert llm.generate([prompt], greedy, use_tqdm=False)[0]["token_ids"] == result["token_ids"]


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_matches_unchunked(family, tiny_models, make_llm, random_prompt, monkeypatch):
    path = tiny_models[family]
    prompts = [random_prompt(20, 20), random_prompt(33, 21), random_prompt(50, 22), random_prompt(3, 23)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    whole = make_llm(path, num_kvcache_blocks=32)
    reference = whole.generate(prompts, greedy, use_tqdm=False)

    chunked = make_llm(path, num_kvcache_blocks=32, max_num_batched_tokens=7)
    batches = []
    orig = chunked.scheduler.schedule

    def schedule():
        batch = orig()
        batches.append([(item.seq.request_id, item.num_new_tokens, item.samples) for item in batch])
        return batch

    monkeypatch.setattr(chunked.scheduler, "schedule", schedule)
    results = chunked.generate(prompts, greedy, use_tqdm=False)

    assert [r["token_ids"] for r in results] == [r["token_ids"] for r in reference]
    assert [r["text"] for r in results] == [r["text"] for r in reference]
    assert all(sum(n for _, n, _ in b) <= 7 for b in batches)
    assert any(not samples for b in batches for _, _, samples in b), "no prefill was actually chunked"
