"""A tiny local stand-in for the Hugging Face hub, enough for huggingface_hub's model_info and snapshot_download.

It serves, on 127.0.0.1 and a free port:
  GET  /api/models/{repo}[/revision/{rev}]       model info with per-file sizes, blob ids and LFS sha256
  GET  /api/models/{repo}/tree/{rev}              the file listing (recursive)
  HEAD|GET /{repo}/resolve/{rev}/{path}           file metadata (X-Repo-Commit, ETag / X-Linked-Etag,
                                                  Content-Length) and the bytes, with Range support
Unknown repos answer 404 with X-Error-Code: RepoNotFound; gated repos answer 401 with X-Error-Code: GatedRepo for
their files. GETs of big files are streamed in chunks with an optional sleep between them (`throttle`), so a
download can be watched and cancelled.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_THRESHOLD = 1024 * 1024  # files from this size are served as LFS files, like the hub does for weights


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, bytes]
    sha: str
    gated: bool = False
    blob_ids: dict[str, str] = field(default_factory=dict)
    sha256: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        for name, data in self.files.items():
            self.blob_ids[name] = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            if len(data) >= LFS_THRESHOLD:
                self.sha256[name] = hashlib.sha256(data).hexdigest()

    def entry(self, name: str) -> dict:
        data = self.files[name]
        info = {"type": "file", "path": name, "size": len(data), "oid": self.blob_ids[name]}
        if name in self.sha256:
            info["lfs"] = {"oid": self.sha256[name], "size": len(data), "pointerSize": 134}
        return info

    def sibling(self, name: str) -> dict:
        data = self.files[name]
        info = {"rfilename": name, "size": len(data), "blobId": self.blob_ids[name]}
        if name in self.sha256:
            info["lfs"] = {"sha256": self.sha256[name], "size": len(data), "pointerSize": 134}
        return info


class FakeHub:
    """Start with `with FakeHub() as hub:` or start()/stop(); `hub.url` is the endpoint to pass on."""

    def __init__(self, chunk_size: int = 64 * 1024, throttle: float = 0.0):
        self.repos: dict[str, FakeRepo] = {}
        self.chunk_size = chunk_size
        self.throttle = throttle  # seconds to sleep after each streamed chunk of an LFS file
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def add_repo(self, repo_id: str, files: dict[str, bytes], gated: bool = False) -> FakeRepo:
        sha = hashlib.sha1(
            repo_id.encode() + b"".join(sorted(hashlib.sha1(v).digest() for v in files.values()))
        ).hexdigest()
        repo = FakeRepo(repo_id, dict(files), sha, gated)
        self.repos[repo_id] = repo
        return repo

    @property
    def url(self) -> str:
        assert self._server is not None, "start the fake hub first"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "FakeHub":
        hub = self

        class Handler(_Handler):
            fake = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "FakeHub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+?)(?:/revision/(?P<rev>[^/]+))?$")
_TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$")


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def do_HEAD(self) -> None:
        self._handle(head=True)

    def do_GET(self) -> None:
        self._handle(head=False)

    # -- routing --

    def _handle(self, head: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.fake.requests.append((self.command, path, self.headers.get("Range")))
        try:
            if m := _TREE.match(path):
                repo = self._repo(m["repo"], m["rev"])
                if repo:
                    self._json([repo.entry(n) for n in sorted(repo.files)], head)
            elif m := _INFO.match(path):
                repo = self._repo(m["repo"], m["rev"])
                if repo:
                    self._json(
                        {
                            "_id": repo.sha[:24],
                            "id": repo.repo_id,
                            "modelId": repo.repo_id,
                            "sha": repo.sha,
                            "private": False,
                            "gated": "manual" if repo.gated else False,
                            "disabled": False,
                            "downloads": 0,
                            "likes": 0,
                            "tags": [],
                            "lastModified": "2025-01-01T00:00:00.000Z",
                            "createdAt": "2025-01-01T00:00:00.000Z",
                            "siblings": [repo.sibling(n) for n in sorted(repo.files)],
                        },
                        head,
                    )
            elif m := _RESOLVE.match(path):
                repo = self._repo(m["repo"], m["rev"])
                if repo:
                    self._file(repo, m["path"], head)
            else:
                self._error(404, "RepoNotFound", "Not found")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away (a cancelled download)

    def _repo(self, repo_id: str, rev: str | None) -> FakeRepo | None:
        repo = self.fake.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        if rev not in (None, "main", repo.sha):
            self._error(404, "RevisionNotFound", "Invalid rev id: " + rev)
            return None
        return repo

    # -- responses --

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj, head: bool) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _file(self, repo: FakeRepo, name: str, head: bool) -> None:
        if repo.gated:
            self._error(
                401,
                "GatedRepo",
                "Access to model %s is restricted. You must have access to it and be "
                "authenticated to access it. Please log in." % repo.repo_id,
            )
            return
        if name not in repo.files:
            self._error(404, "EntryNotFound", f"{name} does not exist on main")
            return
        data = repo.files[name]
        start = 0
        rng = self.headers.get("Range")
        if rng and (m := re.match(r"bytes=(\d+)-$", rng.strip())) and int(m[1]) < len(data):
            start = int(m[1])
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", repo.sha)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        if name in repo.sha256:  # LFS: the hub gives the sha256 as the linked ETag and the real size
            self.send_header("X-Linked-Etag", f'"{repo.sha256[name]}"')
            self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("ETag", f'"{repo.sha256[name]}"')
        else:
            self.send_header("ETag", f'"{repo.blob_ids[name]}"')
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        if head:
            return
        slow = name in repo.sha256
        view = memoryview(data)[start:]
        for i in range(0, len(view), self.fake.chunk_size):
            self.wfile.write(view[i : i + self.fake.chunk_size])
            if slow and self.fake.throttle:
                self.wfile.flush()
                time.sleep(self.fake.throttle)
