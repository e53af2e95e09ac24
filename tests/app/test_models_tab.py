"""The Models tab's load form as the user meets it, built in-process: the Quantization dropdown, its default (the
recommendation for the chosen model on this machine, off for GGUF models), the estimate under it, a Load that
passes the choice on to the engine settings, and the header that names the quantization."""

from types import SimpleNamespace

import gradio as gr
import pytest
import torch

import app.page.models_tab as models_tab
from app.backend import LocalBackend
from app.device_memory import GiB
from app.download_jobs import DownloadManager
from app.model_host import ModelHost
from app.page.layout import build
from app.store import ConversationStore
from app.ui import PagodaUI

GPU = ("NVIDIA Test GPU (8.0 GiB)", int(7.1 * GiB))


@pytest.fixture
def page(tmp_path, monkeypatch):
    """(ui, demo): the whole page with its Models tab, on a machine with 7.1 GiB free on a GPU."""
    monkeypatch.setattr(models_tab, "available_memory", lambda device="auto": GPU)
    ui = PagodaUI(ConversationStore(tmp_path / "chats.db"), ModelHost(), max_concurrent_chats=4)
    manager = DownloadManager(tmp_path / "hub")
    demo = build(ui, models_tab=lambda ui: models_tab.render_models_tab(ui, manager))
    return ui, demo


def component(demo: gr.Blocks, kind: type, label: str):
    [found] = [b for b in demo.blocks.values() if isinstance(b, kind) and getattr(b, "label", None) == label]
    return found


def handler(demo: gr.Blocks, trigger, event: str = "change", api_name: str | None = None):
    """The event handler wired to `trigger`'s event (or the one published under `api_name`)."""
    for fn in demo.fns.values():
        if api_name is not None and fn.api_name == api_name:
            return fn
        if api_name is None and (trigger._id, event) in [(t[0], t[1]) for t in fn.targets]:
            return fn
    raise AssertionError(f"no handler for {event} of {trigger} / {api_name}")


def recording_load(ui, monkeypatch) -> list:
    loads = []
    monkeypatch.setattr(
        ui.host, "load", lambda source, label=None, remember_as=None, **settings: loads.append((source, settings))
    )
    return loads


def test_the_form_offers_none_int8_and_int4_and_starts_off_for_the_bundled_gguf(page):
    _, demo = page
    quant = component(demo, gr.Dropdown, "Quantization")
    assert [value for _, value in quant.choices] == ["none", "int8", "int4"]
    # The first catalog entry is the bundled model, served from its Q4_1 GGUF: no quantization to choose.
    assert quant.value == "none" and quant.interactive is False
    assert "already quantized (Q4_1)" in quant.info
    fit = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "fit-estimate")
    assert "Bundled: no download." in fit.value
    assert "The GGUF Q4_1 file is already quantized: it leaves room for 8,192 tokens of context" in fit.value


def test_picking_a_model_sets_the_recommended_quantization(page):
    _, demo = page
    repo = component(demo, gr.Dropdown, "Model")
    pick = handler(demo, repo)
    update, context, text, _ = pick.fn("Qwen/Qwen3-8B", "auto", 4096)
    assert update["value"] == "int4" and update["interactive"] is True
    assert context["value"] == 4608  # the context the recommendation leaves room for, not a fixed 4,096
    assert update["info"].endswith("Recommended here: int4")
    assert text.startswith("Download: 15.3 GiB. Qwen3 8B needs about") and "at 4,608 tokens" in text
    assert text.endswith(
        "Fits in 7.1 GiB free: int4 leaves room for 4,608 tokens of context (recommended); "
        "int8 does not fit; full precision does not fit."
    )

    update, _, text, _ = pick.fn("Qwen/Qwen3-8B-GGUF", "auto", 4096)
    assert update["value"] == "none" and update["interactive"] is False
    assert update["info"] == "Off: this GGUF model is already quantized (Q4_K_M) and is served as it is"
    assert text.startswith("Download: Qwen3-8B-Q4_K_M.gguf, 4.7 GiB.")

    update, context, _, _ = pick.fn("HuggingFaceTB/SmolLM2-360M-Instruct", "auto", 4096)
    assert update["value"] == "none"  # fits at full precision: nothing is lost
    assert context["value"] == 8192  # the whole trained context, what the engine serves when not told
    assert pick.fn("someone/Some-Model-GGUF", "auto", 4096)[0]["interactive"] is False
    assert pick.fn("someone/some-model", "auto", 2048)[0]["value"] == "none"
    assert pick.fn("someone/some-model", "auto", 2048)[1]["value"] == 2048  # unknown: the field stays


def test_the_estimate_follows_the_quantization(page):
    _, demo = page
    quant = component(demo, gr.Dropdown, "Quantization")
    estimate = handler(demo, quant)
    assert [c.label for c in estimate.inputs] == [
        "Model",
        "Precision",
        "Context length (tokens)",
        "Quantization",
        "KV cache precision",
    ]
    int4 = estimate.fn("Qwen/Qwen3-8B", "bfloat16", 4096, "int4")
    assert "(weights 5.0 + KV 0.56 at 4,096 tokens + 0.75 runtime, int4 weights, bfloat16)" in int4
    assert ": fits." in int4
    int8 = estimate.fn("Qwen/Qwen3-8B", "bfloat16", 4096, "int8")
    assert "weights 7.6 + " in int8 and "int8 weights, bfloat16" in int8 and "does not fit" in int8


def test_load_passes_the_quantization_to_the_engine_settings(page, monkeypatch, tmp_path):
    ui, demo = page
    loads = recording_load(ui, monkeypatch)
    load = handler(demo, None, api_name="load")
    assert [c.label for c in load.inputs][-3:] == ["Quantization", "KV cache precision", "Speculative decoding"]
    folder = tmp_path / "some-model"
    folder.mkdir()
    load.fn(str(folder), "auto", 2048, None, "int4")
    load.fn(str(folder), "bfloat16", 2048, 1.5, "int8")
    load.fn(str(folder), "auto", 2048, None, "none")
    assert [settings.get("quantization") for _, settings in loads] == ["int4", "int8", None]
    assert loads[0] == (
        str(folder),
        {"dtype": "auto", "max_model_len": 2048, "max_num_seqs": 4, "quantization": "int4"},
    )
    assert loads[1][1]["kv_cache_memory_bytes"] == int(1.5 * GiB)

    # A GGUF file is served as it is: the engine would refuse to quantize it again, so the choice is dropped.
    gguf = tmp_path / "model-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    load.fn(str(gguf), "auto", 2048, None, "int4")
    assert loads[-1][0] == str(gguf) and "quantization" not in loads[-1][1]
    with pytest.raises(gr.Error, match="pick none, int8 or int4"):
        load.fn(str(folder), "auto", 2048, None, "int3")


def test_a_catalog_gguf_loads_its_downloaded_file(page, monkeypatch, tmp_path):
    ui, demo = page
    loads = recording_load(ui, monkeypatch)
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "Qwen3-8B-Q4_K_M.gguf").write_bytes(b"GGUF")
    local = SimpleNamespace(repo_id="Qwen/Qwen3-8B-GGUF", load_path=snapshot / "Qwen3-8B-Q4_K_M.gguf")
    monkeypatch.setattr(DownloadManager, "local_models", lambda self, include_partial=False: [local])
    handler(demo, None, api_name="load").fn("Qwen/Qwen3-8B-GGUF", "auto", 4096, None, "int4")
    assert loads == [
        (str(snapshot / "Qwen3-8B-Q4_K_M.gguf"), {"dtype": "auto", "max_model_len": 4096, "max_num_seqs": 4})
    ]


def test_downloading_a_catalog_gguf_asks_for_its_one_file(page, monkeypatch):
    _, demo = page
    started = []
    monkeypatch.setattr(
        DownloadManager, "start", lambda self, repo_id, gguf_file="": started.append((repo_id, gguf_file))
    )
    download = handler(
        demo, next(b for b in demo.blocks.values() if isinstance(b, gr.Button) and b.value == "Download"), "click"
    )
    download.fn("Qwen/Qwen3-8B-GGUF")
    download.fn("Qwen/Qwen3-8B")
    download.fn("someone/repo-GGUF/sub/file-Q5_K_M.gguf")
    assert started == [
        ("Qwen/Qwen3-8B-GGUF", "Qwen3-8B-Q4_K_M.gguf"),
        ("Qwen/Qwen3-8B", ""),
        ("someone/repo-GGUF", "sub/file-Q5_K_M.gguf"),
    ]


def fake_engine(quantization: str, decode: str = "compiled (1 row)") -> SimpleNamespace:
    return SimpleNamespace(
        stats=lambda: SimpleNamespace(quantization=quantization, decode=decode),
        device="cpu",
        max_model_len=8192,
        tokenizer=SimpleNamespace(chat_template="{{ messages }}"),
    )


def test_the_header_names_the_quantization(tmp_path):
    ui = PagodaUI(ConversationStore(tmp_path / "chats.db"), ModelHost())
    ui.host.backend = LocalBackend(fake_engine("GGUF Q4_1, Q8_0"), "SmolLM2-135M-Instruct")
    assert ui.header() == "**Pagoda** · SmolLM2-135M-Instruct · GGUF Q4_1, Q8_0 · CPU"
    ui.host.backend = LocalBackend(fake_engine("int4 (groups of 64)"), "Qwen/Qwen3-8B")
    assert ui.header() == "**Pagoda** · Qwen/Qwen3-8B · int4 (groups of 64) · CPU"
    ui.host.backend = LocalBackend(fake_engine("none"), "Qwen/Qwen3-0.6B")
    assert ui.header() == "**Pagoda** · Qwen/Qwen3-0.6B · CPU"


def test_the_header_says_while_the_decode_steps_compile(tmp_path):
    ui = PagodaUI(ConversationStore(tmp_path / "chats.db"), ModelHost())
    ui.host.backend = LocalBackend(fake_engine("none", decode="eager (compiling)"), "SmolLM2")
    assert ui.header() == "**Pagoda** · SmolLM2 · CPU (compiling faster decode steps…)"


def test_a_model_loaded_with_int8_says_so_in_the_status_and_header(tmp_path, tiny_llama):
    host = ModelHost()
    host.load(
        str(tiny_llama),
        label="tiny llama",
        wait=True,
        dtype="float32",
        num_kvcache_blocks=64,
        max_num_seqs=2,
        quantization="int8",
    )
    try:
        ui = PagodaUI(ConversationStore(tmp_path / "chats.db"), host)
        assert host.engine.stats().quantization == "int8"
        assert host.state.message.startswith("tiny llama is ready on cpu (float32, int8 weights, context ")
        assert ui.header() == "**Pagoda** · tiny llama · int8 · CPU"
    finally:
        host.unload()


def test_the_e2e_load_call_matches_the_form(page):
    """tests/app/test_e2e.py calls /load positionally: keep its argument order in step with the form."""
    _, demo = page
    load = handler(demo, None, api_name="load")
    assert [c.label for c in load.inputs] == [
        "Model",
        "Precision",
        "Context length (tokens)",
        "KV cache memory on a CPU, GiB",
        "Quantization",
        "KV cache precision",
        "Speculative decoding",
    ]


def test_a_path_that_does_not_exist_says_so_without_a_traceback(page, monkeypatch, tmp_path):
    ui, demo = page
    loads = recording_load(ui, monkeypatch)
    load = handler(demo, None, api_name="load")
    missing = tmp_path / "no-such-model"
    with pytest.raises(gr.Error, match="There is no model folder or .gguf file at .*no-such-model") as refused:
        load.fn(str(missing), "auto", 2048, None, "none")
    assert refused.value.print_exception is False  # Gradio logs no traceback for it
    with pytest.raises(gr.Error, match="someone/some-model is not downloaded yet: press Download first"):
        load.fn("someone/some-model", "auto", 2048, None, "none")  # a repo id, as before
    assert loads == []


@pytest.mark.parametrize(
    "native_bf16, plain, quantized", [(True, "bfloat16", "float32"), (False, "float32", "float32")]
)
def test_the_estimate_names_the_dtype_the_load_will_use(monkeypatch, native_bf16, plain, quantized):
    """It said float32 on a CPU while loads used bfloat16: it asks the engine's own rule now."""
    import engine.loader.weights as weights
    from app.catalog import load_catalog

    monkeypatch.setattr(weights, "cpu_has_fast_bf16", lambda: native_bf16)
    repo = next(e.repo_id for e in load_catalog() if not e.bundled and not e.is_gguf)
    cpu = ("CPU (16 GiB)", 8 * GiB)
    assert f"runtime, {plain})" in models_tab.estimate_text(repo, "auto", 2048, "none", cpu)
    assert f"int4 weights, {quantized})" in models_tab.estimate_text(repo, "auto", 2048, "int4", cpu)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)  # an RTX 30/40 card
    assert "runtime, bfloat16)" in models_tab.estimate_text(repo, "auto", 2048, "none", GPU)
    assert "runtime, float16)" in models_tab.estimate_text(repo, "float16", 2048, "none", cpu)  # as asked


def test_the_form_opens_with_the_models_context_and_the_kv_budget_it_will_use(page):
    """It opened at 4,096 tokens for a model that serves 8,192, and with a KV field reading 0 labelled
    "empty = 1"."""
    _, demo = page
    assert component(demo, gr.Number, "Context length (tokens)").value == 8192  # the bundled SmolLM2's
    assert component(demo, gr.Number, "KV cache memory on a CPU, GiB").value == 1  # the engine's default


@pytest.mark.parametrize("free_gib", [10, 12, 16, 24])
def test_the_preselected_quantization_and_context_fit_by_the_estimate_under_them(page, monkeypatch, free_gib):
    """On a CPU with native bf16, Qwen3 8B preselected int4 and 23,040 tokens, then said "needs about 12.1 GiB
    … does not fit" above "int4 leaves room for 22,528 tokens (recommended)": the advice sized the KV at bf16,
    the estimate at the float32 a quantized load gets on a CPU."""
    import engine.loader.weights as weights

    monkeypatch.setattr(weights, "cpu_has_fast_bf16", lambda: True)
    monkeypatch.setattr(models_tab, "available_memory", lambda device="auto": ("CPU (32 GiB)", free_gib * GiB))
    _, demo = page
    pick = handler(demo, component(demo, gr.Dropdown, "Model"))
    quant, context, text, _ = pick.fn("Qwen/Qwen3-8B", "auto", 4096)
    chosen, ctx = quant["value"], context["value"]
    estimate, advice = text.split("\n\n")
    assert "does not fit" not in estimate and f"at {ctx:,} tokens" in estimate
    label = {"none": "full precision"}.get(chosen, chosen)
    assert f"{label} leaves room for {ctx:,} tokens of context (recommended" in advice


def test_the_kv_cache_precision_field_is_in_the_estimate_and_the_load(monkeypatch):
    """The estimate counts the KV cache at the chosen precision (a context that did not fit, fits in int4), and Load
    passes it on as kv_cache_dtype."""
    from app.catalog import load_catalog

    entry = next(e for e in load_catalog() if not e.bundled and not e.is_gguf)
    weights_only = models_tab.estimate_text(entry.repo_id, "bfloat16", 256, "int4", ("CPU", 64 * GiB))
    ctx = entry.max_position_embeddings
    # free memory for the weights and runtime plus 60% of the context's bf16 KV: int4's fits, bf16's does not
    kv = entry.kv_bytes(ctx, "bfloat16", True)
    free = int(float(weights_only.split("needs about ")[1].split(" GiB")[0]) * GiB + 0.6 * kv)
    memory = ("CPU (test)", free)
    plain = models_tab.estimate_text(entry.repo_id, "bfloat16", ctx, "int4", memory)
    int4 = models_tab.estimate_text(entry.repo_id, "bfloat16", ctx, "int4", memory, "int4")
    report = {name: text.split("\n\n")[0] for name, text in (("plain", plain), ("int4", int4))}
    assert "does not fit" in report["plain"] and "in int4" not in report["plain"]
    assert f"at {ctx:,} tokens in int4" in report["int4"] and ": fits" in report["int4"]
    settings = models_tab.load_settings(entry.repo_id, "auto", 4096, 1, "none", 4, "int8")
    assert settings["kv_cache_dtype"] == "int8"
    assert "kv_cache_dtype" not in models_tab.load_settings(entry.repo_id, "auto", 4096, 1, "none", 4, "auto")
    with pytest.raises(gr.Error, match="Unknown KV cache precision 'q4'"):
        models_tab.load_settings(entry.repo_id, "auto", 4096, 1, "none", 4, "q4")


def test_speculative_decoding_is_chosen_per_load_and_said_in_the_status(tmp_path, tiny_llama):
    entry = models_tab.load_catalog()[0]
    settings = models_tab.load_settings(entry.repo_id, "auto", 4096, 1, "none", 4, "auto", "ngram")
    assert settings["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4}
    assert "speculative_config" not in models_tab.load_settings(entry.repo_id, "auto", 4096, 1, "none", 4)
    with pytest.raises(gr.Error, match="Unknown speculative decoding 'eagle'"):
        models_tab.load_settings(entry.repo_id, "auto", 4096, 1, "none", 4, "auto", "eagle")
    host = ModelHost()
    host.load(
        str(tiny_llama),
        label="tiny",
        wait=True,
        dtype="float32",
        num_kvcache_blocks=64,
        max_num_seqs=2,
        speculative_config=settings["speculative_config"],
    )
    try:
        assert "ngram speculative decoding" in host.state.message and host.engine.stats().speculative_method == "ngram"
    finally:
        host.unload()


# ---- a draft model ---------------------------------------------------------------------------------------------
@pytest.fixture
def bigger_smollm2(tmp_path):
    """A stand-in for a bigger SmolLM2 GGUF: the bundled file, padded (its header, so its tokenizer, unchanged)."""
    from engine.loader.bundled import bundled_gguf_path

    copy = tmp_path / "SmolLM2-big.gguf"
    copy.write_bytes(bundled_gguf_path().read_bytes() + bytes(1 << 20))
    return copy


def downloaded_here(monkeypatch, models: dict) -> None:
    """The download manager lists `models` (repo id -> file or folder) as downloaded."""
    listed = [SimpleNamespace(repo_id=repo_id, load_path=path) for repo_id, path in models.items()]
    monkeypatch.setattr(DownloadManager, "local_models", lambda self, include_partial=False: listed)


def test_a_model_here_with_the_same_tokenizer_is_offered_as_its_draft(page, monkeypatch, bigger_smollm2, tiny_llama):
    """The bundled SmolLM2 drafts for the bigger one; a model with another tokenizer (the tiny test Llama) and a
    bigger one never appear; Load passes the draft's file to the engine."""
    ui, demo = page
    loads = recording_load(ui, monkeypatch)
    downloaded_here(monkeypatch, {"me/SmolLM2-big-GGUF": bigger_smollm2, "me/tiny-llama": tiny_llama})
    bundled = models_tab.load_catalog()[0]
    repo = component(demo, gr.Dropdown, "Model")
    pick = handler(demo, repo).fn
    *_, speculation = pick("me/SmolLM2-big-GGUF", "auto", 2048, "auto", "off")
    offered = [value for _, value in speculation["choices"]]
    assert offered == ["off", "ngram", f"draft:{bundled.repo_id}"]
    assert ("Draft: " + bundled.repo_id) in [label for label, _ in speculation["choices"]]
    # the bundled model itself has nothing smaller with its tokenizer; a chosen draft falls back to off
    *_, speculation = pick(bundled.repo_id, "auto", 2048, "auto", f"draft:{bundled.repo_id}")
    assert [value for _, value in speculation["choices"]] == ["off", "ngram"] and speculation["value"] == "off"
    handler(demo, None, api_name="load").fn(
        "me/SmolLM2-big-GGUF", "auto", 2048, None, "none", "auto", f"draft:{bundled.repo_id}"
    )
    source, settings = loads[-1]
    assert source == str(bigger_smollm2)
    from engine.loader.bundled import bundled_gguf_path

    assert settings["speculative_config"] == {
        "method": "draft",
        "model": str(bundled_gguf_path()),
        "num_speculative_tokens": models_tab.DRAFT_TOKENS,
    }


def test_draft_candidates_compare_tokenizers_and_sizes(tiny_models):
    from app.draft_choices import draft_candidates, model_bytes, tokenizer_sample
    from engine.loader.bundled import bundled_gguf_path

    llama, qwen2 = tiny_models["llama"], tiny_models["qwen2"]  # one tokenizer; Qwen2's head is untied: bigger
    assert model_bytes(qwen2) > model_bytes(llama) > 0
    assert tokenizer_sample(llama) == tokenizer_sample(qwen2) is not None
    models = {"llama": llama, "qwen2": qwen2, "smollm2": bundled_gguf_path(), "gone": llama / "missing"}
    assert draft_candidates(qwen2, models) == ["llama"]
    assert draft_candidates(llama, models) == []  # qwen2 is bigger, SmolLM2's tokenizer is another
    assert draft_candidates(llama / "missing", models) == []


def test_the_status_names_the_draft(tiny_llama):
    host = ModelHost()
    draft = models_tab.load_settings(str(tiny_llama), "float32", 256, None, "none", 2, "auto", f"draft:{tiny_llama}")
    host.load(str(tiny_llama), label="tiny", wait=True, num_kvcache_blocks=64, **draft)
    try:
        assert "speculative decoding with llama as draft" in host.state.message, host.state.message
        assert host.engine.stats().speculative_method == "draft"
    finally:
        host.unload()


def test_a_model_that_ships_a_prediction_head_is_offered_mtp(page, monkeypatch, tmp_path, tiny_llama):
    """A checkpoint with `mtp.*` tensors offers MTP, which Load passes to the engine; one without does not."""
    from tests.test_qwen3_5_mtp import checkpoint_with_mtp

    checkpoint_with_mtp(tmp_path, moe=False)
    ui, demo = page
    loads = recording_load(ui, monkeypatch)
    downloaded_here(monkeypatch, {"me/qwen-mtp": tmp_path, "me/tiny-llama": tiny_llama})
    pick = handler(demo, component(demo, gr.Dropdown, "Model")).fn
    *_, speculation = pick("me/qwen-mtp", "auto", 2048, "auto", "off")
    # the tiny Llama, smaller and with its tokenizer, can draft for it too
    assert [value for _, value in speculation["choices"]] == ["off", "ngram", "mtp", "draft:me/tiny-llama"]
    *_, speculation = pick("me/tiny-llama", "auto", 2048, "auto", "mtp")
    assert "mtp" not in [value for _, value in speculation["choices"]] and speculation["value"] == "off"
    handler(demo, None, api_name="load").fn("me/qwen-mtp", "auto", 2048, None, "none", "auto", "mtp")
    source, settings = loads[-1]
    assert source == str(tmp_path)
    assert settings["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}


def test_ships_mtp_head_reads_safetensors_and_gguf_headers(tmp_path, tiny_llama):
    from app.draft_choices import ships_mtp_head
    from engine.loader.bundled import bundled_gguf_path
    from tests.conftest import build_tokenizer
    from tests.test_gguf_qwen3_5 import tiny_qwen3_5, write_qwen3_5_gguf
    from tests.test_qwen3_5_mtp import checkpoint_with_mtp

    (tmp_path / "folder").mkdir()
    checkpoint_with_mtp(tmp_path / "folder", moe=False)
    build_tokenizer(tmp_path)
    with_head = write_qwen3_5_gguf(tmp_path / "head.gguf", tiny_qwen3_5(False), tmp_path, mtp=True)
    without = write_qwen3_5_gguf(tmp_path / "plain.gguf", tiny_qwen3_5(False), tmp_path)
    assert ships_mtp_head(tmp_path / "folder") and ships_mtp_head(with_head)
    assert not any(ships_mtp_head(p) for p in (without, tiny_llama, bundled_gguf_path(), tmp_path / "gone"))
