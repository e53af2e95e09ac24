"""The backend that answers the chats: the embedded engine (one EngineThread every chat shares) or a
remote OpenAI-compatible server. One at a time, swapped safely.

Loading happens in the background and reports progress. A load or a connect that fails leaves the
previous backend serving, and says why; except that a model on the GPU is unloaded before another
loads there, since one GPU seldom holds two. Loading a model disconnects a server, and connecting to
a server unloads the model.
"""

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from app.backend import Backend, LocalBackend
from app.remote import RemoteBackend, RemoteError, connect
from engine import LLM, EngineThread
from engine.spec_decode.config import SpeculativeConfig
from entrypoints.cli import default_model

log = logging.getLogger("pagoda")


@dataclass
class LoadState:
    status: str = "idle"  # idle, loading, ready, error
    message: str = "No model loaded."
    model: str | None = None
    settings: dict = field(default_factory=dict)
    started: float = 0.0
    label: str = ""  # the model's short name, as messages give it
    note: str = ""  # said after the message until the next load (why this model loaded at start)


def looks_like_a_path(choice: str) -> bool:
    """A local path, not a hub repo id ("owner/name"): absolute, home- or dot-relative, or with a
    Windows drive or backslash."""
    return (
        choice.startswith(("/", "~", ".", "\\"))
        or "\\" in choice
        or (len(choice) > 2 and choice[1] == ":" and choice[2] in "/\\")
    )


def resolve_model(choice: str | None, downloaded: dict[str, Path] | None = None) -> tuple[str, str]:
    """(what to load, its short name) for a model the user chose: nothing or the bundled model's repo id
    (the bundled model, prepared offline), a local folder or .gguf file, or a hub repo id. With `downloaded`
    (repo id -> snapshot folder or GGUF file, the Models tab's list), a repo id must be downloaded already;
    without it (the command line), the engine downloads it. A catalog GGUF repo resolves to its one file."""
    from app.catalog import entry_for_repo

    entry = entry_for_repo(choice or "")
    if not choice or (entry is not None and entry.bundled):
        return default_model(None)
    local = Path(choice).expanduser()
    if local.is_dir() or (local.is_file() and local.suffix.lower() == ".gguf"):
        return str(local), local.resolve().name
    gguf = entry.gguf_file if entry is not None and entry.is_gguf else ""
    if downloaded is None:
        return (f"{entry.repo_id}/{gguf}" if gguf else choice), choice
    parts = choice.split("/")
    if entry is None and len(parts) >= 3 and choice.lower().endswith(".gguf"):  # a hub file: owner/repo/file.gguf
        choice, gguf = "/".join(parts[:2]), "/".join(parts[2:])
    if choice not in downloaded:
        if looks_like_a_path(choice):
            raise RuntimeError(f"There is no model folder or .gguf file at {local}: check the path.")
        raise RuntimeError(f"{choice} is not downloaded yet: press Download first.")
    target = Path(downloaded[choice])
    if gguf:
        snapshot = target if target.is_dir() else target.parent
        target = snapshot / gguf
        if not target.is_file():
            raise RuntimeError(f"{choice}: its file {gguf} is not downloaded yet: press Download first.")
    return str(target), choice


class ModelHost:
    """Holds the one Backend that answers the chats, and swaps it. `remember(choice, settings)` is told of each
    load that succeeds with a `remember_as` (the Models tab's), so that the next start can load it again."""

    def __init__(self, remember: Callable[[str, dict], None] | None = None):
        self.backend: Backend | None = None
        self.state = LoadState()
        self.remember = remember
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        return self.backend is not None

    @property
    def label(self) -> str:
        """The serving backend's name for the header; "" when none serves."""
        return self.backend.label if self.backend is not None else ""

    @property
    def engine(self) -> EngineThread | None:
        """The embedded engine while a local model serves: what the /v1 API answers with."""
        return self.backend.engine if isinstance(self.backend, LocalBackend) else None

    def status_message(self) -> str:
        """The status line. While a model loads it counts the seconds: a first load on a GPU also
        compiles kernels, a minute or more of a line that would otherwise not change."""
        state, engine = self.state, self.engine
        if state.status == "ready" and engine is not None and engine.error is not None:
            return (
                f"{self.label} stopped: the engine failed ({type(engine.error).__name__}: {engine.error}). "
                "Load the model again from the Models tab."
            )
        note = f" {state.note}" if state.note else ""
        if state.status == "loading" and state.started:
            return f"{state.message} {time.time() - state.started:.0f} s so far.{note}"
        return state.message + note

    def _serving(self) -> str:
        return f" {self.label} keeps serving." if self.ready else ""

    def load_default(self, model: str | None, note: str = "", **settings) -> None:
        """Start-up: load the model given on the command line, else the bundled one, in the background."""
        source, label = resolve_model(model)
        self.load(source, label=label, note=note, **settings)

    def load(
        self,
        model: str,
        label: str | None = None,
        wait: bool = False,
        remember_as: str | None = None,
        note: str = "",
        on_failure: Callable[[str], None] | None = None,
        **settings,
    ) -> None:
        """Load `model` with engine settings; the current backend keeps serving until it is ready. Once it is,
        `remember_as` (the user's choice: a repo id or a path) goes to `remember`; `note` follows the status;
        `on_failure(message)` is called, on the loading thread, when the load fails."""
        with self._lock:
            if self.state.status == "loading":
                raise RuntimeError(f"{self.state.model} is still loading; wait for it to finish")
            self.state = LoadState(
                "loading", f"Loading {label or model}…", model, settings, time.time(), label or model, note
            )
        thread = threading.Thread(
            target=self._load, args=(model, label, settings, remember_as, on_failure), name="pagoda-load", daemon=True
        )
        thread.start()
        if wait:
            thread.join()
            if self.state.status == "error":
                raise RuntimeError(self.state.message)

    def _must_unload_first(self, settings: dict) -> bool:
        """Whether the model serving now must go before another loads: one GPU seldom holds two (an
        8 GB laptop card rarely holds one and a half). On the CPU the old one serves until the new is ready."""
        return (
            self.engine is not None
            and self.engine.device.startswith("cuda")
            and settings.get("device", "auto") != "cpu"
        )

    def _load(
        self,
        model: str,
        label: str | None,
        settings: dict,
        remember_as: str | None = None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        unloaded = ""
        if self._must_unload_first(settings):
            with self._lock:
                old, self.backend = self.backend, None
                unloaded = old.label
                self.state.message = f"Loading {label or model}… ({unloaded} was unloaded to free the GPU.)"
            old.close()  # its replies still streaming end as stopped; its memory goes back
        try:
            # Built in this thread, which ends once the load does: see EngineThread's note on OpenMP's pools.
            engine = EngineThread(LLM(model, runner="generate", **settings))  # an embedding model is refused
        except Exception as e:  # any failure: say it, keep the previous backend
            log.exception("loading %s failed", model)
            after = (
                f" {unloaded} was unloaded to free the GPU; load it again from the Models tab."
                if unloaded
                else self._serving()
            )
            self.state = LoadState(
                "error", f"Could not load {label or model}: {e}.{after}", model, settings, note=self.state.note
            )
            if on_failure is not None:
                on_failure(self.state.message)
            return
        old, self.backend = self.backend, LocalBackend(engine, label or model)
        s = engine.stats()
        took = time.time() - self.state.started
        weights = f", {s.quantization} weights" if s.quantization != "none" else ""
        weights += f", {s.kv_cache_dtype} KV cache" if s.kv_cache_dtype != "auto" else ""
        if s.speculative_method == "draft":
            draft = Path(SpeculativeConfig.parse(settings["speculative_config"]).model).name
            weights += f", speculative decoding with {draft} as draft"
        elif s.speculative_method:
            weights += f", {s.speculative_method} speculative decoding"
        self.state = LoadState(
            "ready",
            f"{self.label} is ready on {s.device} ({s.dtype}{weights}, context "
            f"{s.max_model_len:,} tokens, {s.num_blocks:,} KV blocks) after {took:.0f} s.",
            model,
            settings,
            note=self.state.note,
        )
        if old is not None:
            old.close()
        if remember_as is not None and self.remember is not None:
            try:
                self.remember(remember_as, settings)
            except Exception:  # noqa: BLE001 - the model serves all the same; only the next start forgets it
                log.exception("could not remember %s as the model to load at start", remember_as)

    def connect(self, base_url: str, api_key: str | None = None, model: str | None = None) -> RemoteBackend:
        """Serve the chats from an OpenAI-compatible server (returned; the status says it serves). Raises
        RemoteError, and then the previous backend keeps serving and the status says so."""
        with self._lock:
            if self.state.status == "loading":
                raise RemoteError(f"{self.state.model} is still loading; wait for it to finish")
        try:
            remote = connect(base_url, api_key, model)
        except RemoteError as e:
            self.state = LoadState("error", f"Could not connect: {e}{self._serving()}", model, {"base_url": base_url})
            raise RemoteError(self.state.message, e.status) from None
        with self._lock:
            old, self.backend = self.backend, remote
            limit = f", context {remote.max_model_len:,} tokens" if remote.max_model_len else ""
            self.state = LoadState(
                "ready",
                f"Connected to {remote.client.url}: {remote.model} serves the chats"
                f"{limit}. The server applies its own chat template.",
                remote.model,
                {"base_url": remote.client.url},
            )
        if old is not None:
            old.close()  # its replies still streaming end as stopped, not hanging
        return remote

    def disconnect(self) -> None:
        if isinstance(self.backend, RemoteBackend):
            self.unload()

    def unload(self) -> None:
        with self._lock:
            old, self.backend = self.backend, None
            self.state = LoadState("idle", "No model loaded.")
        if old is not None:
            old.close()
