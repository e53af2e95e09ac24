"""Pagoda starts with the model loaded last from the Models tab, when it is still on this computer, and says so;
a model gone since gives the bundled one, with the reason, and nothing is downloaded at start."""

import app.page.models_tab as models_tab
from app.download_jobs import DownloadManager
from app.last_model import LastModel, load_at_start
from app.model_host import ModelHost
from app.page.layout import build
from app.store import ConversationStore
from app.ui import PagodaUI
from tests.processes import wait_until


def load_from_the_models_tab(
    ui: PagodaUI, tmp_path, model: str, dtype: str, ctx: int, kv_cache_dtype: str = "auto"
) -> None:
    demo = build(ui, models_tab=lambda ui: models_tab.render_models_tab(ui, DownloadManager(tmp_path / "hub")))
    [load] = [fn for fn in demo.fns.values() if fn.api_name == "load"]
    load.fn(model, dtype, ctx, None, "none", kv_cache_dtype)
    assert wait_until(lambda: ui.host.state.status != "loading", timeout=120)
    assert ui.host.state.status == "ready", ui.host.state.message


def test_a_restart_loads_the_model_used_last_with_its_settings(tmp_path, tiny_llama):
    store = ConversationStore(tmp_path / "chats.db")
    ui = PagodaUI(store, ModelHost(remember=LastModel(store).remember), max_concurrent_chats=2)
    load_from_the_models_tab(ui, tmp_path, str(tiny_llama), "float32", 256, kv_cache_dtype="int8")
    assert ", int8 KV cache, context 256 tokens" in ui.host.status_message()
    ui.host.unload()
    store.close()

    store = ConversationStore(tmp_path / "chats.db")  # Pagoda starts again, without --model
    host = ModelHost()
    load_at_start(host, LastModel(store), None, {}, max_num_seqs=3)
    try:
        assert wait_until(lambda: host.state.status != "loading", timeout=120)
        assert host.label == tiny_llama.name
        stats = host.engine.stats()
        assert (stats.dtype, stats.max_model_len, stats.kv_cache_dtype) == ("float32", 256, "int8")
        assert host.status_message().endswith("(The model used last, loaded again at start.)")
        assert host.state.settings["max_num_seqs"] == 3  # this start's --max-chats
    finally:
        host.unload()

    host = ModelHost()  # again, with --kv-cache-dtype int4: the command line's wins over the remembered int8
    load_at_start(host, LastModel(store), None, {}, max_num_seqs=3, kv_cache_dtype="int4")
    try:
        assert wait_until(lambda: host.state.status != "loading", timeout=120)
        assert host.engine.stats().kv_cache_dtype == "int4"
    finally:
        host.unload()


def test_a_model_deleted_since_gives_the_bundled_one_and_the_reason(tmp_path, monkeypatch):
    store = ConversationStore(tmp_path / "chats.db")
    LastModel(store).remember("Qwen/Qwen3-0.6B", {"dtype": "auto", "max_model_len": 4096})
    host = ModelHost()
    loads = []
    monkeypatch.setattr(host, "load", lambda source, label=None, note="", **settings: loads.append((label, note)))
    load_at_start(host, LastModel(store), None, downloaded={}, max_num_seqs=2)  # no longer downloaded
    [(label, note)] = loads
    assert label == "SmolLM2-135M-Instruct"  # the bundled model, offline: no download at start
    assert note == (
        "(Qwen/Qwen3-0.6B, the model used last, is no longer on this computer: download it again from the Models tab.)"
    )


def test_the_command_lines_model_wins_over_the_one_used_last(tmp_path, monkeypatch, tiny_llama):
    store = ConversationStore(tmp_path / "chats.db")
    LastModel(store).remember("Qwen/Qwen3-0.6B", {})
    host = ModelHost()
    loads = []
    monkeypatch.setattr(host, "load", lambda source, label=None, note="", **settings: loads.append((source, settings)))
    load_at_start(host, LastModel(store), str(tiny_llama), downloaded={}, max_num_seqs=2)
    load_at_start(host, LastModel(store), str(tiny_llama), downloaded={}, max_num_seqs=2, kv_cache_dtype="fp8")
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    load_at_start(host, LastModel(store), str(tiny_llama), downloaded={}, max_num_seqs=2, speculative_config=ngram)
    assert loads == [
        (str(tiny_llama), {"max_num_seqs": 2}),
        (str(tiny_llama), {"max_num_seqs": 2, "kv_cache_dtype": "fp8"}),
        (str(tiny_llama), {"max_num_seqs": 2, "speculative_config": ngram}),
    ]


def test_a_model_used_last_that_no_longer_loads_gives_the_bundled_one_and_the_reason(tmp_path, monkeypatch):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"]}')
    store = ConversationStore(tmp_path / "chats.db")
    LastModel(store).remember(str(broken), {"dtype": "float32"})
    host = ModelHost()
    instead = []
    monkeypatch.setattr(host, "load_default", lambda model, note="", **settings: instead.append((model, note)))
    load_at_start(host, LastModel(store), None, downloaded={}, max_num_seqs=2)
    assert wait_until(lambda: instead, timeout=60)
    [(model, note)] = instead
    assert model is None  # the bundled model
    assert note.startswith(f"({broken}, the model used last, did not load: Could not load broken-model: ")
    assert note.endswith(" The bundled model serves instead.)")


def test_a_draft_model_deleted_since_leaves_the_model_without_speculation(tmp_path, monkeypatch, tiny_llama):
    """The model used last is still here, its draft is not: the model loads as it was, without the draft, and the
    status says why (not the bundled model instead, which a failed load would give)."""
    store = ConversationStore(tmp_path / "chats.db")
    gone = tmp_path / "draft.gguf"
    spec = {"method": "draft", "model": str(gone), "num_speculative_tokens": 4}
    LastModel(store).remember(str(tiny_llama), {"dtype": "float32", "speculative_config": spec})
    host = ModelHost()
    loads = []
    monkeypatch.setattr(
        host, "load", lambda source, label=None, note="", **settings: loads.append((source, note, settings))
    )
    load_at_start(host, LastModel(store), None, downloaded={}, max_num_seqs=2)
    [(source, note, settings)] = loads
    assert source == str(tiny_llama) and "speculative_config" not in settings and settings["dtype"] == "float32"
    assert "its draft model draft.gguf is no longer on this computer" in note
    gone.write_bytes(b"GGUF")  # back again: the settings are used as they were
    loads.clear()
    load_at_start(host, LastModel(store), None, downloaded={}, max_num_seqs=2)
    assert loads[0][2]["speculative_config"] == spec and loads[0][1] == "(The model used last, loaded again at start.)"
