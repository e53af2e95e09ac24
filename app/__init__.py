"""Pagoda's Gradio application: chats, model management and the KV cache visualizer."""
