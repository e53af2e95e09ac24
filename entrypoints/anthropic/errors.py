"""Anthropic's error shape, and which paths answer in it: plain Python, so that the HTTP guard (which the launcher
imports before any package is installed) can use it."""

# Anthropic's error types, by status (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
PATH = "/v1/messages"


def speaks_anthropic(path: str) -> bool:
    """Whether a request to `path` is answered in Anthropic's shapes (its errors included)."""
    return path == PATH or path.startswith(PATH + "/")


def error_body(status: int, message: str) -> dict:
    """Anthropic's error object: {"type": "error", "error": {"type": ..., "message": ...}}."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
