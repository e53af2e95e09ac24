"""Who may talk to a local server: one ASGI middleware in front of the app's port and engine.serve's.

A server on 127.0.0.1 is still reachable from every web page its user opens. Two checks close that:

- Host. A page that rebinds its own domain to 127.0.0.1 (DNS rebinding, as in Ollama's CVE-2024-28224)
  sends its own name in the Host header; only this machine's names, the bound address and the names
  given with --allowed-hosts are served. Everything else gets a 403 before any route runs.
- Origin. Browsers name the page behind every cross-site request. A request from a page that is not
  served by an allowed host, nor named with --cors-origins, gets a 403: a page may still *send* a
  simple cross-site request (no preflight), and this stops it doing anything. CORS headers go only
  to --cors-origins; any that an inner app (Gradio) adds for other origins are removed.

And, for /v1, a POST must say `Content-Type: application/json` (else 415): the browser content types
that skip the preflight (text/plain, forms) are never parsed as an API call.
"""

import argparse
import ipaddress
import json
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from entrypoints.anthropic.errors import error_body, speaks_anthropic

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
ANY_ADDRESS = frozenset({"0.0.0.0", "::", ""})
CORS_RESPONSE_HEADERS = frozenset(
    {
        b"access-control-allow-origin",
        b"access-control-allow-credentials",
        b"access-control-allow-methods",
        b"access-control-allow-headers",
        b"access-control-expose-headers",
        b"access-control-max-age",
    }
)


def host_name(value: str) -> str:
    """The host part of a Host header or a name: no port, no IPv6 brackets, lower case, no trailing dot."""
    value = value.strip().lower()
    if value.startswith("["):  # [::1]:7860
        end = value.find("]")
        return value[1:end] if end > 0 else value
    if value.count(":") == 1:  # name:port; a bare IPv6 literal has several colons and no port
        value = value.partition(":")[0]
    return value.rstrip(".")


def parse_hosts(value: str) -> list[str]:
    """--allowed-hosts: comma-separated host names or addresses (`*`: any host, for a reverse proxy)."""
    hosts = []
    for item in (part.strip() for part in value.split(",")):
        if not item:
            raise argparse.ArgumentTypeError(
                f"empty host name in {value!r}; separate names with commas, "
                "for example --allowed-hosts gpu-box,gpu-box.lan"
            )
        if "/" in item or "@" in item:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not a host name; give the name alone, without scheme or "
                "path, for example --allowed-hosts gpu-box.lan"
            )
        name = host_name(item)
        if item.count(":") == 1 or (item.startswith("[") and "]:" in item):
            raise argparse.ArgumentTypeError(
                f"{item!r} has a port; give the host name alone ({name}): any port of an allowed host is allowed"
            )
        hosts.append(name)
    return hosts


def parse_origins(value: str) -> list[str]:
    """--cors-origins: comma-separated origins, each scheme://host[:port] as a browser sends it."""
    origins = []
    for item in (part.strip() for part in value.split(",")):
        try:
            parts = urlsplit(item)
            parts.port  # noqa: B018 - raises ValueError on a malformed port
        except ValueError:
            parts = urlsplit("")
        if (
            item == "*"
            or parts.scheme not in ("http", "https")
            or not parts.hostname
            or parts.path not in ("", "/")
            or parts.query
            or parts.fragment
        ):
            raise argparse.ArgumentTypeError(
                f"{item!r} is not an origin; give scheme://host[:port] as the browser "
                "shows it, for example --cors-origins https://notes.example.com "
                "(no wildcard: name each site)"
            )
        origins.append(normal_origin(item))
    return origins


def normal_origin(origin: str) -> str:
    """scheme://host[:port] with the scheme's default port left out, so equal origins compare equal;
    "" for what is not an origin (`null`, from a sandboxed frame or a file)."""
    try:
        parts = urlsplit(origin.strip().lower())
        default = {"http": 80, "https": 443}.get(parts.scheme)
        port = parts.port if parts.port is not None else default
    except ValueError:  # a malformed port or IPv6 literal
        return ""
    if default is None or not parts.hostname:
        return ""
    host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port != default else "")


def add_access_options(ap: argparse.ArgumentParser) -> None:
    """--allowed-hosts and --cors-origins, the same on the app and on engine.serve."""
    ap.add_argument(
        "--allowed-hosts",
        type=parse_hosts,
        action="extend",
        default=[],
        metavar="NAMES",
        help="more host names this server answers to, comma-separated (a name other machines use for "
        "it, a reverse proxy's). Always served: localhost, 127.0.0.1, [::1] and the bound address "
        "(all of this machine's names and addresses when listening on every interface). "
        "Requests for any other Host get a 403, which stops DNS-rebinding pages. "
        "`*` turns the check off",
    )
    ap.add_argument(
        "--cors-origins",
        type=parse_origins,
        action="extend",
        default=[],
        metavar="ORIGINS",
        help="web pages on other sites that may call this server from the browser, comma-separated "
        "origins (https://notes.example.com). Default: none; requests from other sites get a 403",
    )


def machine_names() -> set[str]:
    """This machine's own names and addresses: what LAN clients put in the Host header."""
    names = set()
    try:
        hostname = socket.gethostname()
        names |= {hostname, f"{hostname}.local", socket.getfqdn()}
        names |= set(socket.gethostbyname_ex(hostname)[2])
    except OSError:
        pass
    try:
        import psutil

        for addrs in psutil.net_if_addrs().values():
            names |= {a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)}
    except (ImportError, OSError):
        pass
    return {host_name(n) for n in names if n}


@dataclass
class AccessPolicy:
    """The hosts and cross-site origins a server accepts. Mutable: the app adds its share link's host once
    Gradio has made it."""

    hosts: set[str] = field(default_factory=lambda: set(LOCAL_NAMES))
    any_host: bool = False
    cors_origins: set[str] = field(default_factory=set)

    @classmethod
    def for_bind(cls, bind: str, allowed_hosts: Iterable[str] = (), cors_origins: Iterable[str] = ()) -> "AccessPolicy":
        """The policy for a server bound to `bind` (an address or name; 0.0.0.0 or :: for every interface)."""
        policy = cls(cors_origins={normal_origin(o) for o in cors_origins})
        bound = host_name(bind)
        if bound in ANY_ADDRESS:
            policy.hosts |= machine_names()
        else:
            policy.hosts.add(bound)
        for name in allowed_hosts:
            if name == "*":
                policy.any_host = True
            else:
                policy.allow_host(name)
        return policy

    def allow_host(self, name: str) -> None:
        self.hosts.add(host_name(name))

    def host_allowed(self, host: str) -> bool:
        return self.any_host or self.is_own_host(host)

    def is_own_host(self, host: str) -> bool:
        """Named by the policy (or a loopback address), as opposed to let in by `--allowed-hosts *`."""
        name = host_name(host)
        if name in self.hosts:
            return True
        try:  # 127.0.0.2 and ::ffff:127.0.0.1 are this machine too
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False

    def origin_allowed(self, origin: str) -> bool:
        """A page served by an allowed host (the app's own page, its share link), or one named for CORS."""
        normal = normal_origin(origin)
        if not normal:
            return False
        # `--allowed-hosts *` is for a reverse proxy's names; it lets no other site's pages in.
        return normal in self.cors_origins or self.is_own_host(urlsplit(normal).hostname)


class HTTPGuard:
    """ASGI middleware: the Host and Origin checks on every request, the content type on /v1 POSTs, and CORS
    headers for --cors-origins only. Put it outermost, so nothing inside runs for a refused request.
    Plain ASGI, without Starlette, so that the launcher can read this module's options before installing."""

    def __init__(self, app, policy: AccessPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refusal = self.refusal(scope, headers)
        if refusal is not None:
            status, content_type, body = refusal
            if scope["type"] == "websocket":  # closing before the accept refuses the handshake with a 403
                await send({"type": "websocket.close", "code": 1008})
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        origin = headers.get("origin")
        cors = origin is not None and normal_origin(origin) in self.policy.cors_origins
        if cors and scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            allow = [
                (b"access-control-allow-origin", origin.encode("latin-1")),
                (b"vary", b"Origin"),
                (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                (b"access-control-max-age", b"600"),
                (b"content-length", b"0"),
            ]
            if "access-control-request-headers" in headers:
                allow.append((b"access-control-allow-headers", headers["access-control-request-headers"].encode()))
            await send({"type": "http.response.start", "status": 204, "headers": allow})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_cors(message: dict) -> None:
            if message["type"] == "http.response.start":
                # Drop what an inner app added (Gradio echoes any origin to a LAN address), then add ours.
                out = [(k, v) for k, v in message.get("headers", []) if k.lower() not in CORS_RESPONSE_HEADERS]
                if cors:
                    out.append((b"access-control-allow-origin", origin.encode("latin-1")))
                    out.append((b"vary", b"Origin"))
                message = {**message, "headers": out}
            await send(message)

        await self.app(scope, receive, send_with_cors if scope["type"] == "http" else send)

    def refusal(self, scope: dict, headers: dict[str, str]) -> tuple[int, str, bytes] | None:
        """(status, content type, body) of the answer to a request that is refused, or None."""
        path = scope.get("path", "")
        api = path == "/v1" or path.startswith("/v1/")
        host = headers.get("host", "")
        if not self.policy.host_allowed(host):
            name = host_name(host)
            message = (
                f"Host {name!r} is not allowed; start with --allowed-hosts {name} to allow it"
                if name
                else "the request has no Host header; send one naming this server (e.g. Host: localhost)"
            )
            return error(403, path, message, "host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self.policy.origin_allowed(origin):
            if normal_origin(origin):
                message = (
                    f"Requests from the web page at {origin} are not allowed; start with --cors-origins "
                    f"{origin} to allow that site"
                )
            else:  # `null`: a sandboxed frame or a local file, which no setting can name
                message = f"Requests from pages without an origin of their own ({origin!r}) are not allowed"
            return error(403, path, message, "origin_not_allowed")
        if api and scope["type"] == "http" and scope["method"] == "POST":
            kind = headers.get("content-type", "").partition(";")[0].strip().lower()
            if kind != "application/json":
                return error(
                    415,
                    path,
                    f"/v1 takes JSON bodies: send `Content-Type: application/json` (got {kind or 'none'!r})",
                    "unsupported_media_type",
                )
        return None


def error(status: int, path: str, message: str, code: str) -> tuple[int, str, bytes]:
    """An API answers in its own error shape (what its clients parse: Anthropic's under /v1/messages, OpenAI's
    elsewhere under /v1, Ollama's under /api); the page and Gradio's routes in plain text."""
    if speaks_anthropic(path):
        return status, "application/json", json.dumps(error_body(status, message)).encode()
    if path == "/v1" or path.startswith("/v1/"):
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
        return status, "application/json", json.dumps(body).encode()
    if path.startswith("/api/"):  # Ollama's
        return status, "application/json", json.dumps({"error": message}).encode()
    return status, "text/plain; charset=utf-8", message.encode()
