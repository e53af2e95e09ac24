"""The OpenAI-compatible server, driven by the official `openai` client against a real server process. What it
refuses is tested in test_openai_refusals.py."""

import threading

import httpx
import pytest

openai = pytest.importorskip("openai")

from tests.bundled_server import DEFAULT_MAX_TOKENS, KEY, MODEL, running_server  # noqa: E402
from tests.processes import wait_until  # noqa: E402

# Starting the server on the bundled model (built once per session) takes minutes on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(900)

SYSTEM = (
    "You are Pagoda, a careful assistant that runs on the user's own computer. You answer in one short "
    "sentence, you say so when you do not know, and you never make up facts about the user."
)


@pytest.fixture(scope="module")
def server(bundled_model, tmp_path_factory):
    yield from running_server(bundled_model, tmp_path_factory)


@pytest.fixture(scope="module")
def reference_llm(bundled_model):
    """The engine in this process, set up as the server is."""
    from engine import LLM

    return LLM(str(bundled_model), max_model_len=2048, num_kvcache_blocks=160, dtype="float32")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=KEY, max_retries=0, timeout=120)


def chat(user: str, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_a_greedy_chat_reply_is_the_engines_own_greedy_reply(client, bundled_model, reference_llm):
    from transformers import AutoTokenizer

    from engine import SamplingParams

    messages = chat("What is the capital of France?")
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    tok = AutoTokenizer.from_pretrained(bundled_model)
    ids = tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    expected = reference_llm.generate([ids], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected["text"]
    assert choice.finish_reason == expected["finish_reason"]
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == len(expected["token_ids"])
    assert reply.object == "chat.completion" and reply.model == MODEL


def test_streaming_gives_the_same_text_with_usage_last(client):
    messages = chat("Name three colours.")
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=32)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            max_tokens=32,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # it really streamed
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_usage_reports_the_cached_system_prompt(client):
    system = "This opening sentence makes the system prompt unique to this test, so nothing cached it before. " + SYSTEM
    first = client.chat.completions.create(model=MODEL, messages=chat("Hello!", system), temperature=0, max_tokens=4)
    second = client.chat.completions.create(
        model=MODEL, messages=chat("What is two plus two?", system), temperature=0, max_tokens=4
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached % 16 == 0  # the system prompt's full blocks
    assert cached < second.usage.prompt_tokens


def test_stop_strings_end_the_reply_and_are_not_returned(client):
    free = client.completions.create(model=MODEL, prompt="One, two, three, four, five,", temperature=0, max_tokens=16)
    stop = free.choices[0].text.strip()[:2]  # something greedy decoding is about to write
    reply = client.completions.create(
        model=MODEL, prompt="One, two, three, four, five,", temperature=0, max_tokens=16, stop=[stop]
    )
    assert stop not in reply.choices[0].text
    assert free.choices[0].text.startswith(reply.choices[0].text)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].stop_reason == stop  # vLLM's field: which stop string ended it
    assert getattr(free.choices[0], "stop_reason", None) is None


def test_max_tokens_ends_with_length_and_seed_repeats(client):
    kwargs = dict(model=MODEL, messages=chat("Tell me a story."), temperature=1.0, max_tokens=12, seed=7)
    a, b = (client.chat.completions.create(**kwargs) for _ in range(2))
    assert a.choices[0].finish_reason == "length" and a.usage.completion_tokens == 12
    assert a.choices[0].message.content == b.choices[0].message.content


def test_sixteen_concurrent_streams_complete_in_one_batch(client, server):
    results = {}

    def one(i):
        stream = client.chat.completions.create(
            model=MODEL,
            messages=chat(f"Count from {i} to {i + 20}."),
            temperature=0,
            max_tokens=48,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        results[i] = (chunks[-1].usage.completion_tokens, [c.choices[0].finish_reason for c in chunks if c.choices][-1])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(results) == 16
    assert all(reason in ("stop", "length") and n >= 1 for n, reason in results.values())
    # The engine ran them as one batch, not one after another: the largest step it recorded, not a sampled gauge.
    assert server.metric("pagoda:max_batch_size") >= 12


def test_a_client_that_disconnects_mid_stream_aborts_its_request(client, server):
    baseline = server.metric("vllm:kv_cache_usage_perc")
    generated = server.metric("vllm:generation_tokens_total")
    with httpx.stream(
        "POST",
        f"{server.base}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={
            "model": MODEL,
            "messages": chat("Write a very long story about a dragon."),
            "max_tokens": 1500,
            "stream": True,
        },
        timeout=60,
    ) as response:
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(6))]
        assert all(line.startswith("data: ") or line == "" for line in received)
        assert server.metric("vllm:num_requests_running") == 1
    # The connection is closed: the request leaves the batch and its blocks are freed.
    assert wait_until(lambda: server.metric("vllm:num_requests_running") == 0, timeout=20)
    assert wait_until(lambda: server.metric("vllm:kv_cache_usage_perc") <= baseline, timeout=5)
    assert server.metric("vllm:generation_tokens_total") - generated < 200  # far from the 1,500 it asked for


def test_the_client_sees_errors_as_its_own_exceptions(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=chat("hi"))
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=MODEL, messages=chat("word " * 3000))


def test_metrics_use_vllm_names(server):
    text = httpx.get(f"{server.base}/metrics", timeout=10).text
    for name in (
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:generation_tokens_total",
    ):
        assert f'{name}{{model_name="{MODEL}"}}' in text


# ---- logprobs --------------------------------------------------------------------------------------
def chat_ids(bundled_model, messages: list[dict]) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled_model)
    return tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )


def test_chat_logprobs_are_the_engines_with_the_top_tokens(client, bundled_model, reference_llm):
    from engine import SamplingParams

    messages = chat("Name a fruit.")
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3
    )
    expected = reference_llm.generate(
        [chat_ids(bundled_model, messages)], SamplingParams(temperature=0, max_tokens=8, logprobs=3), use_tqdm=False
    )[0]
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == len(expected["token_ids"])
    assert "".join(entry.token for entry in content) == reply.choices[0].message.content
    for entry, token, want in zip(content, expected["token_ids"], expected["logprobs"]):
        assert entry.logprob == pytest.approx(want[token], abs=1e-4)
        assert bytes(entry.bytes).decode() == entry.token
        tops = entry.top_logprobs
        assert len(tops) == 3 and [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert tops[0].token == entry.token and tops[0].logprob == pytest.approx(entry.logprob)  # greedy
        assert sorted(t.logprob for t in tops) == pytest.approx(sorted(want.values())[-3:], abs=1e-4)
    plain = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8)
    assert plain.choices[0].logprobs is None


def test_streamed_chat_logprobs_come_with_their_chunks(client):
    kwargs = dict(
        model=MODEL, messages=chat("Name three colours."), temperature=0, max_tokens=16, logprobs=True, top_logprobs=2
    )
    whole = client.chat.completions.create(**kwargs)
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    streamed = [entry for c in chunks if c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in whole.choices[0].logprobs.content
    ]
    with_text = [c for c in chunks if c.choices[0].delta.content]
    assert len(with_text) > 3 and all(c.choices[0].logprobs is not None for c in with_text)


def test_echo_with_max_tokens_0_scores_the_prompt(client, reference_llm):
    from engine import SamplingParams

    prompt = "The capital of France is Paris."
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = reply.choices[0]
    ids = reference_llm.tokenizer.encode(prompt)
    expected = reference_llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0][
        "prompt_logprobs"
    ]
    lp = choice.logprobs
    assert choice.text == prompt and reply.usage.completion_tokens == 0 and choice.finish_reason == "length"
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert "".join(lp.tokens) == prompt
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([row[t] for row, t in zip(expected[1:], ids[1:])], abs=1e-4)
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == pytest.approx(logprob) and 1 <= len(top) <= 2 and max(top.values()) <= 0


def test_echo_of_token_ids_with_one_new_token_as_lm_eval_sends_it(server, reference_llm):
    ids = reference_llm.tokenizer.encode("One, two, three, four")
    r = httpx.post(
        f"{server.base}/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
        json={"model": MODEL, "prompt": [ids], "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    assert choice["text"] == reference_llm.tokenizer.decode(ids) + lp["tokens"][-1]
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert max(lp["top_logprobs"][-1].values()) == pytest.approx(lp["token_logprobs"][-1])  # greedy: the top one


# ---- penalties, logit_bias, the default max_tokens, the request log -----------------------------------
def test_penalties_and_logit_bias_give_the_engines_own_reply(client, bundled_model, reference_llm):
    from engine import SamplingParams

    messages = chat("List the days of the week.")
    ids = chat_ids(bundled_model, messages)
    plain = reference_llm.generate([ids], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    banned = plain["token_ids"][0]  # the greedy reply's first token, which the bias takes away
    settings = dict(frequency_penalty=1.5, presence_penalty=0.5, logit_bias={banned: -100.0})
    expected = reference_llm.generate([ids], SamplingParams(temperature=0, max_tokens=24, **settings), use_tqdm=False)[
        0
    ]
    assert expected["token_ids"][0] != banned and expected["text"] != plain["text"]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=24,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        logit_bias={str(banned): -100},
    )
    assert reply.choices[0].message.content == expected["text"]


def test_vllms_ignore_eos_and_stop_token_ids_reach_the_engine(client, bundled_model, reference_llm):
    """They were accepted as unknown fields and ignored: a benchmark asking for 64 tokens got the model's short
    reply."""
    from engine import SamplingParams

    messages = chat("Say hello.")
    ids = chat_ids(bundled_model, messages)
    plain = reference_llm.generate([ids], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    assert plain["finish_reason"] == "stop" and len(plain["token_ids"]) < 64  # the model ends it by itself
    reply = client.completions.create(
        model=MODEL, prompt=ids, temperature=0, max_tokens=64, extra_body={"ignore_eos": True}
    )
    assert reply.usage.completion_tokens == 64 and reply.choices[0].finish_reason == "length"
    stop_at = plain["token_ids"][2]
    reply = client.completions.create(
        model=MODEL, prompt=ids, temperature=0, max_tokens=64, extra_body={"stop_token_ids": [stop_at]}
    )
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens <= 3


def test_a_request_without_max_tokens_gets_the_servers_default(client, bundled_model):
    from transformers import AutoTokenizer

    # Every end-of-turn token banned, so only the cap ends the reply.
    tok = AutoTokenizer.from_pretrained(bundled_model)
    stops = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")} | {tok.eos_token_id}
    reply = client.chat.completions.create(
        model=MODEL, messages=chat("Tell me a long story."), temperature=0, logit_bias={str(t): -100 for t in stops}
    )
    assert reply.usage.completion_tokens == DEFAULT_MAX_TOKENS and reply.choices[0].finish_reason == "length"


def test_each_request_gets_a_log_line_with_its_tokens(client, server):
    messages = chat("Name a colour.")
    client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=3)
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=3, stream=True, stream_options={"include_usage": True}
    )
    usage = [chunk.usage for chunk in reply][-1]
    httpx.post(f"{server.base}/v1/chat/completions", json={"model": MODEL}, timeout=30)  # no key: refused

    def logged(text: str) -> bool:
        return text in server.log.read_text()

    u = usage
    streamed = (
        f"POST /v1/chat/completions 200 · prompt {u.prompt_tokens} tokens "
        f"({u.prompt_tokens_details.cached_tokens} cached) · completion {u.completion_tokens} tokens · "
    )
    assert wait_until(lambda: logged(streamed), timeout=10), server.log.read_text()[-2000:]
    assert u.prompt_tokens_details.cached_tokens > 0  # the second time, its prompt came from the cache
    # A refusal's line says why (it said only "400", and the user had to guess which field)
    assert wait_until(lambda: logged("POST /v1/chat/completions 401 · a valid API key is required"), timeout=10)
    httpx.post(
        f"{server.base}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": MODEL, "messages": messages, "think": 3},
        timeout=30,
    )
    assert wait_until(lambda: logged('POST /v1/chat/completions 400 · think must be true, false, "low"'), timeout=10)


def test_the_default_max_tokens_fits_the_context_and_0_means_all_of_it(capsys):
    from entrypoints.cli import parse_args
    from entrypoints.openai.protocol import ChatCompletionBody
    from entrypoints.openai.serving import sampling_params

    body = ChatCompletionBody(messages=[{"role": "user", "content": "hi"}])
    assert sampling_params(body, 90, None, 100, 2048).max_tokens == 10  # the room left, when less
    assert sampling_params(body, 10, None, 5000, 2048).max_tokens == 2048
    assert sampling_params(body, 10, None, 5000, None).max_tokens == 4990
    assert sampling_params(body, 10, 7, 5000, 2048).max_tokens == 7  # the request's own wins
    # The shipped bound, as a literal: a request without max_tokens must never run to the end of the context (0)
    assert parse_args([]).default_max_tokens == 2048
    assert parse_args(["--default-max-tokens", "0"]).default_max_tokens == 0
    with pytest.raises(SystemExit):
        parse_args(["--default-max-tokens", "-1"])
    assert "--default-max-tokens must be 0" in capsys.readouterr().err


def test_embeddings_of_a_chat_model_are_refused_with_what_to_load(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input="hello")
    assert e.value.code == "model_not_embedding" and "Qwen3-Embedding" in e.value.message


def test_a_file_part_is_read_into_the_prompt_as_its_document_block(client):
    import base64

    from entrypoints.documents import document_block

    notes = "The lighthouse keeper is Ada. She feeds the cat at noon."
    part = {
        "type": "file",
        "file": {
            "filename": "notes.txt",
            "file_data": "data:text/plain;base64," + base64.b64encode(notes.encode()).decode(),
        },
    }
    as_file = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [part, {"type": "text", "text": "\nWho feeds the cat?"}]}],
        temperature=0,
        max_tokens=8,
    )
    as_text = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": document_block("notes.txt", notes) + "\nWho feeds the cat?"}],
        temperature=0,
        max_tokens=8,
    )
    assert as_file.usage.prompt_tokens == as_text.usage.prompt_tokens > 20
    assert as_file.choices[0].message.content == as_text.choices[0].message.content
