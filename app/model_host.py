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
from dataclasses import dataclass, field

from engine import LLM, EngineThread

from app.remote import RemoteBackend, RemoteError, connect

log = logging.getLogger("pagoda")


@dataclass
class LoadState:
    status: str = "idle"  # idle, loading, ready, error
    message: str = "No model loaded."
    model: str | None = None
    settings: dict = field(default_factory=dict)
    started: float = 0.0
    label: str = ""  # the model's short name, as messages give it


class ModelHost:
    def __init__(self):
        self.engine: EngineThread | None = None  # the embedded engine, when it serves
        self.remote: RemoteBackend | None = None  # the remote server, when it serves
        self.state = LoadState()
        self.label = ""  # a short name for the header
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        return self.engine is not None or self.remote is not None

    @property
    def kind(self) -> str | None:
        """Which backend serves: "local", "remote", or None."""
        return "remote" if self.remote is not None else "local" if self.engine is not None else None

    def status_message(self) -> str:
        """The status line. While a model loads it counts the seconds: a first load on a GPU also
        compiles kernels, a minute or more of a line that would otherwise not change."""
        state = self.state
        if state.status == "loading" and state.started:
            return f"{state.message} {time.time() - state.started:.0f} s so far."
        return state.message

    def _serving(self) -> str:
        return f" {self.label} keeps serving." if self.ready else ""

    def load(self, model: str, label: str | None = None, wait: bool = False, **settings) -> None:
        """Load `model` with engine settings; the current backend keeps serving until it is ready."""
        with self._lock:
            if self.state.status == "loading":
                raise RuntimeError(f"{self.state.model} is still loading; wait for it to finish")
            self.state = LoadState("loading", f"Loading {label or model}…", model, settings, time.time(), label or model)
        thread = threading.Thread(target=self._load, args=(model, label, settings), name="pagoda-load", daemon=True)
        thread.start()
        if wait:
            thread.join()
            if self.state.status == "error":
                raise RuntimeError(self.state.message)

    def _must_unload_first(self, settings: dict) -> bool:
        """Whether the model serving now must go before another loads: one GPU seldom holds two (an
        8 GB laptop card rarely holds one and a half). On the CPU the old one serves until the new is ready."""
        return (self.engine is not None and self.engine.engine.device.type == "cuda"
                and settings.get("device", "auto") != "cpu")

    def _load(self, model: str, label: str | None, settings: dict) -> None:
        unloaded = ""
        if self._must_unload_first(settings):
            with self._lock:
                old_engine, self.engine = self.engine, None
                unloaded, self.label = self.label, ""
                self.state.message = f"Loading {label or model}… ({unloaded} was unloaded to free the GPU.)"
            _retire(old_engine, None)  # its replies still streaming end as stopped; its memory goes back
        try:
            engine = EngineThread(LLM(model, **settings))
        except Exception as e:  # any failure: say it, keep the previous backend
            log.exception("loading %s failed", model)
            after = (f" {unloaded} was unloaded to free the GPU; load it again from the Models tab." if unloaded
                     else self._serving())
            self.state = LoadState("error", f"Could not load {label or model}: {e}.{after}", model, settings)
            return
        old_engine, old_remote = self.engine, self.remote
        self.engine, self.remote = engine, None
        self.label = label or model
        s = engine.stats()
        took = time.time() - self.state.started
        self.state = LoadState("ready", f"{self.label} is ready on {s['device']} ({s['dtype']}, context {s['max_model_len']:,} "
                                        f"tokens, {s['num_blocks']:,} KV blocks) after {took:.0f} s.", model, settings)
        _retire(old_engine, old_remote)

    def connect(self, base_url: str, api_key: str | None = None, model: str | None = None) -> str:
        """Serve the chats from an OpenAI-compatible server. Returns the status message; raises RemoteError
        (the previous backend keeps serving, and the status says so)."""
        with self._lock:
            if self.state.status == "loading":
                raise RemoteError(f"{self.state.model} is still loading; wait for it to finish")
        try:
            remote = connect(base_url, api_key, model)
        except RemoteError as e:
            self.state = LoadState("error", f"Could not connect: {e}{self._serving()}", model,
                                   {"base_url": base_url})
            raise RemoteError(self.state.message, e.status) from None
        with self._lock:
            old_engine, old_remote = self.engine, self.remote
            self.engine, self.remote = None, remote
            self.label = f"Remote: {remote.label}"
            limit = f", context {remote.max_model_len:,} tokens" if remote.max_model_len else ""
            self.state = LoadState("ready", f"Connected to {remote.client.url}: {remote.model} serves the chats"
                                            f"{limit}. The server applies its own chat template.", remote.model,
                                   {"base_url": remote.client.url})
        _retire(old_engine, None if old_remote is remote else old_remote)
        return self.state.message

    def disconnect(self) -> None:
        if self.remote is not None:
            self.unload()

    def unload(self) -> None:
        with self._lock:
            old_engine, self.engine = self.engine, None
            old_remote, self.remote = self.remote, None
            self.label = ""
            self.state = LoadState("idle", "No model loaded.")
        _retire(old_engine, old_remote)

    def device_label(self) -> str:
        if self.remote is not None:
            return "remote server"
        if self.engine is None:
            return "no model"
        s = self.engine.engine.stats()
        if s["device"].startswith("cuda"):
            import torch

            return torch.cuda.get_device_name()
        return "CPU"


def _retire(engine: EngineThread | None, remote: RemoteBackend | None) -> None:
    """Stop a backend that no longer serves. Its replies still streaming end as stopped, not hanging."""
    if engine is not None:
        engine.shutdown()  # aborts what is still streaming, then releases the engine's memory
    if remote is not None:
        remote.close()
