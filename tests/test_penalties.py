"""OpenAI's presence and frequency penalties and logit_bias: checked against a direct computation on
the logits, in the sampler and through the engine (where the output so far is the engine's to count)."""

import pytest
import torch

from engine import SamplingParams
from engine.sample.sampler import Sampler, SamplingBatch


def direct(
    logits: torch.Tensor, output: list[int], presence: float, frequency: float, bias: dict[int, float]
) -> torch.Tensor:
    """The definition, one token at a time: bias, then minus frequency per occurrence in the output,
    minus presence once for a token that occurs there at all."""
    out = logits.clone().float()
    for token, value in bias.items():
        out[token] += value
    for token in set(output):
        out[token] -= frequency * output.count(token) + presence
    return out


def test_the_sampler_applies_penalties_and_biases_per_row():
    g = torch.Generator().manual_seed(0)
    vocab, rows = 40, 4
    logits = torch.randn(rows, vocab, generator=g)
    outputs = [[3, 3, 3, 7], [], [1, 2, 1], [5]]
    params = [(0.5, 0.4, {}), (1.5, 1.5, {9: 2.0}), (-0.5, 1.0, {0: -100.0, 2: 5.0}), (0.0, 0.0, {})]
    counts = torch.zeros(rows, vocab)
    bias = torch.zeros(rows, vocab)
    for row, (output, (_, _, b)) in enumerate(zip(outputs, params)):
        for token in output:
            counts[row, token] += 1
        for token, value in b.items():
            bias[row, token] = value
    batch = SamplingBatch(
        temperatures=None,
        top_k=None,
        top_p=None,
        min_p=None,
        repetition_penalties=None,
        seen_tokens=None,
        generators=[None] * rows,
        all_greedy=True,
        logit_bias=bias,
        presence_penalties=torch.tensor([p for p, _, _ in params]),
        frequency_penalties=torch.tensor([f for _, f, _ in params]),
        output_counts=counts,
    )
    picked = Sampler()(logits, batch)
    expected = torch.stack([direct(logits[r], outputs[r], *params[r]) for r in range(rows)]).argmax(-1)
    assert picked.tolist() == expected.tolist()
    # the crafted cases do change the greedy choice somewhere, so this cannot pass by ignoring them
    assert picked.tolist() != logits.argmax(-1).tolist()


def reference_greedy(
    model, prompt: list[int], steps: int, presence: float, frequency: float, bias: dict[int, float]
) -> list[int]:
    """Greedy decoding with transformers' forward and the direct penalties: the engine's reference."""
    ids, output = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1]
            token = int(direct(logits, output, presence, frequency, bias).argmax())
            ids.append(token)
            output.append(token)
    return output


@pytest.mark.parametrize(
    "presence, frequency, bias",
    [
        (0.0, 1.5, {}),
        (1.2, 0.0, {}),
        (0.7, 0.9, {100: 3.0, 200: -100.0}),
    ],
)
def test_greedy_generation_with_penalties_is_the_direct_computation(
    tiny_qwen2, make_llm, hf_model, random_prompt, presence, frequency, bias
):
    llm = make_llm(tiny_qwen2)
    params = dict(temperature=0, max_tokens=24, ignore_eos=True)
    start = random_prompt(12, 41)
    # The prompt ends with the model's own continuation, so its tokens are ones the model would pick
    # next: penalising the prompt (which these penalties must not) would change the reply.
    prompt = start + llm.generate([start], SamplingParams(**params), use_tqdm=False)[0]["token_ids"][:12]
    plain = llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]["token_ids"]
    got = llm.generate(
        [prompt],
        SamplingParams(**params, presence_penalty=presence, frequency_penalty=frequency, logit_bias=bias),
        use_tqdm=False,
    )[0]["token_ids"]
    assert got == reference_greedy(hf_model(tiny_qwen2), prompt, 24, presence, frequency, bias)
    assert got != plain


def test_penalised_and_plain_rows_batch_together_and_async_steps_count_the_pending_token(
    tiny_qwen2, make_llm, random_prompt
):
    """Under asynchronous scheduling a row's last sampled token is still on the device when the next step
    is planned; it must be counted. Batched with unpenalised rows, each row gets its own parameters."""
    prompts = [random_prompt(n, 60 + n) for n in (9, 14, 20)]
    penalised = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, frequency_penalty=1.0, presence_penalty=0.5
    )
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = [
        make_llm(tiny_qwen2).generate([p], s, use_tqdm=False)[0]["token_ids"]
        for p, s in zip(prompts, (penalised, plain, penalised))
    ]
    for async_scheduling in (False, True):
        llm = make_llm(tiny_qwen2, async_scheduling=async_scheduling)
        outs = llm.generate(prompts, [penalised, plain, penalised], use_tqdm=False)
        assert [o["token_ids"] for o in outs] == alone, f"async_scheduling={async_scheduling}"


def test_a_logit_bias_of_100_forces_a_token_and_minus_100_bans_one(tiny_qwen2, make_llm, random_prompt):
    prompt = random_prompt(8, 7)
    llm = make_llm(tiny_qwen2)
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0][
        "token_ids"
    ]
    forced = llm.generate(
        [prompt],
        SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True, logit_bias={123: 100}),
        use_tqdm=False,
    )[0]["token_ids"]
    assert forced == [123] * 6
    banned = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={t: -100 for t in set(plain)}),
        use_tqdm=False,
    )[0]["token_ids"]
    assert not set(banned) & set(plain)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(presence_penalty=2.5), "presence_penalty must be a number from -2 to 2"),
        (dict(frequency_penalty=-3), "frequency_penalty must be a number from -2 to 2"),
        (dict(frequency_penalty="1"), "frequency_penalty must be a number"),
        (dict(logit_bias={"5": 1.0}), "logit_bias keys must be token ids"),
        (dict(logit_bias={5: 101}), "logit_bias values must be numbers from -100 to 100, got 101 for token 5"),
    ],
)
def test_out_of_range_penalties_and_biases_are_refused(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**kwargs)


def test_a_logit_bias_outside_the_vocabulary_is_refused_at_add_request(tiny_qwen2, make_llm):
    llm = make_llm(tiny_qwen2)
    vocab = llm.model_runner.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias names token ids \[{vocab}\] outside the vocabulary"):
        llm.add_request([1, 2, 3], SamplingParams(logit_bias={vocab: 1.0}))
    assert not llm.has_unfinished_requests()
