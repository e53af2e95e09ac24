"""The whole page, composed from its parts: the sidebar, the header, the Chat, KV cache and Models tabs, and the
scripting API; the page's own scripts (Esc, light or dark, the drawer on a phone); and launch()'s settings."""

from collections.abc import Callable
from typing import TYPE_CHECKING

import gradio as gr

from app.page.api import add_api
from app.page.chat_tab import CHAT_CSS, DOWNLOAD_JS, KEYS_JS, render_chat_tab, wire_chat_tab
from app.page.kv_tab import render_kv_tab, track_kv_tab
from app.page.sidebar import load_first_view, render_sidebar, wire_archive, wire_sidebar
from app.page.tools_panel import render_tools_panel, wire_tools_panel
from app.visualizer import visualizer_css

if TYPE_CHECKING:
    from app.ui import PagodaUI


def build(ui: "PagodaUI", models_tab: Callable[["PagodaUI"], None] | None = None) -> gr.Blocks:
    """The page. `models_tab(ui)` renders the Models tab inside the Blocks, when given."""
    presets = {p.name: p.system_prompt for p in ui.store.presets()}  # shared by every chat, added to by Save preset
    # Gradio keeps a copy of every exported chat in its cache: an hour is long enough for the download
    with gr.Blocks(title="Pagoda", fill_height=True, delete_cache=(3600, 3600)) as demo:
        # A drawer beside the chat: on a phone it starts closed (PAGE_JS), so the chat comes first.
        with gr.Sidebar(elem_id="sidebar", width=300):
            sidebar = render_sidebar(ui)
        with gr.Row(equal_height=True):
            # A callable value: each page fetches the header as it opens, instead of showing the start-up
            # text ("Loading <model>…") until the timer's first refresh.
            header = gr.Markdown(ui.header, elem_id="header")
            theme_btn = gr.Button("◐ Light / dark", size="sm", scale=0, min_width=140)
        with gr.Tabs():
            with gr.Tab("Chat") as chat_page:
                chat = render_chat_tab(presets)
                tools = render_tools_panel()
            with gr.Tab("KV cache") as kv_page:
                kv_html = render_kv_tab(ui)
            other_pages = [chat_page]
            if models_tab is not None:
                with gr.Tab("Models") as models_page:
                    models_tab(ui)
                other_pages.append(models_page)

        # Events cross the parts (New chat reads the Chat tab's system prompt), so they are wired once all exist.
        wire_sidebar(ui, sidebar, chat.system)
        message_action = wire_chat_tab(ui, chat, sidebar, presets)
        wire_tools_panel(ui, tools, sidebar, message_action)
        wire_archive(ui, sidebar, DOWNLOAD_JS)
        header.change(lambda: gr.update(**ui.think_switch()), None, chat.think, show_progress="hidden")
        demo.unload(ui.on_unload)
        timer = gr.Timer(0.5)
        refreshed = [kv_html, header, sidebar.conversations, sidebar.title]
        timer.tick(
            ui.panels,
            [sidebar.search, sidebar.current],
            refreshed,
            show_progress="hidden",
            concurrency_limit=1,
            concurrency_id="panels",
        )
        track_kv_tab(ui, kv_page, other_pages)
        load_first_view(demo, ui, sidebar, presets, js=PAGE_JS)
        theme_btn.click(None, js=THEME_TOGGLE_JS)
        add_api(ui)
    return demo


# The page's choice of light or dark is kept in the browser, so a reload keeps it (Gradio follows the system's
# setting until then). On a narrow screen the chat list is a drawer: closed as the page opens, and closed again
# once a chat is picked or made, so the chat itself is always what shows.
THEME_TOGGLE_JS = """
() => {
  const dark = document.body.classList.toggle('dark');
  localStorage.setItem('pagoda-theme', dark ? 'dark' : 'light');
}
"""
PAGE_JS = """
() => {
  (%s)();
  const theme = localStorage.getItem('pagoda-theme');
  if (theme) { document.body.classList.toggle('dark', theme === 'dark'); }
  const narrow = () => window.matchMedia('(max-width: 768px)').matches;
  const closeDrawer = () => {
    const drawer = document.querySelector('#sidebar');
    if (narrow() && drawer && drawer.classList.contains('open')) { drawer.querySelector('.toggle-button').click(); }
  };
  closeDrawer();
  document.addEventListener('change', (e) => { if (e.target.closest('#chat-list')) { closeDrawer(); } });
  document.addEventListener('click', (e) => { if (e.target.closest('#new-chat')) { closeDrawer(); } });
}
""" % KEYS_JS.strip()


def launch_kwargs() -> dict:
    # No run history: Gradio kept every event's inputs (each prompt, deleted chats' too) in the browser's local
    # storage and listed them under internal event names in a "Runs" page linked from the footer.
    return {
        "css": visualizer_css() + CHAT_CSS,
        "theme": gr.themes.Soft(),
        "run_history": False,
        "footer_links": ["api", "gradio", "settings"],
    }
