"""Reasoning through /v1 on a tiny random-weight Qwen3 with Qwen3's real chat template (and an R1 distill's):
constrained decoding makes the model write the `<think>...</think>answer` shape a trained one would, and the
server must return the two parts apart, as vLLM does (`reasoning_content`), whole and streamed."""

import json
import re
import shutil

import httpx
import pytest

openai = pytest.importorskip("openai")

from tests.chat_templates import real_chat_template  # noqa: E402
from tests.processes import ServeProcess  # noqa: E402

pytestmark = pytest.mark.timeout(600)
ASK = [{"role": "user", "content": "What is two plus two?"}]
THOUGHT, ANSWER = "[a-z]{2,6}( [a-z]{2,6}){1,3}", "[a-z]{3,8}"


def with_template(source, folder, template_name):
    from transformers import AutoTokenizer

    shutil.copytree(source, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = real_chat_template(template_name)
    tokenizer.save_pretrained(folder)
    return folder


def thinking_server(tiny_models, tmp_path_factory, max_len: int | None = None):
    """A module's server of the tiny Qwen3 with Qwen3's real template, served as "qwen3"; `max_len`: its
    config's max_position_embeddings instead (room for Qwen3's tool prompt with the tiny tokenizer)."""
    folder = with_template(tiny_models["qwen3"], tmp_path_factory.mktemp("qwen3") / "model", "Qwen-Qwen3-0.6B.jinja")
    if max_len is not None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": max_len}))
    srv = ServeProcess(folder, folder.parent / "server.log", "--served-model-name", "qwen3", "--dtype", "float32")
    yield srv.wait_ready(300)
    srv.stop()


@pytest.fixture(scope="module")
def qwen3(tiny_models, tmp_path_factory):
    yield from thinking_server(tiny_models, tmp_path_factory)


@pytest.fixture(scope="module")
def r1(tiny_models, tmp_path_factory):
    folder = with_template(
        tiny_models["qwen2"], tmp_path_factory.mktemp("r1") / "model", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
    )
    srv = ServeProcess(folder, folder.parent / "server.log", "--served-model-name", "r1", "--dtype", "float32")
    yield srv.wait_ready(300)
    srv.stop()


def ask(server, regex, stream=False, **extra):
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=ASK,
        temperature=0,
        max_tokens=60,
        stream=stream,
        extra_body={"structured_outputs": {"regex": regex}, **extra},
    )


def streamed(chunks) -> tuple[str, str, str]:
    reasoning = content = finish = ""
    for chunk in chunks:
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, finish


def test_qwen3_reasoning_comes_apart_from_the_answer(qwen3):
    form = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
    whole = ask(qwen3, form)
    message = whole.choices[0].message
    assert re.fullmatch(f"{THOUGHT}\n", message.reasoning_content) and re.fullmatch(ANSWER, message.content)
    assert 0 < whole.usage.completion_tokens_details.reasoning_tokens < whole.usage.completion_tokens
    assert streamed(ask(qwen3, form, stream=True)) == (message.reasoning_content, message.content, "stop")


def test_qwen3_enable_thinking_false_puts_an_empty_block_in_the_prompt(qwen3):
    def prompt_tokens(**extra) -> int:
        return ask(qwen3, ANSWER, **extra).usage.prompt_tokens

    off = ask(qwen3, ANSWER, chat_template_kwargs={"enable_thinking": False})
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    assert re.fullmatch(ANSWER, off.choices[0].message.content)
    assert off.usage.prompt_tokens > prompt_tokens()  # "<think>\n\n</think>\n\n" after the assistant's header


def test_an_r1_distill_starts_its_reply_inside_the_reasoning(r1):
    """This template (llama.cpp's copy) ends the prompt in "<think>\n" with enable_thinking, and closes the
    block at once without it."""
    form = f"{THOUGHT}\n</think>\n\n{ANSWER}"
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    message = ask(r1, form, **thinking).choices[0].message
    assert re.fullmatch(f"{THOUGHT}\n", message.reasoning_content) and re.fullmatch(ANSWER, message.content)
    assert streamed(ask(r1, form, stream=True, **thinking))[:2] == (message.reasoning_content, message.content)
    closed = ask(r1, ANSWER).choices[0].message
    assert getattr(closed, "reasoning_content", None) is None and re.fullmatch(ANSWER, closed.content)


def test_a_model_that_does_not_think_has_no_reasoning_field(r1, qwen3):
    r = httpx.post(
        f"{qwen3.url}/chat/completions",
        timeout=60,
        json={"messages": ASK, "max_tokens": 5, "temperature": 0, "structured_outputs": {"regex": "[a-z]{3}"}},
    )
    assert "reasoning_content" not in r.json()["choices"][0]["message"]  # Qwen3 answered without a block
