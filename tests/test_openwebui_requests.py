"""Open WebUI's request shapes: every chat carries its 36 built-in tools (about 26,000 characters) with no
tool_choice, and its tag and follow-up tasks come without max_tokens. Replayed against a tiny Qwen3 on
Qwen3's real chat template (which has a place for tools) and the bundled SmolLM2 (which has none)."""

import json

import httpx
import pytest

openai = pytest.importorskip("openai")

from engine.loader.bundled import bundled_gguf_path  # noqa: E402
from tests.chat_templates import real_chat_template  # noqa: E402
from tests.processes import ServeProcess  # noqa: E402

pytestmark = pytest.mark.timeout(900)
CONTEXT = 65536
HEADER = "x-pagoda-tools-dropped"
AREAS = [
    "timestamp",
    "memory",
    "note",
    "knowledge",
    "calendar",
    "channel",
    "chat",
    "web",
    "image",
    "file",
    "code",
    "folder",
]
VERBS = ["get", "search", "update"]


def openwebui_tools(copies: int = 1) -> list[dict]:
    """36 function tools in the shape Open WebUI sends by default: a name, a long description, object params."""
    tools = []
    for copy in range(copies):
        for area in AREAS:
            for verb in VERBS:
                description = (
                    f"{verb.title()} the user's {area} entries. Use this when the user asks about their "
                    f"{area}s, refers to an earlier {area}, or wants one changed. "
                ) * 2
                tools.append(
                    {
                        "type": "function",
                        "function": {
                            "name": f"{verb}_{area}{'_' + str(copy) if copy else ''}",
                            "description": description,
                            "parameters": {
                                "type": "object",
                                "properties": {
                                    "query": {"type": "string", "description": f"What to look for among the {area}s."},
                                    "count": {
                                        "type": "integer",
                                        "description": "How many to return, at most.",
                                        "default": 5,
                                    },
                                    "order": {"type": "string", "enum": ["newest", "oldest", "relevance"]},
                                    "id": {"type": "string", "description": f"The {area}'s id, for an update."},
                                },
                                "required": ["query"],
                            },
                        },
                    }
                )
    return tools


def test_the_fixture_is_the_size_open_webui_sends():
    tools = openwebui_tools()
    assert len(tools) == 36 and 24_000 < len(json.dumps(tools)) < 30_000


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny random-weight Qwen3 with a context that holds Open WebUI's tools, on Qwen3's template."""
    import torch
    import transformers

    from tests.conftest import COMMON, build_tokenizer

    folder = tmp_path_factory.mktemp("owui") / "qwen3"
    config = transformers.Qwen3Config(
        **{**COMMON, "max_position_embeddings": CONTEXT, "num_key_value_heads": 1},
        head_dim=32,
        tie_word_embeddings=True,
    )
    torch.manual_seed(3)
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
    build_tokenizer(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = real_chat_template("Qwen-Qwen3-0.6B.jinja")
    tokenizer.save_pretrained(folder)
    srv = ServeProcess(
        folder,
        folder.parent / "server.log",
        "--served-model-name",
        "qwen3",
        "--dtype",
        "float32",
        "--num-kvcache-blocks",
        "4096",
        "--max-num-seqs",
        "4",
    )
    yield srv.wait_ready(300)
    srv.stop()


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    srv = ServeProcess(
        bundled_gguf_path(),
        tmp_path_factory.mktemp("owui-smol") / "server.log",
        "--served-model-name",
        "smollm2",
        "--default-max-tokens",
        "16",
    )
    yield srv.wait_ready(300)
    srv.stop()


def post(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/chat/completions", json={"temperature": 0, **body}, timeout=300)


def chat_request(user: str, **extra) -> dict:
    """Open WebUI's chat: streamed, with usage, and its tools with no tool_choice."""
    return {
        "messages": [{"role": "user", "content": user}],
        "stream": False,
        "tools": openwebui_tools(),
        "max_tokens": 8,
        **extra,
    }


def test_qwen3_takes_the_tools_and_a_second_chat_reads_their_preamble_from_the_cache(qwen3):
    first = post(qwen3, **chat_request("Hello! What can you do?"))
    assert first.status_code == 200 and HEADER not in first.headers
    bare = post(qwen3, messages=[{"role": "user", "content": "Hello! What can you do?"}], max_tokens=1).json()
    preamble = first.json()["usage"]["prompt_tokens"] - bare["usage"]["prompt_tokens"]
    assert preamble > 5000  # the tools went into the prompt
    second = post(qwen3, **chat_request("A different question, in a new chat."))
    # The cache serves whole 16-token blocks: all of the preamble but the part of a block it ends inside
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= preamble - 15


def test_tools_that_would_fill_the_context_are_dropped_with_a_header(qwen3):
    r = post(qwen3, **{**chat_request("Hi"), "tools": openwebui_tools(copies=3)})
    assert r.status_code == 200 and "more than 50% of the model's 65,536-token context" in r.headers[HEADER]
    assert r.json()["usage"]["prompt_tokens"] < 100


def test_auto_parses_the_tool_calls_qwen3_writes(qwen3):
    """A random-weight model calls no tool unasked; a structured_outputs regex makes it write one in Qwen3's form,
    and tool_choice auto must parse it out of the text, whole and streamed."""
    client = openai.OpenAI(base_url=qwen3.url, api_key="none", max_retries=0, timeout=300)
    form = r'Checking\.\n<tool_call>\n\{"name": "get_note", "arguments": \{"query": "[a-z]{3,8}"\}\}\n</tool_call>'
    ask = dict(
        model="qwen3",
        messages=[{"role": "user", "content": "Find my note."}],
        tools=openwebui_tools(),
        tool_choice="auto",
        temperature=0,
        max_tokens=200,
        extra_body={"structured_outputs": {"regex": form}},
    )
    whole = client.chat.completions.create(**ask)
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content == "Checking."
    call = whole.choices[0].message.tool_calls[0]
    assert call.function.name == "get_note" and set(json.loads(call.function.arguments)) == {"query"}
    chunks = list(client.chat.completions.create(**ask, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    names = [d.function.name for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert content == "Checking." and names == ["get_note"] and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_smollm2_has_no_tool_template_so_open_webuis_chats_are_served_without_the_tools(smollm2):
    r = post(smollm2, **{**chat_request("Hi there"), "stream": True})
    assert r.status_code == 200 and "no tool support" in r.headers[HEADER]
    assert '"content"' in r.text and r.text.rstrip().endswith("data: [DONE]")
    task = post(
        smollm2,
        messages=[{"role": "user", "content": "### Task:\nGenerate 1-3 broad tags for this chat."}],
        tools=openwebui_tools(),
    )  # a background task: no max_tokens, not streamed
    assert task.status_code == 200 and task.json()["usage"]["completion_tokens"] <= 16
    # required and named still call (tests/test_openai_tools.py checks their arguments on bounded schemas; these
    # have free strings, which a 135M model may write until max_tokens)
    r = post(
        smollm2,
        **{
            **chat_request("Find my note."),
            "tool_choice": {"type": "function", "function": {"name": "get_note"}},
            "max_tokens": 40,
            "stream": True,
        },
    )
    assert r.status_code == 200 and HEADER not in r.headers and '"name": "get_note"' in r.text


def test_reasoning_effort_is_the_thinking_switch_where_the_model_thinks(qwen3, smollm2):
    off = post(qwen3, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, reasoning_effort="none").json()
    on = post(qwen3, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, reasoning_effort="high").json()
    assert off["usage"]["prompt_tokens"] > on["usage"]["prompt_tokens"]  # Qwen3's empty think block
    # Where the model does not think, it is ignored and the response says so: Open WebUI sends a user's default
    # on every chat, and a 400 broke them all
    for stream in (False, True):
        ignored = post(
            smollm2, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, reasoning_effort="low", stream=stream
        )
        assert ignored.status_code == 200
        assert ignored.headers["X-Pagoda-Ignored"] == "reasoning_effort: this model does not think"


def test_strict_tools_with_tool_choice_auto_say_their_calls_are_not_held(qwen3):
    """`strict` was ignored without a word (the OpenAI Agents SDK and pydantic-ai mark their tools strict). With
    "required" or a named tool the calls are held to their schemas anyway, so only "auto" says so."""
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in openwebui_tools()[:2]]
    ask = dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=1, tools=strict)
    auto = post(qwen3, **ask)
    assert auto.status_code == 200 and 'strict: with tool_choice "auto"' in auto.headers["X-Pagoda-Ignored"]
    held = post(qwen3, **ask, tool_choice="required")
    assert held.status_code == 200 and "X-Pagoda-Ignored" not in held.headers
    loose = [{"type": "function", "function": {**t["function"], "strict": False}} for t in strict]
    assert "X-Pagoda-Ignored" not in post(qwen3, **{**ask, "tools": loose}).headers


def test_a_non_streaming_request_whose_client_times_out_stops_generating(qwen3):
    """Open WebUI's background tasks are not streamed: a client that gives up must not leave its request
    running (a stream's disconnect is tested in tests/test_openai_server.py)."""
    import time

    from tests.processes import wait_until

    body = {
        "messages": [{"role": "user", "content": "Write forever."}],
        "max_tokens": 60000,
        "temperature": 0,
        "structured_outputs": {"regex": "[a-z ]+"},
    }  # no end of reply before max_tokens
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{qwen3.url}/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    assert wait_until(lambda: qwen3.metric("vllm:num_requests_running") == 0, timeout=20, interval=0.2)
    generated = qwen3.metric("vllm:generation_tokens_total")
    time.sleep(1)
    assert 0 < generated == qwen3.metric("vllm:generation_tokens_total")


def test_ollamas_names_for_the_apis_fields_are_taken(qwen3, smollm2):
    """Open WebUI sends the options a user sets under Ollama's names, also to OpenAI-compatible servers: they were
    ignored without a word. Each reply equals the one asked for under this API's own name."""
    ask = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 12}
    same = [
        ({"repeat_penalty": 1.5}, {"repetition_penalty": 1.5}),
        ({"num_predict": 5, "max_tokens": None}, {"max_tokens": 5}),
        ({"format": "json"}, {"response_format": {"type": "json_object"}}),
        (
            {"format": {"type": "object", "properties": {"n": {"type": "integer"}}}},
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "n",
                        "schema": {"type": "object", "properties": {"n": {"type": "integer"}}},
                    },
                }
            },
        ),
    ]
    for ollama, ours in same:
        theirs = post(smollm2, **{k: v for k, v in {**ask, **ollama}.items() if v is not None}).json()
        assert theirs["choices"][0]["message"] == post(smollm2, **{**ask, **ours}).json()["choices"][0]["message"]
    prompts = {
        name: post(qwen3, **{**ask, "max_tokens": 1, **fields}).json()["usage"]["prompt_tokens"]
        for name, fields in (
            ("think off", {"think": False}),
            ("effort none", {"reasoning_effort": "none"}),
            ("think on", {"think": True}),
        )
    }
    assert prompts["think off"] == prompts["effort none"] > prompts["think on"]  # Qwen3's empty think block
    # Both names at once, a value Ollama would not take, and its sampler options Pagoda does not have: refused
    for fields, words in (
        ({"repeat_penalty": 1.2, "repetition_penalty": 1.1}, "repeat_penalty is Ollama's name for repetition_penalty"),
        ({"format": "yaml"}, 'format must be "json" or a JSON schema'),
        ({"mirostat": 2}, "mirostat (Ollama's sampler option) is not supported"),
    ):
        refused = post(smollm2, **{**ask, **fields})
        assert refused.status_code == 400 and words in refused.json()["error"]["message"]
    # Its runtime options are the server's to set: ignored, and the response says so
    ignored = post(smollm2, **{**ask, "num_ctx": 4096, "keep_alive": "5m", "think": True})
    assert ignored.status_code == 200
    assert ignored.headers["X-Pagoda-Ignored"] == (
        "num_ctx: the context is set when the model loads (--max-model-len); "
        "keep_alive: the server decides how long a model stays loaded (its --ttl); reasoning_effort: this model does "
        "not think"
    )
