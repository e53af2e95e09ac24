"""The Models tab: the catalog with a memory estimate, downloads with progress, load and unload, and
a connection to a remote OpenAI-compatible server instead of a local model."""
from pathlib import Path

import gradio as gr

from app.catalog import entry_for_repo, fit_report, format_gib, load_catalog
from app.download_jobs import DownloadManager
from app.model_host import resolve_model
from app.remote import RemoteError

DTYPES = ["auto", "float32", "bfloat16", "float16"]


def _describe_jobs(manager: DownloadManager) -> str:
    lines = []
    for job in manager.jobs():
        done, total = job.bytes_done or 0, job.bytes_total or 0
        pct = f"{100 * done / total:.0f}%" if total else "…"
        speed = f" · {job.speed / 2**20:.1f} MiB/s" if job.speed else ""
        eta = f" · {job.eta_s:.0f} s left" if job.eta_s else ""
        line = f"- **{job.repo_id}**: {job.status} {pct} ({format_gib(done)} / {format_gib(total)} GiB){speed}{eta}"
        if job.error:
            line += f"\n  {job.error}"
        lines.append(line)
    return "\n".join(lines) or "No downloads yet."


def _local_rows(manager: DownloadManager) -> list[list]:
    return [[m.repo_id, f"{format_gib(m.size_bytes)} GiB", str(m.path)] for m in manager.local_models()]


def render_models_tab(ui, manager: DownloadManager | None = None) -> None:
    """Render inside an open gr.Blocks/gr.Tab. `ui` is the PagodaUI (its host loads models)."""
    manager = manager or DownloadManager()
    catalog = load_catalog()
    choices = [(f"{e.name} ({e.params_label}){' · bundled, offline' if e.bundled else ''}"
                f"{' · gated' if e.gated else ''}", e.repo_id) for e in catalog]

    def estimate(repo_id: str, dtype_name: str, ctx) -> str:
        entry = entry_for_repo(repo_id or "")
        if entry is None:
            return "No estimate for a model outside the catalog until its config is known; it is checked when it loads."
        size = f"Download: {format_gib(entry.download_bytes)} GiB. " if not entry.bundled else "Bundled: no download. "
        dt = "float32" if dtype_name == "auto" else dtype_name
        return size + fit_report(entry, int(ctx or 4096), dt).message

    status = gr.Markdown(ui.host.status_message, elem_id="model-status")
    with gr.Row():
        repo = gr.Dropdown(choices=choices, value=catalog[0].repo_id, label="Model", allow_custom_value=True,
                           info="Pick from the catalog, or type any Hugging Face repo id or local folder", scale=3)
        dtype = gr.Dropdown(DTYPES, value="auto", label="Precision", scale=1)
        context = gr.Number(value=4096, precision=0, label="Context length (tokens)", scale=1)
        kv_gib = gr.Number(value=None, label="KV cache memory, GiB (CPU; empty = 1)", scale=1)
    fit = gr.Markdown(estimate(catalog[0].repo_id, "auto", 4096))
    with gr.Row():
        download_btn = gr.Button("Download")
        load_btn = gr.Button("Load", variant="primary")
        unload_btn = gr.Button("Unload")
    downloads = gr.Markdown(_describe_jobs(manager))
    with gr.Row():
        job_to_cancel = gr.Textbox(label="Cancel download of (repo id)", scale=3)
        cancel_btn = gr.Button("Cancel download", scale=1)
    local = gr.Dataframe(_local_rows(manager), headers=["Downloaded model", "Size", "Folder"], interactive=False)
    with gr.Row():
        to_delete = gr.Textbox(label="Delete downloaded model (repo id)", scale=3)
        delete_btn = gr.Button("Delete", variant="stop", scale=1)
    disk = gr.Markdown(f"Free disk for downloads: {format_gib(manager.free_disk_bytes())} GiB")
    with gr.Accordion("Connect to a server", open=False, elem_id="remote"):
        gr.Markdown("Chats can come from an OpenAI-compatible server instead: vLLM, SGLang, llama.cpp's server, "
                    "Ollama, or another Pagoda (`python -m engine.serve`). Conversations stay here. Connecting "
                    "unloads the local model; loading one disconnects the server.")
        with gr.Row():
            base_url = gr.Textbox(label="Server URL", placeholder="http://localhost:8000/v1", scale=3)
            api_key = gr.Textbox(label="API key (optional)", type="password", scale=2)
        with gr.Row():
            served = gr.Dropdown(choices=[], label="Model on the server", interactive=True, scale=3)
            connect_btn = gr.Button("Connect", variant="primary", scale=1)
            disconnect_btn = gr.Button("Disconnect", scale=1)

    for control in (repo, dtype, context):
        control.change(estimate, [repo, dtype, context], fit)

    def start_download(repo_id: str):
        entry = entry_for_repo(repo_id or "")
        if entry is not None and entry.bundled:
            raise gr.Error(f"{entry.name} is bundled with Pagoda: no download needed.")
        if not repo_id or Path(repo_id).expanduser().is_dir():
            raise gr.Error("Give a Hugging Face repo id to download (a local folder can be loaded directly).")
        try:
            manager.start(repo_id)
        except Exception as e:  # refused before starting: not enough disk, bad id
            raise gr.Error(str(e)) from e
        return _describe_jobs(manager)

    download_btn.click(start_download, repo, downloads)

    def cancel(repo_id: str):
        for job in manager.jobs():
            if job.repo_id == repo_id.strip() and job.status in ("queued", "running"):
                manager.cancel(job.id)
        return _describe_jobs(manager)

    cancel_btn.click(cancel, job_to_cancel, downloads)

    def delete(repo_id: str):
        manager.delete(repo_id.strip())
        return _local_rows(manager), f"Free disk for downloads: {format_gib(manager.free_disk_bytes())} GiB"

    delete_btn.click(delete, to_delete, [local, disk])

    def load(repo_id: str, dtype_name: str, ctx, kv):
        try:
            source, label = resolve_model(repo_id, downloaded={m.repo_id: m.path for m in manager.local_models()})
        except RuntimeError as e:
            raise gr.Error(str(e)) from e
        settings = {"dtype": dtype_name, "max_model_len": int(ctx) if ctx else None,
                    "max_num_seqs": ui.max_concurrent_chats}
        if kv:
            settings["kv_cache_memory_bytes"] = int(float(kv) * 2**30)
        try:
            ui.host.load(source, label=label, **settings)
        except RuntimeError as e:
            raise gr.Error(str(e)) from e
        return ui.host.status_message()

    load_btn.click(load, [repo, dtype, context, kv_gib], status, api_name="load")
    unload_btn.click(lambda: (ui.host.unload(), ui.host.state.message)[1], None, status)

    def connect(url: str, key: str, model: str | None = None):
        try:
            remote = ui.host.connect(url, key or None, model)
        except RemoteError as e:  # the previous backend keeps serving; the status line says so too
            gr.Warning(str(e))
            return ui.host.state.message, gr.update()
        return ui.host.state.message, gr.update(choices=remote.models, value=remote.model)

    connect_btn.click(connect, [base_url, api_key], [status, served])
    served.input(connect, [base_url, api_key, served], [status, served])
    disconnect_btn.click(lambda: (ui.host.disconnect(), ui.host.state.message)[1], None, status)

    timer = gr.Timer(1.0)
    timer.tick(lambda: (ui.host.status_message(), _describe_jobs(manager), _local_rows(manager)), None,
               [status, downloads, local], show_progress="hidden", concurrency_limit=1, concurrency_id="models-panel")
