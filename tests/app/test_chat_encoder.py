"""One chat encoder: a chat in the app and a /v1 call with the same system prompt become the same
leading token ids, so the second is served the first's KV blocks from the prefix cache."""

from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.backend import chat_messages
from app.model_host import ModelHost
from app.store import ConversationStore
from app.ui import PagodaUI
from entrypoints.openai.api_router import create_router
from entrypoints.openai.serving import ServedModel

SYSTEM = (
    "You are Pagoda, a careful assistant that runs on the user's own computer. You answer in one short "
    "sentence, and you say so when you do not know."
)
GREEDY = (0.0, 1.0, -1, 0.0, 1.0)  # temperature, top_p, top_k, min_p, repetition_penalty


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_chat_and_an_api_call_with_the_same_system_prompt_share_its_blocks(tiny_llama, tmp_path):
    host = ModelHost()
    host.load(str(tiny_llama), label="tiny", wait=True, dtype="float32", num_kvcache_blocks=64, max_num_seqs=4)
    try:
        ui = PagodaUI(ConversationStore(tmp_path / "chats.db"), host)
        conv = ui.store.create(system_prompt=SYSTEM).id
        *_, last = ui.respond(conv, "Hello there", SYSTEM, *GREEDY, 4, None)  # the page's Send, to the end
        assert ui.store.messages(conv)[-1].meta["finish_reason"] in ("stop", "length")

        engine = host.engine
        before = engine.stats()
        api = FastAPI()
        api.include_router(create_router(lambda: ServedModel(engine, "tiny")))
        question = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a KV cache?"}]
        answer = TestClient(api).post(
            "/v1/chat/completions", json={"messages": question, "max_tokens": 2, "temperature": 0}
        )
        assert answer.status_code == 200, answer.text

        chat_ids = engine.encode_chat(chat_messages(SYSTEM, [{"role": "user", "content": "Hello there"}]))
        api_ids = engine.encode_chat(question)
        shared = common_prefix(chat_ids, api_ids)
        block_size = before.block_size
        assert shared >= 3 * block_size  # the system prompt spans several whole blocks
        expected = shared // block_size * block_size  # whole blocks only
        assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == expected
        assert engine.stats().prefix_cache_hits - before.prefix_cache_hits == expected
    finally:
        host.unload()
