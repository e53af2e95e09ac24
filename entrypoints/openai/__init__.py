"""The OpenAI-compatible API: request bodies and errors (`protocol`), routes and streaming (`server`)."""
