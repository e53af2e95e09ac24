"""Embeddings (engine/front/pooling.py): a Qwen3-Embedding-shaped checkpoint (a bare Qwen3 decoder, saved as
sentence-transformers saves one, pooled at its last token and normalized) gives transformers' vectors."""

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import COMMON, build_tokenizer, widen_weights


def end_with_endoftext(folder: Path) -> None:
    """Qwen3-Embedding's tokenizer closes every input with <|endoftext|>, whose hidden state is the embedding."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", eot)]
    )
    tok.save(str(folder / "tokenizer.json"))


def build_embedding_model(folder: Path, pooling: str = "lasttoken", normalize: bool = True) -> Path:
    """A tiny Qwen3-Embedding: a bare Qwen3Model's weights (no head, no `model.` prefix) under a
    Qwen3ForCausalLM config, with sentence-transformers' modules.json and pooling config."""
    import transformers

    torch.manual_seed(11)
    config = transformers.Qwen3Config(
        **{**COMMON, "num_attention_heads": 4, "num_key_value_heads": 1}, head_dim=32, tie_word_embeddings=False
    )
    model = transformers.Qwen3Model(config)
    widen_weights(model)
    model.save_pretrained(folder, safe_serialization=True)
    saved = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**saved, "architectures": ["Qwen3ForCausalLM"]}))
    build_tokenizer(folder)
    end_with_endoftext(folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    modes = {f"pooling_mode_{m}": m == pooling for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    return folder


@pytest.fixture(scope="module")
def embedding_model(tmp_path_factory) -> Path:
    return build_embedding_model(tmp_path_factory.mktemp("qwen3-embedding"))


TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a test of the tiny tokenizer.",
    "Paged attention stores keys and values in blocks.",
    "def main():\n    return 42",
]


def reference_vectors(folder: Path, inputs: list, pooling: str = "last", normalize: bool = True) -> torch.Tensor:
    """transformers' Qwen3Model on each input (a text, or token ids) alone, pooled as sentence-transformers pools."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    vectors = []
    for item in inputs:
        ids = torch.tensor([tokenizer.encode(item) if isinstance(item, str) else item])
        with torch.no_grad():
            states = model(input_ids=ids).last_hidden_state[0]
        vector = {"last": states[-1], "mean": states.mean(0), "cls": states[0]}[pooling]
        vectors.append(torch.nn.functional.normalize(vector, dim=0) if normalize else vector)
    return torch.stack(vectors)


def test_last_token_embeddings_and_their_cosines_equal_transformers(embedding_model, make_llm):
    llm = make_llm(embedding_model)
    assert llm.config.runner == "pooling"  # told by its modules.json: nothing was asked
    outputs = llm.embed(TEXTS)
    ours = torch.tensor([o.embedding for o in outputs])
    expected = reference_vectors(embedding_model, TEXTS)
    assert outputs[0].prompt_token_ids[-1] == llm.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)
    assert torch.allclose(ours, expected, atol=1e-4)
    assert torch.allclose(ours @ ours.T, expected @ expected.T, atol=1e-4)
    # different texts give different vectors: a pooled constant would pass the checks above only by luck
    assert (ours @ ours.T - torch.eye(len(TEXTS))).abs().max() < 0.99


def test_inputs_longer_than_a_step_pool_as_when_whole(embedding_model, make_llm, random_prompt):
    # 7 tokens a step, and KV rows for 96: 40-token inputs run in chunks, two at a time at most
    llm = make_llm(embedding_model, max_num_batched_tokens=7, num_kvcache_blocks=6)
    inputs = [random_prompt(40, seed) for seed in range(4)] + [random_prompt(3, 9)]
    ours = torch.tensor([o.embedding for o in llm.embed(inputs)])
    assert torch.allclose(ours, reference_vectors(embedding_model, inputs), atol=1e-4)
    assert llm.stats().free_blocks == 6  # every block back


@pytest.mark.parametrize("pooling, kind", [("mean_tokens", "mean"), ("cls_token", "cls")])
def test_mean_and_first_token_pooling_as_the_modules_say(tmp_path, make_llm, random_prompt, pooling, kind):
    folder = build_embedding_model(tmp_path / kind, pooling=pooling, normalize=False)
    llm = make_llm(folder, max_num_batched_tokens=7)
    inputs = [*TEXTS[:2], random_prompt(30, 1)]
    ours = torch.tensor([o.embedding for o in llm.embed(inputs)])
    assert torch.allclose(ours, reference_vectors(folder, inputs, kind, normalize=False), atol=1e-4)


def test_dimensions_truncate_then_normalize_where_the_model_allows(embedding_model, make_llm):
    llm = make_llm(embedding_model)
    (short,) = llm.embed(TEXTS[0], dimensions=40)
    full = reference_vectors(embedding_model, TEXTS[:1], normalize=False)[0]
    assert len(short.embedding) == 40
    assert torch.allclose(torch.tensor(short.embedding), torch.nn.functional.normalize(full[:40], dim=0), atol=1e-4)
    with pytest.raises(ValueError, match="32 to 64"):
        llm.embed(TEXTS[0], dimensions=16)


def test_a_model_not_trained_for_it_refuses_dimensions(tmp_path, make_llm):
    folder = build_embedding_model(tmp_path / "mean", pooling="mean_tokens")
    llm = make_llm(folder)
    assert len(llm.embed(TEXTS[0], dimensions=64)[0].embedding) == 64  # its own size is always fine
    with pytest.raises(ValueError, match="not trained to be truncated"):
        llm.embed(TEXTS[0], dimensions=32)


def test_chat_and_embedding_models_each_refuse_the_others_work(embedding_model, tiny_models, make_llm):
    from engine import SamplingParams

    chat = make_llm(tiny_models["qwen3"])
    with pytest.raises(ValueError, match="chat model.*Qwen3-Embedding"):
        chat.embed("hello")
    embedder = make_llm(embedding_model)
    with pytest.raises(ValueError, match="embedding model.*embed"):
        embedder.generate(["hello"], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="not a chat model: serve it beside one with --embedding-model"):
        make_llm(embedding_model, runner="generate")


def test_a_refused_input_runs_nothing_and_the_next_call_works(embedding_model, make_llm, random_prompt):
    llm = make_llm(embedding_model, num_kvcache_blocks=4)
    with pytest.raises(ValueError, match="at most 64"):
        llm.embed([TEXTS[0], random_prompt(65, 1)])
    with pytest.raises(ValueError, match="empty"):
        llm.embed([TEXTS[0], []])
    assert llm.stats().free_blocks == 4
    assert len(llm.embed(TEXTS)) == len(TEXTS)


def test_a_gguf_embedding_model_pools_as_its_metadata_says(tmp_path, make_llm):
    """A Qwen3-Embedding GGUF as llama.cpp's converter writes one: `qwen3.pooling_type` 3 (the last token) and
    `tokenizer.ggml.add_eos_token`, whose end token is the one pooled."""
    import gguf
    import transformers

    from tests.test_gguf_engine import HEAD_DIM, write_model_gguf

    build_tokenizer(tmp_path / "tokenizer")
    torch.manual_seed(5)
    config = transformers.Qwen3Config(
        **{**COMMON, "num_attention_heads": 4, "num_key_value_heads": 1}, head_dim=HEAD_DIM, tie_word_embeddings=True
    )
    model = transformers.Qwen3ForCausalLM(config)
    widen_weights(model)

    def pools_last(writer: gguf.GGUFWriter) -> None:
        writer.add_uint32("qwen3.pooling_type", 3)
        writer.add_bool("tokenizer.ggml.add_eos_token", True)

    path = write_model_gguf(
        tmp_path / "embedding.gguf",
        "qwen3",
        model,
        {"linear": "F32", "embed": "F32"},
        tmp_path / "tokenizer",
        pools_last,
    )
    llm = make_llm(path)
    assert llm.config.runner == "pooling"
    outputs = llm.embed(TEXTS)
    expected = []
    for out in outputs:
        assert out.prompt_token_ids[-1] == 2  # the file's end token, added as llama.cpp adds it
        with torch.no_grad():
            states = model.model(input_ids=torch.tensor([out.prompt_token_ids])).last_hidden_state[0]
        expected.append(torch.nn.functional.normalize(states[-1], dim=0))
    assert torch.allclose(torch.tensor([o.embedding for o in outputs]), torch.stack(expected), atol=1e-4)
