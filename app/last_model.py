"""The model loaded last from the Models tab, kept in the store, so that Pagoda starts with it again.

Only a model still on this computer is loaded at start (a downloaded repo, a folder or a .gguf file):
nothing is downloaded then. A model deleted since, or one that no longer loads, gives the bundled one, and the
status line says why; so does a model loaded again (the status names it as the one used last)."""

import logging
from pathlib import Path

from app.model_host import ModelHost, resolve_model
from app.store import ConversationStore

log = logging.getLogger("pagoda")
KEY = "last_model"


class LastModel:
    """Reads and writes the remembered model: the user's choice as typed or picked, and its load settings."""

    def __init__(self, store: ConversationStore):
        self.store = store

    def remember(self, choice: str, settings: dict) -> None:
        self.store.set_app_setting(KEY, {"model": choice, "settings": settings})

    def recall(self) -> tuple[str, dict] | None:
        """(choice, load settings) of the model loaded last; None before the first load (or when unreadable)."""
        saved = self.store.app_setting(KEY)
        if not isinstance(saved, dict) or not isinstance(saved.get("model"), str):
            return None
        settings = saved.get("settings")
        return saved["model"], settings if isinstance(settings, dict) else {}


def load_at_start(
    host: ModelHost,
    last: LastModel,
    cli_model: str | None,
    downloaded: dict[str, Path],
    max_num_seqs: int,
    kv_cache_dtype: str | None = None,
    speculative_config: dict | None = None,
) -> None:
    """Start the load Pagoda begins with: the command line's model when given, else the model used last when it
    is still here (`downloaded`: repo id -> its files, as the Models tab lists them), else the bundled one.
    `kv_cache_dtype` and `speculative_config` (the command line's) apply to whichever it is; None keeps what the model
    used last had."""
    given = {"max_num_seqs": max_num_seqs, **({"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype else {})}
    if speculative_config is not None:
        given["speculative_config"] = speculative_config
    recalled = None if cli_model else last.recall()
    if recalled is None:
        host.load_default(cli_model, **given)
        return
    choice, settings = recalled
    try:
        source, label = resolve_model(choice, downloaded)
    except RuntimeError:
        log.info("%s, the model used last, is no longer here: loading the bundled model", choice)
        host.load_default(
            None,
            note=f"({choice}, the model used last, is no longer on this computer: download it again "
            "from the Models tab.)",
            **given,
        )
        return

    note = "(The model used last, loaded again at start.)"
    draft = _missing_draft(settings)
    if draft is not None and "speculative_config" not in given:  # the model still serves, without its draft
        settings = {k: v for k, v in settings.items() if k != "speculative_config"}
        note = (
            f"(The model used last, loaded again at start; its draft model {Path(draft).name} is no longer on this "
            "computer, so it runs without speculative decoding: pick another draft in the Models tab.)"
        )

    def instead(why: str) -> None:  # it no longer loads here (less memory free, say): Pagoda still starts serving
        log.warning("%s, the model used last, did not load: loading the bundled model", choice)
        host.load_default(
            None,
            note=f"({choice}, the model used last, did not load: {why} The bundled model serves instead.)",
            **given,
        )

    # The chat slots follow this start's --max-chats, not the last one's
    host.load(
        source,
        label=label,
        remember_as=choice,
        note=note,
        on_failure=instead,
        **{**settings, **given},
    )


def _missing_draft(settings: dict) -> str | None:
    """The draft model the remembered settings name (speculative decoding with a draft), if its file or folder
    is gone; None otherwise."""
    spec = settings.get("speculative_config")
    if not isinstance(spec, dict) or spec.get("method") not in ("draft", "draft_model") or not spec.get("model"):
        return None
    return None if Path(str(spec["model"])).expanduser().exists() else str(spec["model"])
