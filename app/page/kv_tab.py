"""The KV cache tab: the engine's block grid (or a remote server's metrics). The page's timer refreshes it,
and renders it only for a page that shows this tab, so the tab tells PagodaUI when it is shown or left."""

from typing import TYPE_CHECKING

import gradio as gr

if TYPE_CHECKING:
    from app.ui import PagodaUI


def render_kv_tab(ui: "PagodaUI") -> gr.HTML:
    return gr.HTML(ui.kv_panel(), elem_id="kv-cache")


def track_kv_tab(ui: "PagodaUI", kv_tab: gr.Tab, other_tabs: list[gr.Tab]) -> None:
    """Selecting the KV cache tab, or any of `other_tabs`, records whether this page shows the grid."""

    def kv_tab_shown(request: gr.Request) -> None:
        ui.show_kv_tab(True, request)

    def kv_tab_hidden(request: gr.Request) -> None:
        ui.show_kv_tab(False, request)

    kv_tab.select(kv_tab_shown, None, None, show_progress="hidden")
    for tab in other_tabs:
        tab.select(kv_tab_hidden, None, None, show_progress="hidden")
