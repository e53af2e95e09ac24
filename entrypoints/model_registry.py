"""Several chat models served by name, as LM Studio's JIT loading and Ollama's keep_alive serve them: a request
that names a model not loaded loads it, within a memory budget; a model idle for `ttl` seconds is unloaded (its
memory goes back); `/v1/models` lists each with its state. Loads take turns, so a model never loads twice.

A model is never unloaded to make room for another: one that does not fit is refused with what it needs and
what is free, and the loaded ones keep serving. Only the idle timer unloads, and never the default model (the
first, loaded at start), as LM Studio keeps the models it started with.
"""

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio

from engine import EngineThread
from engine.loader import pick_device
from entrypoints.openai.errors import APIError
from entrypoints.openai.serving import ServedModel

log = logging.getLogger("pagoda.api")
MIB = 2**20
STATES = ("not-loaded", "loading", "loaded")


@dataclass
class ModelEntry:
    """One model the server can serve."""

    name: str  # what clients ask for
    source: str  # what loads it: a folder, GGUF file or hub repo id
    engine: EngineThread | None = None
    state: str = "not-loaded"  # one of STATES
    held_bytes: int = 0  # its weights and KV cache while loaded
    last_used: float = 0.0  # the registry's clock at its last request
    keep_alive: float | None = None  # idle seconds before it unloads, as a request set it (None: the TTL; inf: never)


def checkpoint_bytes(source: str) -> int:
    """Bytes of a local checkpoint's weights (0 for a hub repo id, not downloaded yet)."""
    path = Path(source).expanduser()
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return 0


def held_bytes(engine: EngineThread) -> int:
    """What a loaded engine holds: its weights and its whole KV cache."""
    stats = engine.stats()
    return sum(engine.engine.parameter_bytes()) + stats.num_blocks * stats.bytes_per_block


class ModelRegistry:
    """The models a server serves, by name; callable as a ModelSource (the model serving now: the default one,
    else the one used last). `budget_bytes`: what all loaded models may hold together (None: no bound of
    Pagoda's own; each load still checks the machine's free memory); `ttl`: seconds a model may stay idle
    before it is unloaded (None: never); `clock`: for tests.

    In the app, `pinned` is the chat model (served from elsewhere: the registry never loads nor unloads it, and a
    request naming it or no model gets it, so the chats keep their model), and `discover` names the downloaded
    models that may be loaded beside it, looked up again when a request names one not known yet."""

    def __init__(
        self,
        models: dict[str, str],
        settings: dict,
        ttl: float | None = None,
        budget_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        pinned: Callable[[], ServedModel | None] | None = None,
        discover: Callable[[], dict[str, str]] | None = None,
    ):
        if not models and pinned is None:
            raise ValueError("a registry needs at least one model")
        self.entries = {name: ModelEntry(name, source) for name, source in models.items()}
        self.default = None if pinned is not None else next(iter(self.entries))
        self.pinned, self.discover = pinned, discover
        self.settings, self.ttl, self.budget_bytes, self.clock = settings, ttl, budget_bytes, clock
        self._loads = threading.Lock()  # loads take turns
        self._state = threading.Lock()  # an entry's engine and last use change together
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    # ---- what the routes ask -------------------------------------------------------------------------------
    def __call__(self) -> ServedModel | None:
        if self.pinned is not None:
            return self.pinned()
        loaded = [e for e in self.entries.values() if e.engine is not None]
        if not loaded:
            return None
        entry = self.entries[self.default] if self.entries[self.default].engine else max(loaded, key=_last_used)
        return ServedModel(entry.engine, entry.name)

    def listing(self, look: bool = True) -> list[ModelEntry]:
        """Every model it can serve: the pinned one first (when there is one now), then the others. `look`: ask
        `discover` for new ones first (file I/O: from a worker thread, not the event loop)."""
        if look:
            self._look_again()
        current = None
        if self.pinned is not None:
            try:
                current = self.pinned()
            except APIError:  # loading, or served by a remote server: not listed until it serves here
                current = None
        first = [ModelEntry(current.name, "", current.engine, "loaded")] if current is not None else []
        return first + [e for e in self.entries.values() if current is None or e.name != current.name]

    def names(self) -> list[str]:
        """The names it answers to now, without looking for new models."""
        try:
            current = self.pinned() if self.pinned is not None else None
        except APIError:
            current = None
        return ([current.name] if current is not None else []) + list(self.entries)

    def _look_again(self) -> None:
        """Add the models `discover` names now (a download that has finished)."""
        if self.discover is not None:
            for name, source in self.discover().items():
                self.entries.setdefault(name, ModelEntry(name, source))

    async def pick(self, asked: str | None) -> ServedModel:
        """The model a request names (None: the default), loaded first if it is not: in a worker thread, so the
        server answers others meanwhile."""
        current = self.pinned() if self.pinned is not None else None
        if current is not None and (not asked or asked == current.name):
            return current
        name = asked or self.default
        if name not in self.entries:
            await anyio.to_thread.run_sync(self._look_again)
        entry = self.entries.get(name)
        if entry is None and self.pinned is not None and current is None:
            raise APIError(
                503, "no model is loaded; load one in Pagoda's Models tab", type="server_error", code="model_not_loaded"
            )
        if entry is None:
            raise APIError(
                404,
                f"the model {asked!r} does not exist; this server serves "
                f"{', '.join(repr(e.name) for e in self.listing(look=False))}",
                code="model_not_found",
                param="model",
            )
        with self._state:  # so the idle timer never takes the engine this request was just given
            entry.last_used = self.clock()
            engine = entry.engine
        if engine is None:
            engine = await anyio.to_thread.run_sync(self.load, name)
        return ServedModel(engine, name)

    # ---- loading and unloading -----------------------------------------------------------------------------
    def load(self, name: str) -> EngineThread:
        """Load `name` unless it is loaded (waiting for any load in progress first); an APIError says why not."""
        entry = self.entries[name]
        with self._loads:
            if entry.engine is not None:
                return entry.engine
            self._check_room(entry)
            entry.state = "loading"
            if name != self.default:
                log.info("loading %s (%s) for a request that names it", name, entry.source)
            settings = dict(self.settings)
            if name != self.default and pick_device(settings.get("device", "auto")).type == "cpu":
                # A CPU's compiled decode steps keep about 160 MiB of each load after the engine closes
                # (torch.compile's caches): a model that may load and unload again and again runs its steps eagerly.
                settings.setdefault("enforce_eager", True)
            try:
                engine = EngineThread.load(entry.source, runner="generate", **settings)
            except Exception as e:
                entry.state = "not-loaded"
                if name != self.default:  # the default's failure is the server's start-up error
                    log.warning("loading %s failed: %s", name, e)
                raise APIError(
                    503, f"{name} did not load: {e}", type="server_error", code="model_not_loaded", param="model"
                ) from e
            with self._state:
                entry.engine, entry.state, entry.held_bytes = engine, "loaded", held_bytes(engine)
                entry.last_used = self.clock()
            return engine

    def _check_room(self, entry: ModelEntry) -> None:
        if self.budget_bytes is None:
            return
        kv = self.settings.get("kv_cache_memory_bytes") or _default_kv_bytes()
        need = checkpoint_bytes(entry.source) + kv
        loaded = [e for e in self.entries.values() if e.engine is not None]
        free = self.budget_bytes - sum(e.held_bytes for e in loaded)
        if need > free:
            holding = ", ".join(f"{e.name} ({e.held_bytes / MIB:.0f} MiB)" for e in loaded) or "nothing"
            raise APIError(
                503,
                f"{entry.name} needs about {need / MIB:.0f} MiB (weights and KV cache), and {max(free, 0) / MIB:.0f} "
                f"MiB of the {self.budget_bytes / MIB:.0f} MiB memory budget is free ({holding} loaded). The "
                "loaded models keep serving; one unloads after it has been idle for the TTL, or raise "
                "--memory-budget",
                type="server_error",
                code="insufficient_memory",
                param="model",
            )

    def unload_idle(self) -> list[str]:
        """Unload every model but the default one idle for its keep_alive or the TTL (no request running or
        waiting, none naming it since); returns their names."""
        gone = []
        with self._loads:
            for entry in self.entries.values():
                with self._state:
                    engine, idle = entry.engine, self.clock() - entry.last_used
                    ttl = entry.keep_alive if entry.keep_alive is not None else self.ttl
                    if entry.name == self.default or engine is None or ttl is None or idle < ttl:
                        continue
                    stats = engine.stats()
                    if stats.num_running or stats.num_waiting:
                        continue
                    entry.engine, entry.state, entry.held_bytes = None, "not-loaded", 0
                engine.shutdown()
                log.info("unloaded %s after %.0f s idle", entry.name, idle)
                gone.append(entry.name)
        return gone

    def keep(self, name: str, seconds: float) -> bool:
        """Ollama's keep_alive: `name` unloads after `seconds` idle from now on (0: as soon as it is idle; inf:
        never). Whether that was taken: the default model stays loaded whatever a request asks."""
        entry = self.entries.get(name)
        if entry is None or name == self.default:
            return False
        entry.keep_alive = seconds
        return True

    def start(self) -> "ModelRegistry":
        """Load the default model now (if it is the registry's own), and start the idle timer."""
        if self.default is not None:
            self.load(self.default)
        self._reaper = threading.Thread(target=self._reap, name="pagoda-ttl", daemon=True)
        self._reaper.start()
        return self

    def _reap(self) -> None:
        while not self._stop.wait(min(max((self.ttl or 4.0) / 4, 0.1), 1.0)):
            try:
                self.unload_idle()
            except Exception:  # noqa: BLE001 - the timer goes on; the next round tries again
                log.exception("unloading idle models failed")

    def shutdown(self) -> None:
        self._stop.set()
        for entry in self.entries.values():
            if entry.engine is not None:
                entry.engine.shutdown()
                entry.engine, entry.state = None, "not-loaded"


def _last_used(entry: ModelEntry) -> float:
    return entry.last_used


def _default_kv_bytes() -> int:
    from engine.runner.kv_cache import CPU_KV_CACHE_BYTES

    return CPU_KV_CACHE_BYTES
