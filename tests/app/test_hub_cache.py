"""The hub cache listing on a cache laid out by hand (no hub, no download): completeness, sizes, delete."""

import json
from pathlib import Path

from app.hub_cache import delete_repo, folder_bytes, local_models, repo_folder, snapshot_complete

CONFIG = json.dumps({"architectures": ["Qwen3ForCausalLM"]}).encode()


def add_snapshot(cache: Path, repo_id: str, files: dict[str, bytes], commit: str = "c0ffee") -> Path:
    """A repo the way huggingface_hub stores it: blobs, a snapshot of symlinks to them, refs/main."""
    repo = repo_folder(cache, repo_id)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for i, (name, data) in enumerate(files.items()):
        blob = repo / "blobs" / f"blob{i}"
        blob.write_bytes(data)
        (snapshot / name).symlink_to(blob)
    return snapshot


def test_complete_partial_and_snapshotless_repos(tmp_path):
    cache = tmp_path / "hub"
    done = add_snapshot(cache, "org/done", {"config.json": CONFIG, "model.safetensors": b"w" * 1000})
    half = add_snapshot(
        cache,
        "org/half",
        {
            "config.json": CONFIG,
            "model-1.safetensors": b"w" * 10,
            "model.safetensors.index.json": json.dumps(
                {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
            ).encode(),
        },
        commit="beef",
    )  # delete_revisions() matches commit hashes across repos: keep them distinct
    cut = repo_folder(cache, "org/cut") / "blobs"  # cancelled before its first file finished: no snapshot yet
    cut.mkdir(parents=True)
    (cut / "abc.incomplete").write_bytes(b"x" * 300)

    assert snapshot_complete(done, repo_folder(cache, "org/done"))
    assert not snapshot_complete(half, repo_folder(cache, "org/half")), "a shard of the index is missing"
    # blobs and refs/main; the snapshot's symlinks to the blobs add nothing
    assert folder_bytes(repo_folder(cache, "org/done")) == len(CONFIG) + 1000 + len("c0ffee")

    [model] = local_models(cache)
    assert (model.repo_id, model.path, model.complete, model.revision) == ("org/done", done, True, "c0ffee")
    assert model.architectures == ("Qwen3ForCausalLM",) and model.size_bytes == len(CONFIG) + 1000
    listed = [(m.repo_id, m.complete) for m in local_models(cache, include_partial=True)]
    assert listed == [("org/cut", False), ("org/done", True), ("org/half", False)]
    assert [(m.repo_id, m.complete) for m in local_models(cache, True, busy={"org/done"})] == [
        ("org/cut", False),
        ("org/done", False),
        ("org/half", False),
    ], "a repo still downloading is partial"

    assert delete_repo(cache, "org/cut") == 300
    assert delete_repo(cache, "org/done") >= 1000
    assert delete_repo(cache, "org/done") == 0
    assert [m.repo_id for m in local_models(cache, include_partial=True)] == ["org/half"]


def test_an_absent_cache_is_empty(tmp_path):
    assert local_models(tmp_path / "nowhere", include_partial=True) == []
    assert delete_repo(tmp_path / "nowhere", "org/none") == 0


def test_a_gguf_snapshot_is_a_model_that_loads_from_its_file(tmp_path):
    cache = tmp_path / "hub"
    one = add_snapshot(cache, "org/one-GGUF", {"one-Q4_K_M.gguf": b"GGUF" + b"w" * 100})
    repo = repo_folder(cache, "org/nested-GGUF")
    nested = repo / "snapshots" / "f00d" / "Q4"  # a repo that keeps each quantization in a folder
    nested.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("f00d")
    (repo / "blobs" / "b").write_bytes(b"GGUF")
    (nested / "m-Q4_K_M.gguf").symlink_to(repo / "blobs" / "b")

    assert snapshot_complete(one, repo_folder(cache, "org/one-GGUF"))
    models = {m.repo_id: m for m in local_models(cache)}
    assert models["org/one-GGUF"].gguf_files == ("one-Q4_K_M.gguf",)
    assert models["org/one-GGUF"].load_path == one / "one-Q4_K_M.gguf"
    assert models["org/nested-GGUF"].load_path == nested / "m-Q4_K_M.gguf"
    safetensors = add_snapshot(cache, "org/done", {"config.json": CONFIG, "model.safetensors": b"w"}, commit="abc")
    assert {m.repo_id: m for m in local_models(cache)}["org/done"].load_path == safetensors  # no GGUF: the folder
