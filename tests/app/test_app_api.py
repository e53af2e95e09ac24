"""The app serves the engine's OpenAI-compatible API on its own port: one engine, one batch for chats and API calls."""

import shutil
from pathlib import Path

import httpx
import pytest

from tests.app.app_process import AppProcess
from tests.processes import wait_until
from tests.test_embeddings import TEXTS, build_embedding_model

# Starting the app on the bundled model (built once per session) takes minutes on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(900)

openai = pytest.importorskip("openai")

KEY = "sk-app-test"
SYSTEM = "You are Pagoda, a careful assistant. You answer briefly."
GREEDY = [0.0, 1.0, -1, 0.0, 1.0]  # temperature, top_p, top_k, min_p, repetition_penalty


DOWNLOADED = "pagoda-test/tiny-qwen2"


def downloaded_cache(root: Path, repo_id: str, files: Path) -> Path:
    """A Hugging Face cache holding `files` as the snapshot of `repo_id`, as a finished download leaves it."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(files, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return root


@pytest.fixture(scope="module")
def app(bundled_model, tiny_models, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("PAGODA_API_KEY", KEY)  # what --api-key reads when it is not given
    embedder = build_embedding_model(tmp_path_factory.mktemp("embedder") / "tiny-embedding")
    cache = downloaded_cache(tmp_path_factory.mktemp("hub"), DOWNLOADED, tiny_models["qwen2"])
    proc = AppProcess(
        bundled_model,
        tmp_path_factory.mktemp("api_home"),
        "--embedding-model",
        str(embedder),
        env={"HF_HUB_CACHE": str(cache)},
    )
    client = proc.start()
    yield proc, client
    proc.kill()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_v1_on_the_app_port_answers_the_openai_client(app):
    proc, client = app
    api = openai.OpenAI(base_url=f"{proc.url}v1", api_key=KEY, max_retries=0)
    model = api.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct" or model == proc.model.name
    reply = api.chat.completions.create(
        model=model,
        temperature=0,
        max_tokens=16,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hello."}],
    )
    # The same greedy request from the page: one engine, one chat template, so the same reply and counts.
    conv = client.predict(SYSTEM, "", api_name="/new_chat")["value"]
    list(client.submit(conv, "Say hello.", SYSTEM, *GREEDY, 16, api_name="/respond"))  # the slider's least
    page = client.predict(conv, api_name="/messages")[-1]
    assert page["role"] == "assistant" and page["content"].strip()
    assert reply.choices[0].message.content == page["content"]
    assert reply.usage.completion_tokens == page["meta"]["output_tokens"]
    assert reply.usage.prompt_tokens == page["meta"]["prompt_tokens"]


def test_the_key_is_checked_on_v1_and_the_page_still_opens(app):
    proc, _ = app
    assert httpx.get(f"{proc.url}v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{proc.url}v1/models", headers={"Authorization": "Bearer nope"}, timeout=10).status_code == 401
    assert httpx.get(proc.url, timeout=10).status_code == 200


def test_a_chat_and_an_api_call_run_in_the_same_batch(app):
    proc, client = app
    running = lambda: client.predict(api_name="/engine_stats")["num_running"]
    conv = client.predict("", "", api_name="/new_chat")["value"]
    chat = client.submit(conv, "Write a long story about a lighthouse.", "", *GREEDY, 400, api_name="/respond")
    assert wait_until(lambda: running() == 1, timeout=60)
    api = openai.OpenAI(base_url=f"{proc.url}v1", api_key=KEY, max_retries=0)
    stream = api.chat.completions.create(
        model=api.models.list().data[0].id,
        temperature=0,
        max_tokens=40,
        stream=True,
        messages=[{"role": "user", "content": "Write a long poem."}],
    )
    peak = max(running() for _ in stream)
    client.predict(conv, api_name="/stop")
    chat.cancel()
    assert peak == 2  # the page's chat and the API call were decoded together
    assert wait_until(lambda: running() == 0, timeout=60)


def test_unknown_v1_routes_answer_in_openai_shape_on_the_app_port_too(app):
    """engine.serve answers an unknown /v1 path or method as OpenAI does; so does the app, whose FastAPI is
    Gradio's (its handler is added before the guarded stack is built)."""
    proc, _ = app
    for method, path, status in (("GET", "v1/nothing", 404), ("TRACE", "v1/models", 405)):
        r = httpx.request(method, f"{proc.url}{path}", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert r.status_code == status and set(r.json()["error"]) >= {"message", "type", "code"}, r.text
    assert httpx.get(f"{proc.url}nothing", timeout=30).status_code == 404  # the page's own paths are Gradio's


def test_anthropics_and_ollamas_apis_answer_on_the_app_port_too(app):
    """Claude Code's and Ollama's clients reach the app's engine as the openai client does, behind the same key."""
    anthropic = pytest.importorskip("anthropic")
    ollama = pytest.importorskip("ollama")
    proc, _ = app
    claude = anthropic.Anthropic(base_url=proc.url.rstrip("/"), api_key=KEY, max_retries=0, timeout=120)
    message = claude.messages.create(
        model="claude-haiku-4-5", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]
    )
    assert message.content[0].text and message.usage.output_tokens <= 8
    local = ollama.Client(host=proc.url.rstrip("/"), headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    listed, *others = local.list().models  # the chat model first; the embedding model too, once it has loaded
    assert [m.model for m in others] in ([DOWNLOADED], [DOWNLOADED, "tiny-embedding"])
    reply = local.chat(model=listed.model, messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 8})
    assert reply.done and reply.message.content
    assert httpx.get(f"{proc.url}api/tags", timeout=10).status_code == 401


def test_the_app_serves_its_embedding_model_beside_the_chat_model(app):
    proc, _ = app
    api = openai.OpenAI(base_url=f"{proc.url}v1", api_key=KEY, max_retries=0)

    def embedded() -> bool:  # it loads in the background while the page already answers
        try:
            return len(api.embeddings.create(model="tiny-embedding", input=TEXTS).data) == len(TEXTS)
        except openai.InternalServerError as e:
            assert "Loading the embedding model" in e.message
            return False

    assert wait_until(embedded, 120, interval=0.5)
    assert "tiny-embedding" in [m.id for m in api.models.list().data]
    chat = api.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="is a chat model"):
        api.embeddings.create(model=chat, input="hello")


def test_a_downloaded_model_named_by_a_request_loads_beside_the_chats_model(app):
    proc, client = app
    api = openai.OpenAI(base_url=f"{proc.url}v1", api_key=KEY, max_retries=0)
    chat_model = api.models.list().data[0].id
    states = {m.id: m.status for m in api.models.list().data}
    assert states[DOWNLOADED] in ("not-loaded", "loaded")  # listed from the download cache
    reply = api.chat.completions.create(
        model=DOWNLOADED, max_tokens=4, temperature=0, messages=[{"role": "user", "content": "Hi"}]
    )
    assert reply.model == DOWNLOADED and reply.usage.completion_tokens > 0
    assert {m.id: m.status for m in api.models.list().data}[DOWNLOADED] == "loaded"
    # the page's chats keep the model they were started with
    assert api.models.list().data[0].id == chat_model
    conv = client.predict(SYSTEM, "", api_name="/new_chat")["value"]
    list(client.submit(conv, "Say hello.", SYSTEM, *GREEDY, 16, api_name="/respond"))
    assert client.predict(conv, api_name="/messages")[-1]["content"].strip()
