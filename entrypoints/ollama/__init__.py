"""Ollama's API (/api/chat, /api/generate, /api/tags, ...), on the request path every API shares."""
