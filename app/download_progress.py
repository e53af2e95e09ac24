"""A download job's progress and its cancel, both through the progress bar huggingface_hub drives.

`snapshot_download(tqdm_class=...)` gets a tqdm subclass made for the job.
huggingface_hub 2.4 (checked against its source) builds two aggregate *byte* bars from that class (unit "B": bytes
written, bytes received) and feeds every file's chunks into them; older versions build only the "Fetching N files"
bar from it. The job counts bytes from the unit-"B" bars when there are any and otherwise measures the repo's blob
folder on disk (including `*.incomplete` files), so progress works either way. huggingface_hub reads responses in
DOWNLOAD_CHUNK_SIZE pieces (10 MiB) and reports once per piece; the manager lowers that to 1 MiB. The bar's
`update()` is also where a cancelled job stops: it raises `Cancelled` inside the download thread. Xet
transfers report from a thread hf_xet owns and ignore that exception, so downloads use plain HTTP unless the
manager is built with `use_xet=True` (see app/download_jobs.py's DownloadManager).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm as _std_tqdm

from app.hub_cache import folder_bytes

if TYPE_CHECKING:
    from app.download_jobs import DownloadJob

__all__ = ["Cancelled", "JobState", "progress_bar_class"]


class Cancelled(BaseException):
    """Raised from the job's progress bar to unwind snapshot_download when the job is cancelled.

    A BaseException so that no `except Exception` on the way (retries, fallbacks) swallows it."""


@dataclass
class JobState:
    job: DownloadJob
    cancel: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    thread: threading.Thread | None = None
    storage: Path | None = None
    cached_bytes: int = 0  # bytes of this repo's files already in the cache at start
    disk_baseline: int = 0  # bytes in the repo's blob folder at start (fallback progress)
    bars: dict[int, list] = field(default_factory=dict)  # bar key -> [kind, bytes counted]
    sample_t: float = 0.0
    sample_bytes: int = 0
    last_progress_t: float = 0.0

    def register_bar(self, bar, kwargs: dict, byte_bars: bool) -> None:
        """Classify a new progress bar: bytes written (unit "B" with a total), network bytes, or a file count."""
        unit = kwargs.get("unit", "it")
        bar_format = str(kwargs.get("bar_format") or "{total}")
        if unit != "B" or not byte_bars:
            kind = "items"
        elif str(kwargs.get("desc") or "").startswith("Downloading bytes") or "{total" not in bar_format:
            kind = "transfer"  # network bytes: after dedup/compression, no trustworthy total
        else:
            kind = "bytes"  # bytes written: add up to the file sizes
        with self.lock:
            bar._pagoda_key = len(self.bars)
            self.bars[bar._pagoda_key] = [kind, 0]
        if kind != "items" and kwargs.get("initial"):
            self.bar_progress(bar, int(kwargs["initial"]))

    def bar_progress(self, bar, n) -> None:
        with self.lock:
            entry = self.bars.get(getattr(bar, "_pagoda_key", None))
            if entry is None or entry[0] == "items":
                return
            entry[1] += int(n)
            kinds = {k for k, _ in self.bars.values()}
            want = "bytes" if "bytes" in kinds else "transfer"
            downloaded = max((c for k, c in self.bars.values() if k == want), default=0)
        self.set_done(self.cached_bytes + downloaded)

    def set_done(self, done: int) -> None:
        now = time.monotonic()
        with self.lock:
            job = self.job
            if job.bytes_total:
                done = min(done, job.bytes_total)
            if done > job.bytes_done:
                self.last_progress_t = now
            job.bytes_done = max(job.bytes_done, done)
            dt = now - self.sample_t
            if dt >= 0.25:
                rate = (job.bytes_done - self.sample_bytes) / dt
                job.speed = rate if job.speed <= 0 else 0.3 * rate + 0.7 * job.speed
                self.sample_t, self.sample_bytes = now, job.bytes_done
                left = job.bytes_total - job.bytes_done
                job.eta_s = left / job.speed if job.speed > 0 and job.bytes_total else None

    def bars_seen_bytes(self) -> bool:
        with self.lock:
            return any(k != "items" for k, _ in self.bars.values())

    def disk_progress(self) -> None:
        """Fallback progress from the bytes in the repo's blob folder (huggingface_hub versions without byte bars)."""
        if self.storage is None:
            return
        grown = folder_bytes(self.storage / "blobs") - self.disk_baseline
        self.set_done(self.cached_bytes + max(0, grown))


def progress_bar_class(state: JobState, byte_bars: bool = True) -> type:
    """The tqdm class snapshot_download gets for one job: silent, reporting into `state`, and raising Cancelled once
    the job is cancelled. `byte_bars=False` ignores byte bars (tests of the on-disk fallback)."""

    class _JobTqdm(_std_tqdm):
        """Silent tqdm that reports into one job and stops the download when the job is cancelled."""

        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)  # huggingface_hub passes it to its own tqdm subclass only
            kwargs["disable"] = True  # never draw; a disabled tqdm still keeps n and total
            super().__init__(*args, **kwargs)
            if state.cancel.is_set():
                raise Cancelled()
            state.register_bar(self, kwargs, byte_bars)

        def update(self, n=1):
            if state.cancel.is_set():
                raise Cancelled()
            n = n or 0
            self.n += n  # tqdm.update returns early when disabled
            state.bar_progress(self, n)
            return None

    return _JobTqdm
