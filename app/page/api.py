"""The scripting API (gr.api endpoints, no components): what the page shows, as data, and the backend
switches of the Models tab. Scripts and the end-to-end tests call these through gradio_client."""

import dataclasses
from typing import TYPE_CHECKING

import gradio as gr

from app.model_host import resolve_model
from app.remote import RemoteError

if TYPE_CHECKING:
    from app.ui import PagodaUI


def add_api(ui: "PagodaUI") -> None:
    """Register the endpoints on the open gr.Blocks."""

    def engine_stats() -> dict:
        engine = ui.host.engine
        return dataclasses.asdict(engine.stats()) if engine is not None else {}

    def model_status() -> dict:
        st, backend = ui.host.state, ui.host.backend
        return {
            "status": st.status,
            "message": st.message,
            "model": st.model,
            "backend": backend.kind if backend else None,
            "serving": backend.model if backend else None,
            "url": backend.url if backend else None,
        }

    def connect_remote(base_url: str, api_key: str = "", model: str = "") -> dict:
        """Serve the chats from an OpenAI-compatible server (model: empty = its first). A failure keeps the
        previous backend serving; either way the answer is the model status."""
        try:
            ui.host.connect(base_url, api_key or None, model or None)
        except RemoteError:
            pass
        backend = ui.host.backend
        return {**model_status(), "models": backend.models if backend else []}

    def disconnect_remote() -> dict:
        ui.host.disconnect()
        return model_status()

    def kv_panel() -> str:
        """The KV cache tab's HTML: the block grid, or what a remote server's /metrics says."""
        return ui.kv_panel()

    def load_model(model: str) -> dict:
        """Load a local model folder in the background (poll /model_status)."""
        try:
            source, label = resolve_model(model)
            ui.host.load(source, label=label, max_num_seqs=ui.max_concurrent_chats)
        except RuntimeError:
            pass
        return model_status()

    def list_conversations(query: str = "") -> list[dict]:
        return [
            {
                "id": c.id,
                "title": c.title,
                "system_prompt": c.system_prompt,
                "pinned": c.pinned,
                "folder": c.folder,
                "settings": c.settings,  # sampling, switches and tools (app/chat_settings.py)
            }
            for c in ui.store.list(query)
        ]

    def list_messages(conversation_id: int) -> list[dict]:
        return [
            {"id": m.id, "parent_id": m.parent_id, "role": m.role, "content": m.content, "meta": m.meta}
            for m in ui.store.messages(int(conversation_id))
        ]

    gr.api(engine_stats, api_name="engine_stats")
    gr.api(model_status, api_name="model_status")
    gr.api(connect_remote, api_name="connect_remote")
    gr.api(disconnect_remote, api_name="disconnect_remote")
    gr.api(load_model, api_name="load_model")
    gr.api(kv_panel, api_name="kv_panel")
    gr.api(list_conversations, api_name="conversations")
    gr.api(list_messages, api_name="messages")
