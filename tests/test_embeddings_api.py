"""/v1/embeddings and Ollama's /api/embed through the openai and ollama clients themselves: an embedding model
served beside the chat model (`--embedding-model`), its vectors transformers' (float and base64), `dimensions`,
and the refusals: a chat model asked for embeddings, a size the model was not trained for, an input too long."""

import pytest
import torch

from tests.processes import ServeProcess
from tests.test_embeddings import TEXTS, build_embedding_model, reference_vectors

openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")

pytestmark = pytest.mark.timeout(600)
KEY = "sk-embed"
CHAT = "chat"


@pytest.fixture(scope="module")
def embedding_model(tmp_path_factory):
    return build_embedding_model(tmp_path_factory.mktemp("models") / "tiny-embedding")


@pytest.fixture(scope="module")
def server(tiny_models, embedding_model, tmp_path_factory):
    srv = ServeProcess(
        tiny_models["qwen3"],
        tmp_path_factory.mktemp("serve") / "server.log",
        "--served-model-name",
        CHAT,
        "--embedding-model",
        str(embedding_model),
        "--api-key",
        KEY,
        "--dtype",
        "float32",
    ).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)


def test_the_openai_client_gets_transformers_vectors_as_base64_and_as_floats(client, embedding_model):
    expected = reference_vectors(embedding_model, TEXTS)
    packed = client.embeddings.create(model="tiny-embedding", input=TEXTS)  # the client asks for base64
    floats = client.embeddings.create(model="tiny-embedding", input=TEXTS, encoding_format="float")
    for answer in (packed, floats):
        assert [d.index for d in answer.data] == list(range(len(TEXTS))) and answer.model == "tiny-embedding"
        assert torch.allclose(torch.tensor([d.embedding for d in answer.data]), expected, atol=1e-4)
    assert packed.usage.prompt_tokens == packed.usage.total_tokens > len(TEXTS)
    one = client.embeddings.create(model="tiny-embedding", input=TEXTS[0], dimensions=40, encoding_format="float")
    assert len(one.data[0].embedding) == 40
    by_default = client.embeddings.create(model="", input=TEXTS[0], encoding_format="float")  # the only one there is
    assert torch.allclose(torch.tensor(by_default.data[0].embedding), expected[0], atol=1e-4)


def test_both_models_are_listed_and_each_refuses_the_others_work(client):
    assert sorted(m.id for m in client.models.list().data) == [CHAT, "tiny-embedding"]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=CHAT, input="hello")
    assert e.value.code == "model_not_embedding" and "--embedding-model" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny-embedding", input="hello", dimensions=8)
    assert e.value.param == "dimensions" and "32 to 64" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="text-embedding-3-small", input="hello")
    assert "tiny-embedding" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="tiny-embedding", messages=[{"role": "user", "content": "hi"}])


def test_the_ollama_client_embeds_lists_and_shows_the_embedding_model(server, embedding_model):
    client = ollama.Client(host=server.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    expected = reference_vectors(embedding_model, TEXTS)
    answer = client.embed(model="tiny-embedding:latest", input=TEXTS)
    assert answer.model == "tiny-embedding" and answer.prompt_eval_count > len(TEXTS)
    assert torch.allclose(torch.tensor(answer.embeddings), expected, atol=1e-4)
    older = client.embeddings(model="tiny-embedding", prompt=TEXTS[1])
    assert torch.allclose(torch.tensor(older.embedding), expected[1], atol=1e-4)
    assert sorted(m.model for m in client.list().models) == [CHAT, "tiny-embedding"]
    assert client.show("tiny-embedding").capabilities == ["embedding"]
    long = "The quick brown fox jumps over the lazy dog. " * 200  # beyond the model's 512 tokens
    assert len(client.embed(model="tiny-embedding", input=long).embeddings[0]) == 64  # Ollama cuts by default
    with pytest.raises(ollama.ResponseError, match="maximum context length is 512"):
        client.embed(model="tiny-embedding", input=long, truncate=False)
    with pytest.raises(ollama.ResponseError, match="is a chat model"):
        client.embed(model=CHAT, input="hello")
