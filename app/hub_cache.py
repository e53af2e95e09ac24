"""The local Hugging Face hub cache: which models it holds, whether each snapshot is complete, sizes, and delete.

The cache is the standard HF layout (`models--org--name/{blobs,snapshots,refs}`), so a model listed here is the
same files `LLM("org/name")` would load. A download that was cancelled or failed leaves its finished files in the
cache (the next download reuses them) but the snapshot lacks weights: `local_models()` lists only complete snapshots
(`include_partial=True` shows the rest), and `delete_repo()` removes partial repos too.

A GGUF repo is downloaded one file at a time (the quantization the user picked): its snapshot holds that file and
no config.json. huggingface_hub links a file into the snapshot only once it is whole, so a snapshot with a .gguf
in it is a complete model.

These functions know nothing about running downloads; `app.download_jobs.DownloadManager` wraps them so that a repo
being downloaded counts as partial and is cancelled before it is deleted.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from engine.loader import HUB_PATTERNS

__all__ = [
    "LocalModel",
    "default_cache_path",
    "repo_folder",
    "local_models",
    "delete_repo",
    "snapshot_complete",
    "gguf_files",
    "folder_bytes",
]


@dataclass
class LocalModel:
    repo_id: str
    path: Path  # the snapshot folder (what LLM(...) takes); the repo folder if no snapshot yet
    size_bytes: int  # on disk, all revisions and partial files of the repo
    complete: bool = True  # False: an interrupted download (listed only with include_partial=True)
    revision: str = ""  # commit hash of the snapshot
    architectures: tuple[str, ...] = ()
    gguf_files: tuple[str, ...] = ()  # GGUF files in the snapshot, relative to it (a GGUF repo's downloads)

    @property
    def load_path(self) -> Path:
        """What LLM(...) takes: the snapshot folder, or its GGUF file when it holds exactly one and no
        Hugging Face model (config.json) beside it."""
        if len(self.gguf_files) == 1 and not (self.path / "config.json").is_file():
            return self.path / self.gguf_files[0]
        return self.path


def default_cache_path() -> Path:
    """The cache huggingface_hub uses (HF_HUB_CACHE, HF_HOME, or ~/.cache/huggingface/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def repo_folder(cache_path: Path, repo_id: str) -> Path:
    """The folder that holds every revision and blob of a model repo."""
    return cache_path / ("models--" + repo_id.replace("/", "--"))


def local_models(cache_path: Path, include_partial: bool = False, busy: Collection[str] = ()) -> list[LocalModel]:
    """Models in the cache that have a config.json or a GGUF file, newest snapshot per repo, sorted by repo id.

    An interrupted download is listed only with `include_partial=True` (with complete=False); so is a repo in
    `busy`, because its files are still arriving."""
    from huggingface_hub import CacheNotFound, scan_cache_dir

    try:
        info = scan_cache_dir(cache_path)
    except (CacheNotFound, FileNotFoundError):
        return []
    models = []
    for repo in info.repos:
        if repo.repo_type != "model" or not repo.revisions:
            continue
        revision = _newest_revision(repo)
        path = Path(revision.snapshot_path)
        ggufs = gguf_files(path)
        if not (path / "config.json").is_file() and not ggufs:
            continue
        complete = repo.repo_id not in busy and snapshot_complete(path, Path(repo.repo_path))
        if not complete and not include_partial:
            continue
        models.append(
            LocalModel(
                repo.repo_id, path, int(repo.size_on_disk), complete, revision.commit_hash, _architectures(path), ggufs
            )
        )
    if include_partial:  # repos cut off before their first file finished have no snapshot to scan
        listed = {m.repo_id for m in models}
        for folder in sorted(cache_path.glob("models--*--*")):
            repo_id = folder.name[len("models--") :].replace("--", "/", 1)
            if repo_id not in listed and not (folder / "snapshots").is_dir() and (folder / "blobs").is_dir():
                models.append(LocalModel(repo_id, folder, folder_bytes(folder), False))
    return sorted(models, key=lambda m: m.repo_id.lower())


def delete_repo(cache_path: Path, repo_id: str) -> int:
    """Remove a repo from the cache (all revisions and partial files) and return the bytes freed; 0 when absent.

    The caller makes sure nothing is still writing into it."""
    from huggingface_hub import CacheNotFound, scan_cache_dir

    freed = 0
    try:
        info = scan_cache_dir(cache_path)
    except (CacheNotFound, FileNotFoundError):
        info = None
    if info is not None:
        for repo in info.repos:
            if repo.repo_type == "model" and repo.repo_id == repo_id and repo.revisions:
                strategy = info.delete_revisions(*[r.commit_hash for r in repo.revisions])
                freed = int(strategy.expected_freed_size)
                strategy.execute()
    folder = repo_folder(cache_path, repo_id)
    if folder.is_dir():  # partial downloads without a snapshot are invisible to scan_cache_dir
        freed += folder_bytes(folder)
        shutil.rmtree(folder, ignore_errors=True)
    return freed


def snapshot_complete(path: Path, storage: Path | None) -> bool:
    """Whether a snapshot folder holds a whole model: a GGUF file, or config.json, every weight shard, and, when
    huggingface_hub cached the commit's file listing (trees/<commit>.json, 2.x), every listed file the engine
    patterns select.

    `storage` is the repo folder (see `repo_folder`); None skips the file-listing check."""
    if not any(path.glob("*.safetensors")) and gguf_files(path):
        return True
    if not (path / "config.json").is_file():
        return False
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return False
        if not shards or not all((path / s).is_file() for s in shards):
            return False
    elif not any(p.is_file() for p in path.glob("*.safetensors")):
        return False
    tree = (storage / "trees" / f"{path.name}.json") if storage is not None else None
    if tree is not None and tree.is_file():
        try:
            from huggingface_hub.utils import filter_repo_objects

            listed = json.loads(tree.read_text(encoding="utf-8")).get("files") or {}
            wanted = filter_repo_objects(list(listed), allow_patterns=HUB_PATTERNS)
            return all((path / name).is_file() for name in wanted)
        except (OSError, ValueError, AttributeError):
            pass
    return True


def gguf_files(path: Path) -> tuple[str, ...]:
    """The GGUF files under a snapshot folder (they may sit in subfolders of the repo), relative to it."""
    if not path.is_dir():
        return ()
    return tuple(sorted(str(p.relative_to(path)) for p in path.rglob("*.gguf") if p.is_file()))


def folder_bytes(folder: Path) -> int:
    """Bytes of the regular files under `folder`; snapshot symlinks are skipped so that blobs count once."""
    total = 0
    try:
        for root, _dirs, names in os.walk(folder):
            for name in names:
                try:
                    st = os.lstat(os.path.join(root, name))
                except OSError:
                    continue
                if not os.path.islink(os.path.join(root, name)):
                    total += st.st_size
    except OSError:
        pass
    return total


def _newest_revision(repo):
    """The revision `main` points at when there is one, else the most recently modified."""
    for revision in repo.revisions:
        if "main" in revision.refs:
            return revision
    return max(repo.revisions, key=lambda r: r.last_modified)


def _architectures(path: Path) -> tuple[str, ...]:
    try:
        return tuple(json.loads((path / "config.json").read_text(encoding="utf-8")).get("architectures") or ())
    except (OSError, ValueError, AttributeError):
        return ()
