"""The parts of the Pagoda page, one module each: the sidebar, the Chat, KV cache and Models tabs, and the
scripting API. Each renders its components inside the open gr.Blocks; app/ui.py's `build` composes them."""
