"""The download manager against a local fake hub: sizes, byte progress, cancel and resume, the disk check, and the
cache listing and delete as the manager sees them. The `hub` and `manager` fixtures are in hub_fixtures.py."""

import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from hub_fixtures import GGUF_FILES, GGUF_REPO, REPO, expected_size  # noqa: E402

Q4, Q8 = "tiny-chat-Q4_K_M.gguf", "tiny-chat-Q8_0.gguf"


def watch(manager, job_id, timeout=120.0, on_sample=None):
    """Poll a job until it finishes; return (final snapshot, bytes_done samples while running)."""
    samples = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = manager.job(job_id)
        if job.status == "running":
            samples.append(job.bytes_done)
            if on_sample is not None:
                on_sample(job)
        if not job.active:
            return job, samples
        time.sleep(0.02)
    pytest.fail(f"job did not finish in {timeout}s: {manager.job(job_id)}")


def test_repo_size_counts_only_engine_files(manager, hub):
    assert manager.repo_files_size(REPO) == expected_size(hub)
    check = manager.check_disk(REPO)
    assert check.fits and check.size_bytes == expected_size(hub) and check.free_bytes > 0
    assert "to download" in check.message
    assert manager.free_disk_bytes() > 0


@pytest.mark.parametrize("byte_bars", [True, False], ids=["tqdm-bytes", "disk-fallback"])
def test_download_to_completion_with_byte_progress(manager, hub, byte_bars):
    manager._byte_bars = byte_bars
    hub.throttle = 0.008  # 128 chunks of 32 KiB: about 1 s
    job_id = manager.start(REPO)
    job, samples = watch(manager, job_id)
    assert job.status == "done", job.error
    total = expected_size(hub)
    assert job.bytes_total == total and job.bytes_done == total and job.error is None
    assert samples == sorted(samples), "progress went backwards"
    assert any(0 < s < total for s in samples), f"no intermediate byte progress seen: {samples[:5]}...{samples[-5:]}"
    path = Path(job.path)
    assert (path / "model.safetensors").read_bytes() == hub.repos[REPO].files["model.safetensors"]
    assert not (path / "README.md").exists()

    models = manager.local_models()
    assert [m.repo_id for m in models] == [REPO]
    assert models[0].complete and models[0].path == path and models[0].size_bytes >= total
    assert models[0].architectures == ("Qwen3ForCausalLM",)

    freed = manager.delete(REPO)
    assert freed >= total
    assert manager.local_models(include_partial=True) == []
    assert not manager.storage_folder(REPO).exists()
    assert manager.delete(REPO) == 0


def test_byte_progress_comes_from_the_tqdm_class(manager, hub):
    """On this huggingface_hub, snapshot_download builds byte bars from tqdm_class: check the job used them."""
    hub.throttle = 0.002
    job_id = manager.start(REPO)
    job, _ = watch(manager, job_id)
    assert job.status == "done", job.error
    kinds = sorted(k for k, _ in manager._jobs[job_id].bars.values())
    assert "bytes" in kinds or "transfer" in kinds, kinds
    counted = max(c for k, c in manager._jobs[job_id].bars.values() if k != "items")
    assert counted == expected_size(hub)


def test_cancel_mid_download_then_resume(manager, hub):
    hub.throttle = 0.05  # about 6 s for the weights: plenty of time to cancel
    job_id = manager.start(REPO)
    assert manager.start(REPO) == job_id, "a second start of an active repo returns the same job"
    cancelled = []

    def cancel_once_weights_flow(job):
        if not cancelled and job.bytes_done > 300 * 1024:
            cancelled.append(job.bytes_done)
            assert manager.cancel(job_id)

    job, _ = watch(manager, job_id, on_sample=cancel_once_weights_flow)
    assert cancelled, "the download finished before it could be cancelled"
    assert job.status == "cancelled" and job.cancel_requested and job.path is None
    assert 0 < job.bytes_done < job.bytes_total  # it stopped at a chunk, not at the end
    assert not manager.cancel(job_id), "cancelling a finished job is a no-op"

    # The partial download is not a model: not listed, and its snapshot lacks the weights.
    assert manager.local_models() == []
    partial = manager.local_models(include_partial=True)
    assert [(m.repo_id, m.complete) for m in partial] == [(REPO, False)]
    assert not (partial[0].path / "model.safetensors").exists()

    # Starting again completes, fetching only what is missing (files that finished before the cancel are reused;
    # huggingface_hub 2.x drops the file in flight, older versions resume it with a Range request).
    hub.throttle = 0.0
    job2 = manager.wait(manager.start(REPO), timeout=20)
    assert job2.status == "done", job2.error
    gets = [r[1].rsplit("/", 1)[-1] for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]]
    assert gets.count("config.json") == 1 and gets.count("model.safetensors") == 2, gets
    assert (Path(job2.path) / "model.safetensors").read_bytes() == hub.repos[REPO].files["model.safetensors"]
    assert [m.repo_id for m in manager.local_models()] == [REPO]
    assert [j.status for j in manager.jobs()] == ["cancelled", "done"]
    manager.forget(job_id)
    assert [j.id for j in manager.jobs()] == [job2.id]


def test_not_enough_disk_is_refused_before_downloading(manager, hub, monkeypatch):
    monkeypatch.setattr(manager, "free_disk_bytes", lambda: 1024 * 1024)
    check = manager.check_disk(REPO)
    assert not check.fits and "Not enough disk space" in check.message
    job = manager.wait(manager.start(REPO), timeout=20)
    assert job.status == "error"
    assert job.error.startswith(f"Not enough disk space for {REPO}")
    assert "1 MiB is free" in job.error
    assert not any("/resolve/" in r[1] for r in hub.requests), "a refused download fetched files"
    assert not manager.storage_folder(REPO).exists()


def test_bad_repo_id_raises_at_once(manager):
    with pytest.raises(ValueError, match="not a hub repo id"):
        manager.start("not a repo")
    with pytest.raises(KeyError):
        manager.job("nope")


def test_inspect_estimates_an_arbitrary_repo(manager, hub):
    entry = manager.inspect(REPO)
    assert entry.architecture == "Qwen3ForCausalLM" and entry.supported
    assert entry.num_hidden_layers == 2 and entry.num_key_value_heads == 1 and entry.head_dim == 32
    assert entry.download_bytes == expected_size(hub) and not entry.size_is_approximate
    assert manager.local_models(include_partial=True) == [], "inspect must not leave files in the cache"
    assert manager.inspect("qwen/qwen3-0.6b").repo_id == "Qwen/Qwen3-0.6B", "catalog repos need no hub call"


# ---- GGUF repos: one file of the repo ------------------------------------------------------------------------------


def test_a_gguf_download_fetches_only_the_chosen_file_and_loads_from_it(manager, hub, monkeypatch):
    from app import catalog
    from app.model_host import resolve_model

    size = GGUF_FILES[Q4]
    assert manager.repo_files_size(GGUF_REPO, Q4) == size
    check = manager.check_disk(GGUF_REPO, gguf_file=Q4)
    assert check.size_bytes == size and check.fits

    hub.throttle = 0.004
    job, samples = watch(manager, manager.start(GGUF_REPO, gguf_file=Q4))
    assert job.status == "done", job.error
    assert job.gguf_file == Q4 and job.bytes_total == job.bytes_done == size
    assert any(0 < s < size for s in samples), "no byte progress seen"
    fetched = {r[1].rsplit("/", 1)[-1] for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]}
    assert fetched == {Q4}, "only the chosen GGUF file is downloaded (not the other one, not params.json)"
    assert Path(job.path).name == Q4 and Path(job.path).read_bytes() == hub.repos[GGUF_REPO].files[Q4]
    assert not (Path(job.path).parent / Q8).exists()

    [model] = manager.local_models()
    assert model.repo_id == GGUF_REPO and model.complete and model.gguf_files == (Q4,)
    assert model.load_path == Path(job.path) and model.size_bytes >= size

    # Loading from the Models tab resolves to the local file: for a catalog entry by its gguf_file, and for
    # any other repo by the one GGUF its snapshot holds.
    downloaded = {m.repo_id: m.load_path for m in manager.local_models()}
    assert resolve_model(GGUF_REPO, downloaded) == (str(model.load_path), GGUF_REPO)
    assert resolve_model(f"{GGUF_REPO}/{Q4}", downloaded) == (str(model.load_path), GGUF_REPO)  # typed as a hub file
    with pytest.raises(RuntimeError, match=f"its file {Q8} is not downloaded yet"):
        resolve_model(f"{GGUF_REPO}/{Q8}", downloaded)
    entry = catalog.CatalogEntry(
        repo_id=GGUF_REPO,
        params=10**6,
        checkpoint_dtype="bfloat16",
        download_bytes=size,
        num_hidden_layers=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        gguf_file=Q4,
        gguf_type="Q4_K_M",
    )
    monkeypatch.setattr(catalog, "entry_for_repo", lambda repo_id: entry if repo_id == GGUF_REPO else None)
    assert resolve_model(GGUF_REPO, downloaded) == (str(model.load_path), GGUF_REPO)
    assert resolve_model(GGUF_REPO) == (f"{GGUF_REPO}/{Q4}", GGUF_REPO)  # the command line: the engine fetches it
    entry.gguf_file = Q8
    with pytest.raises(RuntimeError, match=f"its file {Q8} is not downloaded yet: press Download first"):
        resolve_model(GGUF_REPO, downloaded)

    assert manager.delete(GGUF_REPO) >= size
    assert manager.local_models(include_partial=True) == []


def test_a_second_gguf_file_of_the_same_repo_is_its_own_job(manager, hub):
    first = manager.wait(manager.start(GGUF_REPO, gguf_file=Q4), timeout=20)
    assert first.status == "done", first.error
    second = manager.wait(manager.start(GGUF_REPO, gguf_file=Q8), timeout=20)
    assert second.status == "done" and second.bytes_total == GGUF_FILES[Q8]
    [model] = manager.local_models()
    assert model.gguf_files == (Q4, Q8) and model.load_path == model.path  # two: the user names the one to load


def test_a_gguf_file_the_repo_lacks_ends_the_job_with_the_files_it_has(manager, hub):
    job = manager.wait(manager.start(GGUF_REPO, gguf_file="tiny-chat-Q2_K.gguf"), timeout=20)
    assert job.status == "error"
    assert job.error == (
        f"{GGUF_REPO} has no file tiny-chat-Q2_K.gguf. It holds {Q4}, {Q8}. Pick one of those, "
        "or check the name on the repo's Hugging Face page."
    )
    assert not any("/resolve/" in r[1] for r in hub.requests)
    with pytest.raises(ValueError, match="not a GGUF file name"):
        manager.start(GGUF_REPO, gguf_file="model.safetensors")


def test_a_cancelled_gguf_download_is_partial_and_resumes(manager, hub):
    hub.throttle = 0.05
    job_id = manager.start(GGUF_REPO, gguf_file=Q4)

    def cancel_once_flowing(job):
        if job.bytes_done > 100 * 1024 and not job.cancel_requested:
            manager.cancel(job_id)

    job, _ = watch(manager, job_id, on_sample=cancel_once_flowing)
    assert job.status == "cancelled"
    # Not a model; huggingface_hub 2.x drops the file in flight, so there may be nothing left to list at all.
    assert manager.local_models() == []
    assert not any(m.complete for m in manager.local_models(include_partial=True))
    hub.throttle = 0.0
    again = manager.wait(manager.start(GGUF_REPO, gguf_file=Q4), timeout=20)
    assert again.status == "done" and [m.gguf_files for m in manager.local_models()] == [(Q4,)]


def cache_files(manager, repo_id: str) -> list[Path]:
    """Every file the cache holds for `repo_id`, partial downloads (.incomplete) included."""
    folder = manager.storage_folder(repo_id)
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def test_deleting_a_repo_mid_download_stops_its_job_and_leaves_no_partial_file(manager, hub):
    hub.throttle = 0.05  # about 6 s for the weights: the delete lands mid-file
    job_id = manager.start(REPO)
    seen = []

    def delete_once_weights_flow(job):
        if not seen and job.bytes_done > 300 * 1024:
            before = cache_files(manager, REPO)
            # A partial blob that this download did not start (a crashed process's, or an older
            # huggingface_hub's that cancelling leaves behind): the delete must remove it too.
            stale = manager.storage_folder(REPO) / "blobs" / "0123abcd.incomplete"
            stale.write_bytes(b"\0" * 1024)
            assert manager.delete(REPO) > 0  # the Models tab's Delete while the download runs
            # Once delete() returns, the job's thread is over: nothing writes into the cache any more.
            seen.append((before, manager._jobs[job_id].thread.is_alive(), manager.job(job_id).active))

    job, _ = watch(manager, job_id, on_sample=delete_once_weights_flow)
    assert seen, "the download finished before it could be deleted"
    before, alive, active = seen[0]
    assert any(p.name.endswith(".incomplete") for p in before), before  # it was mid-file
    assert not alive and not active
    assert job.status == "cancelled" and job.path is None
    assert cache_files(manager, REPO) == [] and not manager.storage_folder(REPO).exists()
    assert manager.local_models(include_partial=True) == []


def test_cancelling_a_job_before_it_starts_downloads_nothing(manager, hub, monkeypatch):
    started, release = threading.Event(), threading.Event()
    list_files = manager._repo_files

    def held_repo_files(*args, **kwargs):  # the job's first call to the hub, held until the test has cancelled
        started.set()
        assert release.wait(60), "the test never released the job"
        return list_files(*args, **kwargs)

    monkeypatch.setattr(manager, "_repo_files", held_repo_files)
    job_id = manager.start(REPO)
    assert started.wait(60)
    assert manager.job(job_id).status == "queued"
    assert manager.cancel(job_id)
    release.set()
    job = manager.wait(job_id, timeout=120)
    assert not manager._jobs[job_id].thread.is_alive()
    assert job.status == "cancelled" and job.cancel_requested and job.path is None
    assert not any("/resolve/" in r[1] for r in hub.requests), "a cancelled job fetched files"
    assert cache_files(manager, REPO) == []
    assert not manager.cancel(job_id), "cancelling a finished job is a no-op"


def test_a_failed_download_row_offers_retry_and_dismiss_and_both_work(manager, hub, monkeypatch):
    """A failed download's row had no button at all: it stayed, unretryable, until Pagoda restarted."""
    from app.page.download_rows import job_action, listing

    disk = {"free": 1024 * 1024}
    monkeypatch.setattr(manager, "free_disk_bytes", lambda: disk["free"])
    failed = manager.wait(manager.start(REPO), timeout=20)
    assert failed.status == "error"
    [(row_id, line, actions)] = listing(manager)["jobs"]
    assert row_id == failed.id and "Not enough disk space" in line and actions == ("Retry", "Dismiss")

    disk["free"] = 100 * 1024**3  # the user made room
    [(retried_id, _, actions)] = job_action(manager, failed.id, "Retry")["jobs"]  # one row: the new job in its place
    assert retried_id != failed.id
    assert manager.wait(retried_id, timeout=60).status == "done"
    assert [m.repo_id for m in manager.local_models()] == [REPO]
    [(_, _, actions)] = listing(manager)["jobs"]
    assert actions == ("Dismiss",)
    assert job_action(manager, retried_id, "Dismiss")["jobs"] == []
