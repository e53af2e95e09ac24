"""The real bundled model, SmolLM2-135M-Instruct, against transformers on the same weights."""

import pytest
import torch

from engine import LLM, SamplingParams

# The bundled model, built once per session and compared with transformers: minutes on 2 cores.
pytestmark = pytest.mark.timeout(900)

CHATS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "用中文介绍一下你自己。"},
    ],
    [{"role": "user", "content": "Write a Python function that returns the factorial of n."}],
    [
        {"role": "system", "content": "You answer tersely."},
        {"role": "user", "content": "List three colours of the rainbow."},
    ],
]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def llm(bundled_model):
    return LLM(str(bundled_model), dtype="float32", device="cpu", num_kvcache_blocks=256)


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def test_greedy_chat_replies_equal_transformers_in_one_batch(llm, bundled_model):
    import transformers

    prompts = [chat_ids(llm.tokenizer, c) for c in CHATS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(bundled_model, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[
                0, len(prompt) :
            ].tolist()
        assert out["token_ids"] == ref
        assert out["text"] == llm.tokenizer.decode(ref, skip_special_tokens=True)
        assert out["finish_reason"] == ("stop" if ref[-1] in llm.eos_token_ids else "length")
    assert "Paris" in outs[0]["text"]
    assert "def " in outs[2]["text"]


def test_second_chat_with_the_same_system_prompt_hits_its_blocks(llm):
    system = {"role": "system", "content": "You are Pagoda, a friendly local assistant. " * 6}
    first = chat_ids(llm.tokenizer, [system, {"role": "user", "content": "Hi!"}])
    second = chat_ids(llm.tokenizer, [system, {"role": "user", "content": "What can you do?"}])
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    params = SamplingParams(temperature=0, max_tokens=8)
    llm.generate([first], params, use_tqdm=False)
    out = llm.generate([second], params, use_tqdm=False)[0]
    assert out["num_cached_tokens"] == shared // 16 * 16 > 0
