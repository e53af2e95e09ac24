"""The Models tab's Downloads and Downloaded models lists: one row per download (its progress, and Cancel, Retry or
Dismiss) and per downloaded model (Delete, asked first), and the free disk under them."""

import gradio as gr

from app.download_jobs import DownloadJob, DownloadManager
from app.memory_estimate import format_gib
from app.page import user_error


def _describe_job(job: DownloadJob) -> str:
    done, total = job.bytes_done or 0, job.bytes_total or 0
    pct = f"{100 * done / total:.0f}%" if total else "…"
    speed = f" · {job.speed / 2**20:.1f} MiB/s" if job.speed else ""
    eta = f" · {job.eta_s:.0f} s left" if job.eta_s else ""
    name = f"{job.repo_id}/{job.gguf_file}" if job.gguf_file else job.repo_id
    line = f"**{name}**: {job.status} {pct} ({format_gib(done)} / {format_gib(total)} GiB){speed}{eta}"
    return line + (f"  \n{job.error}" if job.error else "")


def job_actions(job: DownloadJob) -> tuple[str, ...]:
    """The buttons on a download's row: Cancel while it runs; Retry and Dismiss once it failed or was cancelled
    (a failed row had neither, and stayed until a restart); Dismiss once it is done."""
    if job.active:
        return ("Cancel",)
    return ("Dismiss",) if job.status == "done" else ("Retry", "Dismiss")


def listing(manager: DownloadManager) -> dict:
    """What the Downloads and Downloaded lists show, one row each: a download (its line, and its buttons, see
    `job_actions`) and a downloaded model (its line). The rows are drawn again only when this changes."""
    return {
        "jobs": [(job.id, _describe_job(job), job_actions(job)) for job in manager.jobs()],
        "models": [
            (m.repo_id, f"**{m.repo_id}** · {format_gib(m.size_bytes)} GiB · `{m.load_path}`")
            for m in manager.local_models()
        ],
    }


def job_action(manager: DownloadManager, job_id: str, action: str) -> dict:
    """A download row's button pressed (one of `job_actions`); the listing after it."""
    try:
        if action == "Cancel":
            manager.cancel(job_id)
        elif action == "Retry":
            manager.retry(job_id)
        elif action == "Dismiss":
            manager.forget(job_id)
    except KeyError:  # dismissed meanwhile in another tab: the listing shows what is left
        pass
    except ValueError as e:  # a retry refused at once
        raise user_error(str(e)) from e
    return listing(manager)


def free_disk(manager: DownloadManager) -> str:
    return f"Free disk for downloads: {format_gib(manager.free_disk_bytes())} GiB"


def render_download_rows(manager: DownloadManager) -> tuple[gr.State, gr.Markdown]:
    """The Downloads and Downloaded models lists, one row each with its buttons, and free disk under them:
    (the listing they are drawn from, the free-disk line)."""
    rows = gr.State(listing(manager))
    confirmed = gr.Checkbox(visible=False)  # a Delete's answer to the browser's "are you sure?"

    def delete_model(repo_id: str) -> tuple[dict, str]:
        manager.delete(repo_id)
        return listing(manager), free_disk(manager)

    @gr.render(inputs=rows)
    def draw_rows(shown: dict):
        gr.Markdown("**Downloads**")
        if not shown["jobs"]:
            gr.Markdown("No downloads yet.")
        for job_id, line, actions in shown["jobs"]:
            with gr.Row(key=f"job-{job_id}", equal_height=True, elem_classes="download-row"):
                gr.Markdown(line)
                for action in actions:
                    gr.Button(action, size="sm", scale=0, min_width=90).click(
                        lambda j=job_id, a=action: job_action(manager, j, a), None, rows, api_visibility="private"
                    )
        gr.Markdown("**Downloaded models**")
        if not shown["models"]:
            gr.Markdown("None yet: pick a model above and press Download.")
        for repo_id, line in shown["models"]:
            with gr.Row(key=f"model-{repo_id}", equal_height=True, elem_classes="model-row"):
                gr.Markdown(line)
                gr.Button("Delete", size="sm", variant="stop", scale=0, min_width=90).click(
                    lambda ok, r=repo_id: delete_model(r) if ok else (gr.skip(), gr.skip()),
                    confirmed,
                    [rows, disk],
                    js=f"() => confirm({f'Delete {repo_id} from this computer? Its files are removed.'!r})",
                    api_visibility="private",
                )

    disk = gr.Markdown(free_disk(manager))
    return rows, disk
