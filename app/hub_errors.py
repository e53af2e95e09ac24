"""Hub errors as sentences: `explain_error` turns an exception from a huggingface_hub call into one sentence a
user can act on (gated repo, missing repo, no connection, rate limit, full disk...), and `DownloadError` carries
that sentence to the UI.

The whole `__cause__`/`__context__` chain is examined, because huggingface_hub's own error types often wrap the
network library's exception (httpx or requests), and that inner exception is what names the cause.
"""

from __future__ import annotations

import errno
import socket

__all__ = ["DownloadError", "explain_error"]


class DownloadError(Exception):
    """A hub operation failed; str(e) is a sentence for the user, e.__cause__ the original exception."""


def explain_error(exc: BaseException, repo_id: str, endpoint: str | None = None) -> str:
    """One sentence a user can act on, for an exception from a hub call."""
    from huggingface_hub import constants
    from huggingface_hub import errors as hub_errors

    endpoint = endpoint or constants.ENDPOINT
    chain = _chain(exc)
    page = f"{endpoint}/{repo_id}"

    def find(*types):
        return next((e for e in chain if isinstance(e, types)), None)

    login = "log in with `huggingface-cli login` (or `hf auth login`)"
    if find(hub_errors.GatedRepoError):
        return (
            f"{repo_id} is a gated model: open {page}, accept its license, then {login} with a token of the "
            "account that accepted it. Access is usually granted within minutes."
        )
    if find(hub_errors.RepositoryNotFoundError):
        return (
            f"The repo {repo_id} was not found on the Hugging Face hub. Check the spelling (for example "
            f"Qwen/Qwen3-0.6B); if it is private, {login}."
        )
    if find(hub_errors.RevisionNotFoundError):
        return f"The requested revision of {repo_id} does not exist on the Hugging Face hub."
    if find(hub_errors.DisabledRepoError):
        return f"The repo {repo_id} has been disabled on the Hugging Face hub."
    status = next(
        (
            getattr(getattr(e, "response", None), "status_code", None)
            for e in chain
            if isinstance(e, hub_errors.HfHubHTTPError) and getattr(e, "response", None) is not None
        ),
        None,
    )
    if status == 401:
        return f"The Hugging Face hub refused access to {repo_id} (401): {login}."
    if status == 403:
        return (
            f"The Hugging Face hub refused access to {repo_id} (403). If it is gated, accept its license at "
            f"{page}; make sure your token may read gated repos, then {login}."
        )
    if status == 404:
        return f"The repo {repo_id} or one of its files was not found on the Hugging Face hub (404)."
    if status == 429:
        return "The Hugging Face hub is rate-limiting this computer (429). Wait a few minutes and try again."
    if status is not None and status >= 500:
        return f"The Hugging Face hub answered with a server error ({status}). Try again later."
    offline_types = tuple(t for t in (getattr(hub_errors, "OfflineModeIsEnabled", None),) if t)
    if (offline_types and find(*offline_types)) or constants.HF_HUB_OFFLINE:
        return (
            "Downloads are switched off (HF_HUB_OFFLINE is set). Unset it to download models; "
            "the bundled model works offline."
        )
    disk = next((e for e in chain if isinstance(e, OSError) and e.errno == errno.ENOSPC), None)
    if disk is not None:
        return "The disk ran out of space during the download. Free some space and start it again to resume."
    if _is_connection_error(chain, hub_errors):
        reason = _connection_reason(chain)
        return (
            f"Could not reach the Hugging Face hub ({endpoint}: {reason}). Check your connection; "
            "the bundled model works offline."
        )
    if isinstance(exc, hub_errors.HfHubHTTPError):
        return f"The Hugging Face hub returned an error for {repo_id}: {_first_line(exc)}"
    return f"Downloading {repo_id} failed: {type(exc).__name__}: {_first_line(exc)}"


def _chain(exc: BaseException) -> list[BaseException]:
    seen, out, todo = set(), [], [exc]
    while todo and len(out) < 20:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        out.append(e)
        todo.extend([e.__cause__, e.__context__])
    return out


def _http_errors() -> tuple[type, ...]:
    types: list[type] = []
    for module in ("httpx2", "httpx", "requests"):
        try:
            mod = __import__(module)
        except ImportError:
            continue
        for name in (
            "ConnectError",
            "ConnectTimeout",
            "TimeoutException",
            "NetworkError",
            "ConnectionError",
            "Timeout",
            "ProxyError",
            "RemoteProtocolError",
        ):
            t = getattr(getattr(mod, "exceptions", mod), name, None) or getattr(mod, name, None)
            if isinstance(t, type):
                types.append(t)
    return tuple(types)


def _is_connection_error(chain: list[BaseException], hub_errors) -> bool:
    local_entry = getattr(hub_errors, "LocalEntryNotFoundError", None)
    incomplete = getattr(hub_errors, "IncompleteSnapshotError", None)
    types = _http_errors() + (ConnectionError, TimeoutError, socket.gaierror)
    types += tuple(t for t in (local_entry, incomplete) if t)
    return any(isinstance(e, types) for e in chain)


def _connection_reason(chain: list[BaseException]) -> str:
    """The most specific short reason in the chain, e.g. "connection refused" or "name resolution failed"."""
    text = " ".join(str(e) for e in chain).lower()
    for needle, reason in (
        ("refused", "connection refused"),
        ("name or service not known", "name resolution failed"),
        ("nodename nor servname", "name resolution failed"),
        ("temporary failure in name resolution", "name resolution failed"),
        ("getaddrinfo", "name resolution failed"),
        ("timed out", "timed out"),
        ("timeout", "timed out"),
        ("network is unreachable", "network unreachable"),
        ("ssl", "TLS/SSL error"),
        ("proxy", "proxy error"),
    ):
        if needle in text:
            return reason
    inner = chain[-1]
    return f"{type(inner).__name__}: {_first_line(inner)}" if str(inner) else type(inner).__name__


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
