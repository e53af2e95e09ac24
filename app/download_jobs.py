"""Model downloads from the Hugging Face hub: background jobs with byte progress, cancel, and a disk check first.

Downloads go through `huggingface_hub.snapshot_download` with the engine's own file patterns
(`engine.loader.HUB_PATTERNS`), into the standard HF cache unless a folder is given, so a model downloaded here is
the same files `LLM("org/name")` would load. A GGUF repo holds one file per quantization, each the size of a whole
model: a job for one (`start(repo, gguf_file=...)`) fetches that file only, through the same snapshot_download
call (so progress and cancel work the same), and sizes and the disk check count that file alone.

Each job runs in its own thread; the UI polls `jobs()`. The cache itself (listing, completeness, delete) is
`app.hub_cache`, and the sentences for hub failures are `app.hub_errors`; `DownloadManager.local_models()` and
`delete()` wrap the cache functions so that they take running jobs into account.

Byte progress and cancelling go through the job's own progress bar: see app/download_progress.py.

After a cancel (or a failure) the files that finished stay in the cache and are reused by the next start; the file
in flight is dropped (huggingface_hub 2.x writes each download to a uniquely named `*.incomplete` file and deletes it
on failure; older versions keep `<etag>.incomplete` and resume it with a Range request). Either way the snapshot
lacks weights, so the cache listing shows it as partial.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from app import hub_cache
from app.download_progress import Cancelled, JobState, progress_bar_class
from app.hub_cache import LocalModel, folder_bytes, snapshot_complete
from app.hub_errors import DownloadError, explain_error
from engine.loader import HUB_PATTERNS

if TYPE_CHECKING:  # imported where used: app.catalog is only needed by inspect()
    from app.catalog import CatalogEntry

__all__ = ["DownloadManager", "DownloadJob", "DiskCheck"]

GiB = 1024**3
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_ACTIVE = ("queued", "running")
# huggingface_hub reads the response in DOWNLOAD_CHUNK_SIZE pieces (10 MiB) and reports progress once per piece; the
# progress bar is also where a cancel takes effect. 1 MiB pieces give smooth progress and a prompt cancel.
_PROGRESS_CHUNK = 1024 * 1024


@dataclass
class DownloadJob:
    """A snapshot of one download, safe to hand to the UI."""

    id: str
    repo_id: str
    gguf_file: str = ""  # the one GGUF file this job fetches ("": the repo's engine files)
    status: str = "queued"  # queued, running, done, cancelled, error
    bytes_done: int = 0
    bytes_total: int = 0  # 0 until the size is known
    speed: float = 0.0  # bytes/s, smoothed
    eta_s: float | None = None
    error: str | None = None  # a sentence for the user when status == "error"
    path: str | None = None  # when status == "done": the snapshot folder, or the GGUF file
    started_at: float = 0.0
    finished_at: float | None = None
    cancel_requested: bool = False

    @property
    def fraction(self) -> float:
        return min(1.0, self.bytes_done / self.bytes_total) if self.bytes_total else 0.0

    @property
    def active(self) -> bool:
        return self.status in _ACTIVE


@dataclass
class DiskCheck:
    """What the UI shows before a download starts."""

    repo_id: str
    size_bytes: int  # files the download takes (engine patterns, or the one GGUF file)
    needed_bytes: int  # minus what the cache already holds
    free_bytes: int
    fits: bool
    message: str


@dataclass
class _RepoFiles:
    size_bytes: int
    files: list[tuple[str, int, str]]  # (path in repo, size, blob name in the cache)
    sha: str | None


class DownloadManager:
    """Downloads hub repos into the HF cache (or `models_dir`) in background threads, and manages that cache.

    `endpoint` and `token` go to every hub call (None: HF_ENDPOINT / the logged-in token).

    `use_xet=False` (the default) downloads over plain HTTP even when `hf_xet` is installed. With Xet, progress
    arrives from a thread that hf_xet owns, which swallows the exception a cancel raises, so a cancelled file would
    keep downloading to its end (huggingface_hub issue #4632); over HTTP the cancel lands at the next chunk. With
    `use_xet=True`, a cancel also aborts huggingface_hub's process-wide Xet session when no other job is running.
    Both settings, like the 1 MiB progress chunk, are huggingface_hub globals: they apply to the whole process."""

    def __init__(
        self,
        models_dir: str | os.PathLike | None = None,
        *,
        endpoint: str | None = None,
        token: str | bool | None = None,
        max_workers: int = 8,
        use_xet: bool = False,
    ):
        self.cache_dir = Path(models_dir).expanduser() if models_dir is not None else None
        self.endpoint = endpoint.rstrip("/") if endpoint else None
        self.token = token
        self.max_workers = max_workers
        self.use_xet = use_xet
        self._jobs: dict[str, JobState] = {}
        self._lock = threading.Lock()
        self._sizes: dict[tuple[str, str], _RepoFiles] = {}  # (repo id, GGUF file or "") -> its files
        self._byte_bars = True  # tests turn this off to exercise the on-disk fallback

    # ---- where things are -------------------------------------------------------------------------------------

    @property
    def cache_path(self) -> Path:
        """The hub cache folder downloads go to."""
        return self.cache_dir if self.cache_dir is not None else hub_cache.default_cache_path()

    def storage_folder(self, repo_id: str) -> Path:
        return hub_cache.repo_folder(self.cache_path, repo_id)

    def free_disk_bytes(self) -> int:
        """Free bytes on the disk that holds the cache (its nearest existing parent while it does not exist)."""
        path = self.cache_path.resolve()
        while not path.exists() and path != path.parent:
            path = path.parent
        return shutil.disk_usage(path).free

    # ---- asking the hub ---------------------------------------------------------------------------------------

    def _api(self):
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.endpoint, token=self.token)

    def _repo_files(self, repo_id: str, refresh: bool = False, gguf_file: str = "") -> _RepoFiles:
        key = (repo_id, gguf_file)
        if not refresh and key in self._sizes:
            return self._sizes[key]
        from huggingface_hub.utils import filter_repo_objects

        info = self._api().model_info(repo_id, files_metadata=True)
        if gguf_file:
            siblings = [s for s in info.siblings or [] if s.rfilename == gguf_file]
            if not siblings:
                others = sorted(s.rfilename for s in info.siblings or [] if s.rfilename.lower().endswith(".gguf"))
                listing = f" It holds {', '.join(others)}." if others else " It holds no GGUF file."
                raise DownloadError(
                    f"{repo_id} has no file {gguf_file}.{listing} Pick one of those, or check "
                    "the name on the repo's Hugging Face page."
                )
        else:
            siblings = list(
                filter_repo_objects(info.siblings or [], allow_patterns=HUB_PATTERNS, key=lambda s: s.rfilename)
            )
        files = []
        for s in siblings:
            lfs = getattr(s, "lfs", None)
            size = s.size if s.size is not None else (lfs.size if lfs is not None else 0)
            blob = (lfs.sha256 if lfs is not None else None) or getattr(s, "blob_id", None) or ""
            files.append((s.rfilename, int(size or 0), blob))
        result = _RepoFiles(sum(f[1] for f in files), files, info.sha)
        self._sizes[key] = result
        return result

    def repo_files_size(self, repo_id: str, gguf_file: str = "") -> int:
        """Bytes a download of `repo_id` takes (only the files the engine uses, or only `gguf_file`).
        Raises DownloadError."""
        _check_repo_id(repo_id)
        try:
            return self._repo_files(repo_id, refresh=True, gguf_file=gguf_file).size_bytes
        except DownloadError:
            raise
        except Exception as e:
            raise DownloadError(explain_error(e, repo_id, self.endpoint)) from e

    def check_disk(self, repo_id: str, size_bytes: int | None = None, gguf_file: str = "") -> DiskCheck:
        """Size of the download, free disk, and whether it fits. Raises DownloadError when the hub cannot say."""
        size = self.repo_files_size(repo_id, gguf_file) if size_bytes is None else int(size_bytes)
        cached = self._cached_bytes(repo_id, gguf_file) if (repo_id, gguf_file) in self._sizes else 0
        return self._disk_check(repo_id, size, max(0, size - cached))

    def _disk_check(self, repo_id: str, size: int, needed: int) -> DiskCheck:
        free = self.free_disk_bytes()
        fits = needed <= free
        if fits:
            message = f"{repo_id}: {_gib(size)} to download; {_gib(free)} free on disk."
        else:
            message = (
                f"Not enough disk space for {repo_id}: it needs {_gib(needed)} but only {_gib(free)} is free "
                f"in {self.cache_path}. Free some space or delete a model you no longer use."
            )
        return DiskCheck(repo_id, size, needed, free, fits, message)

    def inspect(self, repo_id: str) -> CatalogEntry:
        """A catalog entry for any hub repo (its catalog entry when it has one), from config.json and the file sizes.

        Fetches only config.json, into a temporary folder. Raises DownloadError with a sentence for the user."""
        from app.catalog import entry_for_repo, entry_from_config

        _check_repo_id(repo_id)
        known = entry_for_repo(repo_id)
        if known is not None:
            return known
        try:
            from huggingface_hub import hf_hub_download

            size = self._repo_files(repo_id, refresh=True).size_bytes
            with tempfile.TemporaryDirectory(prefix="pagoda-config-") as tmp:
                path = hf_hub_download(repo_id, "config.json", cache_dir=tmp, endpoint=self.endpoint, token=self.token)
                config = json.loads(Path(path).read_text(encoding="utf-8"))
        except Exception as e:
            raise DownloadError(explain_error(e, repo_id, self.endpoint)) from e
        try:
            return entry_from_config(repo_id, config, size)
        except ValueError as e:
            raise DownloadError(str(e)) from e

    # ---- jobs -------------------------------------------------------------------------------------------------

    def start(self, repo_id: str, gguf_file: str = "") -> str:
        """Start downloading `repo_id` (only its file `gguf_file`, when given) in the background and return the
        job id.

        A job already active for the same repo and file is returned instead of a second one. Problems (no
        connection, gated or missing repo or file, not enough disk) never raise here: the job ends with status
        "error" and a sentence in `error`. Only a malformed repo id or file name raises ValueError."""
        repo_id, gguf_file = repo_id.strip(), (gguf_file or "").strip()
        _check_repo_id(repo_id)
        if gguf_file and not gguf_file.lower().endswith(".gguf"):
            raise ValueError(f"{gguf_file!r} is not a GGUF file name; it looks like 'Qwen3-8B-Q4_K_M.gguf'")
        with self._lock:
            for state in self._jobs.values():
                job = state.job
                if (job.repo_id, job.gguf_file) == (repo_id, gguf_file) and job.active and not state.cancel.is_set():
                    return job.id
            job = DownloadJob(id=uuid.uuid4().hex[:12], repo_id=repo_id, gguf_file=gguf_file, started_at=time.time())
            state = JobState(job, storage=self.storage_folder(repo_id))
            self._jobs[job.id] = state
        state.thread = threading.Thread(target=self._run, args=(state,), name=f"download-{repo_id}", daemon=True)
        state.thread.start()
        return job.id

    def jobs(self) -> list[DownloadJob]:
        """Snapshots of all jobs, oldest first."""
        with self._lock:
            states = list(self._jobs.values())
        return [self._snapshot(s) for s in states]

    def job(self, job_id: str) -> DownloadJob:
        return self._snapshot(self._state(job_id))

    def cancel(self, job_id: str) -> bool:
        """Ask a job to stop; True when it was still active. It reads "cancelled" once its thread has unwound
        (at the next chunk received, so within a moment on a live connection)."""
        state = self._state(job_id)
        with state.lock:
            if not state.job.active:
                return False
            state.cancel.set()
            state.job.cancel_requested = True
        if self.use_xet:
            self._abort_xet_if_alone(state)
        return True

    def _abort_xet_if_alone(self, state: JobState) -> None:
        """Xet swallows exceptions from progress callbacks; its only stop is the process-wide session abort
        (private API in huggingface_hub 2.4), so use it when no other job would be cut off with it."""
        with self._lock:
            others = any(s.job.active and s is not state and not s.cancel.is_set() for s in self._jobs.values())
        if others:
            return
        try:
            from huggingface_hub.utils._xet import abort_xet_session
        except ImportError:
            return
        try:
            abort_xet_session()
        except Exception:  # noqa: BLE001 - best effort; the file then finishes and the next update stops the job
            pass

    def wait(self, job_id: str, timeout: float | None = None) -> DownloadJob:
        """Block until the job finishes (or the timeout passes) and return its snapshot."""
        state = self._state(job_id)
        if state.thread is not None:
            state.thread.join(timeout)
        return self._snapshot(state)

    def retry(self, job_id: str) -> str:
        """Start a failed or cancelled job again, in its place: its row goes, the new job's comes, and the files
        that finished before are reused. Returns the new job's id (the old one's while it is still active)."""
        job = self.job(job_id)
        if job.active:
            return job.id
        new_id = self.start(job.repo_id, job.gguf_file)
        self.forget(job_id)
        return new_id

    def forget(self, job_id: str) -> None:
        """Drop a finished job from `jobs()`."""
        with self._lock:
            state = self._jobs.get(job_id)
            if state is not None and not state.job.active:
                del self._jobs[job_id]

    def _state(self, job_id: str) -> JobState:
        with self._lock:
            try:
                return self._jobs[job_id]
            except KeyError:
                raise KeyError(f"no download job {job_id!r}") from None

    def _run(self, state: JobState) -> None:
        job = state.job
        try:
            files = self._repo_files(job.repo_id, refresh=True, gguf_file=job.gguf_file)
            state.cached_bytes = self._cached_bytes(job.repo_id, job.gguf_file)
            state.disk_baseline = folder_bytes(state.storage / "blobs") if state.storage else 0
            with state.lock:
                job.bytes_total = files.size_bytes
                job.bytes_done = min(state.cached_bytes, files.size_bytes)
            check = self._disk_check(job.repo_id, files.size_bytes, max(0, files.size_bytes - state.cached_bytes))
            if not check.fits:
                self._finish(state, "error", error=check.message)
                return
            if state.cancel.is_set():
                raise Cancelled()
            with state.lock:
                job.status = "running"
                state.sample_t = state.last_progress_t = time.monotonic()
                state.sample_bytes = job.bytes_done

            from huggingface_hub import constants, snapshot_download

            if getattr(constants, "DOWNLOAD_CHUNK_SIZE", 0) > _PROGRESS_CHUNK:
                constants.DOWNLOAD_CHUNK_SIZE = _PROGRESS_CHUNK  # process-wide, read at each chunk loop
            if not self.use_xet:
                constants.HF_HUB_DISABLE_XET = True  # read at each file (utils.is_xet_available)
            # A GGUF job names its one file: a literal pattern (fnmatch would read [ ] in a name as a set).
            patterns = [_literal(job.gguf_file)] if job.gguf_file else HUB_PATTERNS
            path = snapshot_download(
                job.repo_id,
                allow_patterns=patterns,
                cache_dir=self.cache_dir,
                endpoint=self.endpoint,
                token=self.token,
                max_workers=self.max_workers,
                tqdm_class=progress_bar_class(state, self._byte_bars),
            )
            complete = (
                Path(path, job.gguf_file).is_file() if job.gguf_file else snapshot_complete(Path(path), state.storage)
            )
            if state.cancel.is_set() and not complete:
                raise Cancelled()
            if not complete:
                self._finish(
                    state,
                    "error",
                    error=f"The download of {job.repo_id} ended without all of its files; start it again to resume.",
                )
                return
            self._finish(state, "done", path=str(Path(path, job.gguf_file) if job.gguf_file else path))
        except Cancelled:
            self._finish(state, "cancelled")
        except DownloadError as e:  # already a sentence for the user (a GGUF file the repo lacks)
            self._finish(state, "error", error=str(e))
        except BaseException as e:  # noqa: BLE001 - every failure becomes the job's message
            if state.cancel.is_set():
                self._finish(state, "cancelled")
            else:
                self._finish(state, "error", error=explain_error(e, job.repo_id, self.endpoint))

    def _finish(self, state: JobState, status: str, *, error: str | None = None, path: str | None = None) -> None:
        with state.lock:
            job = state.job
            job.status, job.error, job.path = status, error, path
            job.finished_at = time.time()
            job.eta_s = None
            job.speed = 0.0
            if status == "done":
                job.bytes_done = job.bytes_total = max(job.bytes_total, job.bytes_done)
                job.eta_s = 0.0

    def _snapshot(self, state: JobState) -> DownloadJob:
        if state.job.status == "running" and not state.bars_seen_bytes():
            state.disk_progress()
        with state.lock:
            job = dataclasses.replace(state.job)
            if job.status == "running":
                now = time.monotonic()
                idle = now - state.last_progress_t
                if idle > 2.0:  # stalled: let the shown speed decay instead of freezing
                    job.speed = state.job.speed * 2.0 / idle
                if job.speed > 0 and job.bytes_total:
                    job.eta_s = max(0.0, (job.bytes_total - job.bytes_done) / job.speed)
                else:
                    job.eta_s = None
        return job

    def _cached_bytes(self, repo_id: str, gguf_file: str = "") -> int:
        files = self._sizes.get((repo_id, gguf_file))
        blobs = self.storage_folder(repo_id) / "blobs"
        if files is None or not blobs.is_dir():
            return 0
        return sum(size for _, size, blob in files.files if blob and (blobs / blob).is_file())

    # ---- the local cache --------------------------------------------------------------------------------------

    def local_models(self, include_partial: bool = False) -> list[LocalModel]:
        """Models in the cache (a config.json or a GGUF file), newest snapshot per repo, sorted by repo id.

        An interrupted download is listed only with `include_partial=True` (with complete=False); a repo with
        an active job counts as partial."""
        with self._lock:
            busy = {s.job.repo_id for s in self._jobs.values() if s.job.active}
        return hub_cache.local_models(self.cache_path, include_partial, busy)

    def delete(self, repo_id: str) -> int:
        """Remove a repo from the cache (all revisions and partial files) and return the bytes freed.

        An active download of it is cancelled first. Returns 0 when nothing was there."""
        with self._lock:
            active = [s for s in self._jobs.values() if s.job.repo_id == repo_id and s.job.active]
        for state in active:
            self.cancel(state.job.id)
            if state.thread is not None:
                state.thread.join(30)
        freed = hub_cache.delete_repo(self.cache_path, repo_id)
        for key in [k for k in self._sizes if k[0] == repo_id]:
            del self._sizes[key]
        return freed


# ---- helpers ----------------------------------------------------------------------------------------------------


def _check_repo_id(repo_id: str) -> None:
    if not isinstance(repo_id, str) or not _REPO_ID.match(repo_id.strip()):
        raise ValueError(f"{repo_id!r} is not a hub repo id; it looks like 'Qwen/Qwen3-0.6B'")


def _literal(name: str) -> str:
    """An fnmatch pattern that matches exactly `name`."""
    return re.sub(r"([\[\]*?])", r"[\1]", name)


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 else f"{n / 1024**2:.0f} MiB"
