"""The Models tab: the catalog with a memory estimate, downloads with progress, load and unload, and
a connection to a remote OpenAI-compatible server instead of a local model.

The load form offers the engine's weight-only quantization (none, int8, int4). It starts at the
recommendation for the chosen model on this machine (app.memory_estimate.quantization_advice) and is
switched off for GGUF models, whose weights are quantized already. The KV cache's precision (the engine's
kv_cache_dtype) is a field of its own, counted in the estimate: int8 or fp8 hold about twice the context in the
same memory, int4 about three and a half times."""

from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import torch

from app.catalog import CatalogEntry, entry_for_repo, load_catalog
from app.device_memory import available_memory
from app.download_jobs import DownloadManager
from app.draft_choices import draft_candidates, ships_mtp_head
from app.memory_estimate import QUANTIZATIONS, QuantAdvice, fit_report, format_gib, quantization_advice
from app.model_host import resolve_model
from app.page import user_error
from app.page.download_rows import free_disk, listing, render_download_rows
from app.remote import RemoteError
from engine.attention.kv_format import KV_CACHE_DTYPES
from engine.loader import pick_dtype

DTYPES = ["auto", "float32", "bfloat16", "float16"]
# Speculative decoding, per load (engine/spec_decode/): off, n-gram, the model's own MTP head where its checkpoint
# ships one, or "draft:<model>", one of the models here that can draft for the chosen one (app/draft_choices.py).
# MTP drafts 2 tokens, as Qwen suggests for its heads: their later drafts are accepted less often.
SPECULATION = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "mtp": {"method": "mtp", "num_speculative_tokens": 2},
}
SPECULATION_CHOICES = [("Off", "off"), ("N-gram (prompt lookup)", "ngram")]
MTP_CHOICE = ("MTP (the model's own prediction head)", "mtp")
DRAFT = "draft:"
DRAFT_TOKENS = 4
QUANT_INFO = "Weights stored in fewer bits at load: int8 needs about half the memory, int4 about a quarter"


def is_gguf_choice(repo_id: str | None) -> bool:
    """Whether the model field names a GGUF model (served as it is, so no quantization at load): a catalog GGUF
    entry, a .gguf file or hub file, `owner/repo:Q4_K_M`, or a `...-GGUF` repo."""
    choice = (repo_id or "").strip()
    entry = entry_for_repo(choice)
    if entry is not None:
        return entry.is_gguf
    local = Path(choice).expanduser()
    if local.is_dir():  # the engine serves a folder's one GGUF when it has no config.json
        return not (local / "config.json").is_file() and any(local.glob("*.gguf"))
    if local.is_file():
        return local.suffix.lower() == ".gguf"
    return choice.lower().endswith((".gguf", "-gguf")) or (choice.count("/") == 1 and ":" in choice)


def _estimate_dtype(dtype_name: str, device_name: str, quantized: bool = False) -> str:
    """The dtype a load with these settings gets: the engine's own choice for "auto" (bf16 on a GPU, and on a
    CPU with native bf16 unless the weights are quantized), so the estimate names what the load will use."""
    if dtype_name != "auto":
        return dtype_name
    device = torch.device("cpu" if device_name.startswith("CPU") else "cuda")
    return str(pick_dtype("auto", device, quantized)).removeprefix("torch.")


def _advice(
    entry: CatalogEntry, ctx: int, dtype_name: str, memory: tuple[str, int], kv_cache_dtype: str = "auto"
) -> QuantAdvice:
    """The quantization advice, each option sized at the dtype its own load gets. The one place the form
    asks for it: the preselected quantization and context and the sentences under them must agree (a CPU
    gives quantized weights float32 KV, twice bf16's, and an advice sized at bf16 preselected a context
    the estimate then said did not fit)."""
    device_name, free = memory
    return quantization_advice(
        entry,
        ctx,
        _estimate_dtype(dtype_name, device_name),
        free_bytes=free,
        device_name=device_name,
        quantized_dtype=_estimate_dtype(dtype_name, device_name, quantized=True),
        kv_cache_dtype=kv_cache_dtype,
    )


def estimate_text(
    repo_id: str | None,
    dtype_name: str,
    ctx,
    quantization: str | None,
    memory: tuple[str, int] | None = None,
    kv_cache_dtype: str = "auto",
) -> str:
    """The estimate under the load form: download size, whether the model fits at this precision,
    quantization, KV-cache precision and context, and which quantization fits this machine with how much context.
    `memory` is (device description, free bytes); measured when not given."""
    entry = entry_for_repo(repo_id or "")
    if entry is None:
        return "No estimate for a model outside the catalog until its config is known; it is checked when it loads."
    device_name, free = memory if memory is not None else available_memory("auto")
    dtype = _estimate_dtype(dtype_name, device_name, quantized=entry.is_gguf or (quantization or "none") != "none")
    ctx = int(ctx or 4096)
    if entry.bundled:
        size = "Bundled: no download. "
    elif entry.is_gguf:
        size = f"Download: {entry.gguf_file}, {format_gib(entry.download_bytes)} GiB. "
    else:
        size = f"Download: {format_gib(entry.download_bytes)} GiB. "
    quant = None if entry.is_gguf else quantization
    kv = kv_cache_dtype or "auto"
    report = fit_report(
        entry, ctx, dtype, free_bytes=free, device_name=device_name, quantization=quant, kv_cache_dtype=kv
    )
    advice = _advice(entry, ctx, dtype_name, (device_name, free), kv)
    return f"{size}{report.message}\n\n{advice.message}"


def quantization_field(
    repo_id: str | None, dtype_name: str = "auto", ctx=4096, memory: tuple[str, int] | None = None
) -> dict:
    """The Quantization dropdown for a model (gr.update keywords): the recommendation for this machine,
    or off with the reason for a GGUF model."""
    entry = entry_for_repo(repo_id or "")
    if is_gguf_choice(repo_id):
        kind = f" ({entry.gguf_type})" if entry is not None and entry.gguf_type else ""
        return dict(
            value="none",
            interactive=False,
            info=f"Off: this GGUF model is already quantized{kind} and is served as it is",
        )
    if entry is None:
        return dict(value="none", interactive=True, info=QUANT_INFO)
    advice = _advice(entry, int(ctx or 4096), dtype_name, memory if memory is not None else available_memory("auto"))
    value = advice.recommended or "int4"  # nothing fits: the smallest is the best chance
    return dict(value=value, interactive=True, info=f"{QUANT_INFO}. Recommended here: {value}")


def default_context(
    repo_id: str | None, dtype_name: str, quantization: str | None, memory: tuple[str, int]
) -> int | None:
    """The Context field for a picked model: the longest context that fits this machine comfortably at the
    chosen quantization, up to the model's trained length (what the engine serves when not told), rather
    than a fixed 4,096. None for a model outside the catalog: the field stays as it is."""
    entry = entry_for_repo(repo_id or "")
    if entry is None:
        return None
    advice = _advice(entry, entry.max_position_embeddings, dtype_name, memory)
    quant = "none" if entry.is_gguf else (quantization or "none")
    option = next((o for o in advice.options if o.quantization == quant), None)
    if option is None or option.max_context_len is None:  # it does not fit: the estimate says so at a usual length
        return min(entry.max_position_embeddings, 4096)
    return option.max_context_len


def load_settings(
    repo_id: str | None,
    dtype_name: str,
    ctx,
    kv,
    quantization: str | None,
    max_num_seqs: int,
    kv_cache_dtype: str | None = "auto",
    speculation: str | None = "off",
) -> dict:
    """The engine settings a Load press passes on. Quantization is dropped for a GGUF model (the engine
    refuses to quantize one again)."""
    settings = {"dtype": dtype_name, "max_model_len": int(ctx) if ctx else None, "max_num_seqs": max_num_seqs}
    if kv:
        settings["kv_cache_memory_bytes"] = int(float(kv) * 2**30)
    kv_dtype = (kv_cache_dtype or "auto").strip().lower()
    if kv_dtype not in KV_CACHE_DTYPES:
        raise user_error(f"Unknown KV cache precision {kv_cache_dtype!r}: pick {', '.join(KV_CACHE_DTYPES)}.")
    if kv_dtype != "auto":
        settings["kv_cache_dtype"] = kv_dtype
    quant = (quantization or "none").strip().lower()
    if quant not in QUANTIZATIONS:
        raise user_error(f"Unknown quantization {quantization!r}: pick none, int8 or int4.")
    if quant != "none" and not is_gguf_choice(repo_id):
        settings["quantization"] = quant
    method = (speculation or "off").strip()
    if method.lower().startswith(DRAFT):  # the draft's file or folder, resolved by the caller
        draft = method[len(DRAFT) :].strip()
        settings["speculative_config"] = {"method": "draft", "model": draft, "num_speculative_tokens": DRAFT_TOKENS}
        return settings
    method = method.lower()
    if method not in SPECULATION:
        raise user_error(
            f"Unknown speculative decoding {speculation!r}: pick {', '.join(SPECULATION)} or a draft model."
        )
    if SPECULATION[method] is not None:
        settings["speculative_config"] = dict(SPECULATION[method])
    return settings


def speculation_choices(repo_id: str | None, manager: DownloadManager) -> list[tuple[str, str]]:
    """Off, n-gram, MTP where the chosen model ships a head, and a "Draft: <model>" per model here (downloaded, or
    bundled) that can draft for the chosen one (smaller, with its tokenizer); none while the chosen one is not
    here."""
    downloaded = {m.repo_id: m.load_path for m in manager.local_models()}
    names = [*downloaded, *(e.repo_id for e in load_catalog() if e.bundled)]
    models = {}  # each by the file or folder a load of it reads (a GGUF repo's chosen file)
    for name in (repo_id, *names):
        try:
            models[name] = resolve_model(name, downloaded)[0]
        except RuntimeError:  # not here (the bundled model's package missing, a repo not downloaded)
            continue
    if repo_id not in models:
        return list(SPECULATION_CHOICES)
    target = models.pop(repo_id)
    heads = [MTP_CHOICE] if ships_mtp_head(target) else []
    drafts = draft_candidates(target, models)
    return [*SPECULATION_CHOICES, *heads, *((f"Draft: {name}", f"{DRAFT}{name}") for name in drafts)]


def _download_target(repo_id: str, entry: CatalogEntry | None) -> tuple[str, str]:
    """(repo id, GGUF file or "") to download: a catalog GGUF entry's file, or a hub file typed as
    owner/repo/file.gguf."""
    if entry is not None:
        return entry.repo_id, entry.gguf_file
    parts = repo_id.split("/")
    if len(parts) >= 3 and repo_id.lower().endswith(".gguf"):
        return "/".join(parts[:2]), "/".join(parts[2:])
    return repo_id, ""


@dataclass
class LoadForm:
    """The model to load and how: the status line, the fields, the estimate under them, and the buttons."""

    status: gr.Markdown
    repo: gr.Dropdown
    dtype: gr.Dropdown
    quant: gr.Dropdown
    context: gr.Number
    kv_gib: gr.Number
    kv_dtype: gr.Dropdown
    speculation: gr.Dropdown
    fit: gr.Markdown
    download_btn: gr.Button
    load_btn: gr.Button
    unload_btn: gr.Button


@dataclass
class RemoteForm:
    """Connect to a server: its URL and key, the model it serves, and the buttons."""

    base_url: gr.Textbox
    api_key: gr.Textbox
    served: gr.Dropdown
    connect_btn: gr.Button
    disconnect_btn: gr.Button


def render_models_tab(ui, manager: DownloadManager | None = None) -> None:
    """Render inside an open gr.Blocks/gr.Tab. `ui` is the PagodaUI (its host loads models). The page, top to
    bottom: the load form, the downloads and downloaded models, free disk, and the server to connect to."""
    manager = manager or DownloadManager()
    form = render_load_form(ui, manager)
    rows, disk = render_download_rows(manager)
    remote = render_remote_form()
    wire_load_form(form, manager, rows)
    publish_download_api(manager)
    wire_loading(ui, form, manager)
    wire_remote(ui, remote, form.status)
    poll_downloads(ui, manager, form.status, rows)


def render_load_form(ui, manager: DownloadManager) -> LoadForm:
    """The fields open on the catalog's first model, with its recommended quantization, the context that
    fits this machine and the drafts it can have here."""
    catalog = load_catalog()
    choices = [
        (
            f"{e.name} ({e.params_label}{', ' + e.active_label if e.active_label else ''})"
            f"{' · bundled, offline' if e.bundled else ''}{' · gated' if e.gated else ''}",
            e.repo_id,
        )
        for e in catalog
    ]
    first = catalog[0].repo_id
    memory = available_memory("auto")  # one measurement for the form's first render
    first_quant = quantization_field(first, "auto", 4096, memory)
    first_context = default_context(first, "auto", first_quant["value"], memory) or 4096

    status = gr.Markdown(ui.host.status_message, elem_id="model-status")
    with gr.Row():
        repo = gr.Dropdown(
            choices=choices,
            value=catalog[0].repo_id,
            label="Model",
            allow_custom_value=True,
            elem_id="model-choice",
            info="Pick from the catalog, or type any Hugging Face repo id or local folder",
            scale=3,
        )
        dtype = gr.Dropdown(DTYPES, value="auto", label="Precision", scale=1)
        quant = gr.Dropdown(list(QUANTIZATIONS), label="Quantization", scale=1, elem_id="quantization", **first_quant)
        context = gr.Number(value=first_context, precision=0, label="Context length (tokens)", scale=1)
        # The engine's own default shown as it is: an empty Number reads 0, and its label said "empty = 1".
        kv_gib = gr.Number(value=1, minimum=0.25, label="KV cache memory on a CPU, GiB", scale=1)
        kv_dtype = gr.Dropdown(
            list(KV_CACHE_DTYPES),
            value="auto",
            label="KV cache precision",
            info="auto: as the model computes; int8 holds about 2x the context at no measurable loss, fp8 2x "
            "at a slight one, int4 about 3.5x at a small one (fp8 and int4 measure the model's keys at load)",
            elem_id="kv-cache-dtype",
            scale=1,
        )
        speculation = gr.Dropdown(
            speculation_choices(first, manager),
            value="off",
            label="Speculative decoding",
            info="N-gram drafts what the reply repeats of the prompt (edits, code) and checks it in one step; on a "
            "CPU it pays only with full-precision weights, and costs up to 5% otherwise. A draft model (a smaller "
            "one here with the same tokenizer) guesses every reply; it pays where it is several times smaller",
            elem_id="speculation",
            scale=1,
        )
    fit = gr.Markdown(estimate_text(first, "auto", first_context, first_quant["value"], memory), elem_id="fit-estimate")
    with gr.Row():
        download_btn = gr.Button("Download")
        load_btn = gr.Button("Load", variant="primary")
        unload_btn = gr.Button("Unload")
    return LoadForm(
        status, repo, dtype, quant, context, kv_gib, kv_dtype, speculation, fit, download_btn, load_btn, unload_btn
    )


def render_remote_form() -> RemoteForm:
    with gr.Accordion("Connect to a server", open=False, elem_id="remote"):
        gr.Markdown(
            "Chats can come from an OpenAI-compatible server instead: vLLM, SGLang, llama.cpp's server, "
            "Ollama, or another Pagoda (`python -m engine.serve`). Conversations stay here. Connecting "
            "unloads the local model; loading one disconnects the server."
        )
        with gr.Row():
            base_url = gr.Textbox(label="Server URL", placeholder="http://localhost:8000/v1", scale=3)
            api_key = gr.Textbox(label="API key (optional)", type="password", scale=2)
        with gr.Row():
            served = gr.Dropdown(choices=[], label="Model on the server", interactive=True, scale=3)
            connect_btn = gr.Button("Connect", variant="primary", scale=1)
            disconnect_btn = gr.Button("Disconnect", scale=1)
    return RemoteForm(base_url, api_key, served, connect_btn, disconnect_btn)


def wire_load_form(form: LoadForm, manager: DownloadManager, rows: gr.State) -> None:
    """A picked model gets its quantization, context and estimate; each field redoes the estimate; Download
    starts a row."""

    def pick_model(repo_id: str, dtype_name: str, ctx, kv_dtype: str = "auto", speculation: str = "off"):
        """A new model: its recommended quantization (or none, off, for a GGUF), the context it can serve
        here, its estimate, and the drafts it can have (the choice kept where it still can)."""
        memory = available_memory("auto")
        field = quantization_field(repo_id, dtype_name, 4096, memory)
        ctx = default_context(repo_id, dtype_name, field["value"], memory) or ctx
        estimate = estimate_text(repo_id, dtype_name, ctx, field["value"], memory, kv_dtype)
        choices = speculation_choices(repo_id, manager)
        kept = speculation if speculation in [value for _, value in choices] else "off"
        return gr.update(**field), gr.update(value=ctx), estimate, gr.update(choices=choices, value=kept)

    def estimate(repo_id: str, dtype_name: str, ctx, quantization: str, kv_dtype: str = "auto") -> str:
        return estimate_text(repo_id, dtype_name, ctx, quantization, kv_cache_dtype=kv_dtype)

    fields = [form.repo, form.dtype, form.context, form.quant, form.kv_dtype]
    form.repo.change(
        pick_model,
        [form.repo, form.dtype, form.context, form.kv_dtype, form.speculation],
        [form.quant, form.context, form.fit, form.speculation],
    )
    for control in (form.dtype, form.context, form.quant, form.kv_dtype):
        control.change(estimate, fields, form.fit)

    def start_download(repo_id: str):
        repo_id = (repo_id or "").strip()
        entry = entry_for_repo(repo_id)
        if entry is not None and entry.bundled:
            raise user_error(f"{entry.name} is bundled with Pagoda: no download needed.")
        if not repo_id or Path(repo_id).expanduser().exists():
            raise user_error("Give a Hugging Face repo id to download (a local folder or file can be loaded directly).")
        try:
            manager.start(*_download_target(repo_id, entry))
        except Exception as e:  # refused before starting: not enough disk, bad id
            raise user_error(str(e)) from e
        return listing(manager)

    form.download_btn.click(start_download, form.repo, rows)


def publish_download_api(manager: DownloadManager) -> None:
    """Cancel and delete for scripts; the page has buttons on each row instead."""

    def cancel_download(repo_id: str) -> str:
        """Cancel the downloads of a repo (scripts; the page has a Cancel button on each download's row)."""
        active = [job for job in manager.jobs() if job.repo_id == repo_id.strip() and job.active]
        for job in active:
            manager.cancel(job.id)
        return (
            f"Cancelling {len(active)} download(s) of {repo_id.strip()}"
            if active
            else f"No download of {repo_id.strip()} is running"
        )

    def delete_downloaded(repo_id: str) -> str:
        """Remove a downloaded model's files (scripts; the page has a Delete button on each model's row)."""
        manager.delete(repo_id.strip())
        return free_disk(manager)

    gr.api(cancel_download, api_name="cancel_download")
    gr.api(delete_downloaded, api_name="delete_model")


def wire_loading(ui, form: LoadForm, manager: DownloadManager) -> None:
    """Load (the form's choice, remembered for the next start once it serves) and Unload."""

    def load(
        repo_id: str,
        dtype_name: str,
        ctx,
        kv,
        quantization: str = "none",
        kv_dtype: str = "auto",
        speculation: str = "off",
    ):
        downloaded = {m.repo_id: m.load_path for m in manager.local_models()}
        try:
            source, label = resolve_model(repo_id, downloaded=downloaded)
            if (speculation or "").startswith(DRAFT):
                speculation = DRAFT + resolve_model(speculation[len(DRAFT) :], downloaded=downloaded)[0]
        except RuntimeError as e:
            raise user_error(str(e)) from e
        settings = load_settings(
            repo_id, dtype_name, ctx, kv, quantization, ui.max_concurrent_chats, kv_dtype, speculation
        )
        try:
            ui.host.load(source, label=label, remember_as=repo_id.strip(), **settings)  # the next start loads it
        except RuntimeError as e:
            raise user_error(str(e)) from e
        return ui.host.status_message()

    form.load_btn.click(
        load,
        [form.repo, form.dtype, form.context, form.kv_gib, form.quant, form.kv_dtype, form.speculation],
        form.status,
        api_name="load",
    )
    form.unload_btn.click(lambda: (ui.host.unload(), ui.host.state.message)[1], None, form.status)


def wire_remote(ui, remote: RemoteForm, status: gr.Markdown) -> None:
    def connect(url: str, key: str, model: str | None = None):
        try:
            server = ui.host.connect(url, key or None, model)
        except RemoteError as e:  # the previous backend keeps serving; the status line says so too
            gr.Warning(str(e))
            return ui.host.state.message, gr.update()
        return ui.host.state.message, gr.update(choices=server.models, value=server.model)

    remote.connect_btn.click(connect, [remote.base_url, remote.api_key], [status, remote.served])
    remote.served.input(connect, [remote.base_url, remote.api_key, remote.served], [status, remote.served])
    remote.disconnect_btn.click(lambda: (ui.host.disconnect(), ui.host.state.message)[1], None, status)


def poll_downloads(ui, manager: DownloadManager, status: gr.Markdown, rows: gr.State) -> None:
    """Once a second: the status line, and the rows when a download moved on."""

    def refresh(shown: dict):
        now = listing(manager)
        return ui.host.status_message(), (gr.skip() if now == shown else now)  # unchanged: no redraw

    timer = gr.Timer(1.0)
    timer.tick(
        refresh, rows, [status, rows], show_progress="hidden", concurrency_limit=1, concurrency_id="models-panel"
    )
