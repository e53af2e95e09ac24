"""The loaded model: one EngineThread that every chat shares, swapped safely on load and unload.

Loading happens in the background and reports progress. A load that fails leaves the previous
model serving, and says why.
"""
import logging
import threading
import time
from dataclasses import dataclass, field

from engine import LLM, EngineThread

log = logging.getLogger("pagoda")


@dataclass
class LoadState:
    status: str = "idle"  # idle, loading, ready, error
    message: str = "No model loaded."
    model: str | None = None
    settings: dict = field(default_factory=dict)
    started: float = 0.0


class ModelHost:
    def __init__(self):
        self.engine: EngineThread | None = None
        self.state = LoadState()
        self.label = ""  # a short name for the header
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        return self.engine is not None

    def load(self, model: str, label: str | None = None, wait: bool = False, **settings) -> None:
        """Load `model` with engine settings; the current model keeps serving until it is ready."""
        with self._lock:
            if self.state.status == "loading":
                raise RuntimeError(f"{self.state.model} is still loading; wait for it to finish")
            self.state = LoadState("loading", f"Loading {label or model}…", model, settings, time.time())
        thread = threading.Thread(target=self._load, args=(model, label, settings), name="pagoda-load", daemon=True)
        thread.start()
        if wait:
            thread.join()
            if self.state.status == "error":
                raise RuntimeError(self.state.message)

    def _load(self, model: str, label: str | None, settings: dict) -> None:
        try:
            engine = EngineThread(LLM(model, **settings))
        except Exception as e:  # any failure: say it, keep the previous model
            log.exception("loading %s failed", model)
            keep = f" {self.label} keeps serving." if self.engine else ""
            self.state = LoadState("error", f"Could not load {label or model}: {e}.{keep}", model, settings)
            return
        old, self.engine = self.engine, engine
        self.label = label or model
        s = engine.stats()
        took = time.time() - self.state.started
        self.state = LoadState("ready", f"{self.label} is ready on {s['device']} ({s['dtype']}, context {s['max_model_len']:,} "
                                        f"tokens, {s['num_blocks']:,} KV blocks) after {took:.0f} s.", model, settings)
        if old is not None:
            old.shutdown()

    def unload(self) -> None:
        with self._lock:
            old, self.engine = self.engine, None
            self.label = ""
            self.state = LoadState("idle", "No model loaded.")
        if old is not None:
            old.shutdown()

    def device_label(self) -> str:
        if self.engine is None:
            return "no model"
        s = self.engine.engine.stats()
        if s["device"].startswith("cuda"):
            import torch

            return torch.cuda.get_device_name()
        return "CPU"
