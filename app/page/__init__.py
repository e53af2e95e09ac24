"""The parts of the Pagoda page, one module each: the sidebar, the Chat, KV cache and Models tabs, and the
scripting API. Each renders its components inside the open gr.Blocks; app/page/layout.py's `build` composes them."""

import gradio as gr


def user_error(message: str) -> gr.Error:
    """An error the page shows as a toast: the user's to fix, so the log gets no traceback for it (Gradio
    prints one for every gr.Error unless told not to)."""
    return gr.Error(message, print_exception=False)
