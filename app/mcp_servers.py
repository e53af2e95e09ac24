"""MCP (Model Context Protocol) servers the chat's tools come from, through the official `mcp` SDK: their settings
read from `mcp.json` in the mcpServers shape Claude Desktop, LM Studio and Cursor use, and a hub that starts each
server on first use, lists its tools, calls them with a time limit, starts a crashed one again, and stops them all
with the app.

    {"mcpServers": {
        "files": {"command": "uvx", "args": ["mcp-server-filesystem", "/home/me/notes"], "env": {"KEY": "..."}},
        "search": {"url": "https://example.com/mcp", "headers": {"Authorization": "Bearer ..."}}}}

A server may set "timeout": the seconds its tool calls may take (60 when not set).

A server with a "command" runs as a subprocess over stdio (its stderr goes to a log file, never to the chat); one
with a "url" is reached over Streamable HTTP. The hub runs the SDK's asyncio clients on a thread of its own, so the
app's threads call it as plain functions.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("pagoda.mcp")

__all__ = ["McpError", "McpHub", "McpServerConfig", "ToolInfo", "ToolResult", "load_mcp_config"]

CONFIG_NAME = "mcp.json"
START_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 60.0  # a tool call's default time limit
CONNECTION_CLOSED = -32000  # the JSON-RPC code the SDK gives a call whose connection closed under it


class McpError(RuntimeError):
    """An MCP server that cannot be configured, started or reached, or a call that failed: the message says which
    server and what to do."""


@dataclass(frozen=True)
class McpServerConfig:
    name: str
    command: str | None = None  # stdio: the program and its arguments
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    url: str | None = None  # Streamable HTTP: the endpoint and its headers
    headers: tuple[tuple[str, str], ...] = ()
    timeout: float = CALL_TIMEOUT_S  # seconds a tool call may take ("timeout" in mcp.json)

    @property
    def runs_a_command(self) -> bool:
        """A stdio server runs a program on this computer (a page opened from elsewhere may not add or run one)."""
        return self.command is not None


@dataclass
class ToolInfo:
    server: str
    name: str
    description: str
    input_schema: dict


@dataclass
class ToolResult:
    text: str  # the result's text parts, joined (other parts are named, not shown)
    is_error: bool = False
    structured: Any = None


def load_mcp_config(path: Path) -> dict[str, McpServerConfig]:
    """The servers `path` (an mcp.json) configures, by name; none when the file does not exist. McpError says what
    is wrong with a file that cannot be used."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise McpError(f"{path} could not be read as JSON ({e}). Fix it, or move it aside.") from None
    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        raise McpError(f'{path} needs an object "mcpServers": {{"<name>": {{"command": ...}} or {{"url": ...}}}}.')
    return {name: _server(name, spec, path) for name, spec in servers.items()}


def _server(name: str, spec: Any, path: Path) -> McpServerConfig:
    where = f'{path}: server "{name}"'
    if not isinstance(spec, dict):
        raise McpError(f"{where} must be an object with a command or a url.")
    timeout = spec.get("timeout", CALL_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise McpError(f"{where}: timeout must be the seconds a tool call may take, a number above 0.")
    return dataclasses.replace(_transport_config(name, spec, where), timeout=float(timeout))


def _transport_config(name: str, spec: dict, where: str) -> McpServerConfig:
    if "command" in spec:
        args, env = spec.get("args", []), spec.get("env", {})
        if not isinstance(spec["command"], str) or not spec["command"].strip():
            raise McpError(f"{where}: command must be the program to run.")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise McpError(f"{where}: args must be a list of strings.")
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise McpError(f"{where}: env must map names to strings.")
        return McpServerConfig(name, command=spec["command"], args=tuple(args), env=tuple(env.items()))
    if "url" in spec:
        headers = spec.get("headers", {})
        if not isinstance(spec["url"], str) or not spec["url"].startswith(("http://", "https://")):
            raise McpError(f"{where}: url must be an http:// or https:// address.")
        if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
            raise McpError(f"{where}: headers must map names to strings.")
        return McpServerConfig(name, url=spec["url"], headers=tuple(headers.items()))
    raise McpError(f"{where} needs a command (a server run over stdio) or a url (Streamable HTTP).")


@dataclass
class _Running:
    """One connected server: its SDK client, and the task that holds its connection open until told to stop."""

    client: Any
    stop: asyncio.Event
    task: asyncio.Task
    tools: list[ToolInfo] = field(default_factory=list)


class McpHub:
    """The configured servers, each started on first use. Thread-safe: every method may be called from any thread
    but the hub's own."""

    def __init__(self, servers: dict[str, McpServerConfig], log_dir: Path, allow_commands: bool = True):
        self.servers = servers
        self.log_dir = log_dir
        self.allow_commands = allow_commands  # False: stdio servers (they run programs here) are refused
        self.restarts: dict[str, int] = {}  # times each server was started again after it failed
        self._running: dict[str, _Running] = {}
        self._failed: set[str] = set()  # servers a call failed on: started again at the next use
        self._retired: list[asyncio.Task] = []  # their connections, closing
        self._locks: dict[str, asyncio.Lock] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pagoda-mcp", daemon=True)
        self._thread.start()
        self._closed = False

    # ---- called from the app's threads ----------------------------------------------------------------------

    def tools(self, server: str) -> list[ToolInfo]:
        """The server's tools (it starts, if it is not running)."""
        return self._run(self._connected(server), START_TIMEOUT_S + 5).tools

    def call(self, server: str, tool: str, arguments: dict, timeout: float | None = None) -> ToolResult:
        """Call a tool; McpError if the server cannot be reached or the call takes longer than `timeout` seconds
        (the server's own, from mcp.json, when None). A server that failed is started again at the next call (and
        `restarts` counts it)."""
        future = self.start_call(server, tool, arguments, timeout)
        try:
            return future.result(self.time_limit(server, timeout))
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise McpError(f'MCP server "{server}" did not answer in time.') from None

    def start_call(
        self, server: str, tool: str, arguments: dict, timeout: float | None = None
    ) -> concurrent.futures.Future:
        """call(), as a future: its result is the ToolResult (or the McpError); cancelling it (Stop) cancels the
        call on the server's connection."""
        if self._closed:
            raise McpError("The MCP servers have stopped with the app.")
        coroutine = self._call(server, tool, arguments, self._timeout(server, timeout))
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def time_limit(self, server: str, timeout: float | None = None) -> float:
        """The longest a call's future may take: the call's own limit, and a (re)start of its server."""
        return self._timeout(server, timeout) + START_TIMEOUT_S + 5

    def _timeout(self, server: str, timeout: float | None) -> float:
        if timeout is not None:
            return timeout
        config = self.servers.get(server)
        return config.timeout if config is not None else CALL_TIMEOUT_S

    def close(self) -> None:
        """Stop every server (their processes end) and the hub's thread."""
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._stop_all(), self._loop).result(15)
        except concurrent.futures.TimeoutError:
            log.warning("MCP servers did not all stop within 15 s")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def _run(self, coroutine: Coroutine, timeout: float):
        if self._closed:
            coroutine.close()
            raise McpError("The MCP servers have stopped with the app.")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise McpError("An MCP server did not answer in time.") from None

    # ---- on the hub's thread --------------------------------------------------------------------------------

    async def _connected(self, name: str) -> _Running:
        # One start at a time per server: two first calls at once started two processes, and one leaked
        async with self._locks.setdefault(name, asyncio.Lock()):
            return await self._connect(name)

    async def _connect(self, name: str) -> _Running:
        running = self._running.get(name)
        if running is not None and not running.task.done():
            return running
        if running is not None or name in self._failed:  # it stopped, or a call failed on it: start it again
            self._running.pop(name, None)
            self._failed.discard(name)
            self.restarts[name] = self.restarts.get(name, 0) + 1
            log.warning("MCP server %s stopped; starting it again", name)
        config = self.servers.get(name)
        if config is None:
            raise McpError(f'No MCP server "{name}" is configured: add it to {CONFIG_NAME}.')
        if config.runs_a_command and not self.allow_commands:
            raise McpError(
                f'MCP server "{name}" runs a command on this computer, and this Pagoda is open to other computers '
                "(--listen or --share): start Pagoda without them to use it."
            )
        ready: asyncio.Future = self._loop.create_future()
        stop = asyncio.Event()
        task = self._loop.create_task(self._hold(config, ready, stop), name=f"mcp-{name}")
        try:
            client = await asyncio.wait_for(asyncio.shield(ready), START_TIMEOUT_S)
        except asyncio.TimeoutError:
            stop.set()
            task.cancel()
            raise McpError(f'MCP server "{name}" did not start within {START_TIMEOUT_S:.0f} s.') from None
        except Exception as e:
            raise McpError(f'MCP server "{name}" could not be started: {describe(e)}') from None
        running = _Running(client, stop, task)
        try:
            listed = await client.list_tools()
        except Exception as e:
            stop.set()
            self._retired.append(task)
            raise McpError(f'MCP server "{name}" started but did not list its tools: {describe(e)}') from None
        running.tools = [
            ToolInfo(name, t.name, t.description or "", dict(t.input_schema or {"type": "object"}))
            for t in listed.tools
        ]
        self._running[name] = running
        return running

    async def _hold(self, config: McpServerConfig, ready: asyncio.Future, stop: asyncio.Event) -> None:
        """Open the server's connection, hand its client over, and keep it open until `stop` (the SDK's clients are
        entered and left in one task)."""
        from mcp import Client

        errlog = None
        if config.command is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            errlog = open(self.log_dir / f"mcp-{config.name}.log", "a", encoding="utf-8")  # noqa: SIM115
        try:
            async with Client(self._transport(config, errlog), read_timeout_seconds=None) as client:
                ready.set_result(client)
                await stop.wait()
        except BaseException as e:
            if not ready.done():
                ready.set_exception(e if isinstance(e, Exception) else McpError(str(e)))
            elif not isinstance(e, asyncio.CancelledError):
                log.warning("MCP server %s: %s", config.name, describe(e))
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            if errlog is not None:
                errlog.close()

    def _transport(self, config: McpServerConfig, errlog):
        if config.url is not None:
            import httpx2
            from mcp.client.streamable_http import streamable_http_client

            http = httpx2.AsyncClient(headers=dict(config.headers), timeout=httpx2.Timeout(30.0, read=300.0))
            return streamable_http_client(config.url, http_client=http)
        from mcp.client.stdio import StdioServerParameters, stdio_client

        params = StdioServerParameters(command=config.command, args=list(config.args), env=dict(config.env) or None)
        return stdio_client(params, errlog=errlog)

    async def _call(self, server: str, tool: str, arguments: dict, timeout: float) -> ToolResult:
        running = await self._connected(server)
        try:
            result = await asyncio.wait_for(running.client.call_tool(tool, arguments), timeout)
        except asyncio.TimeoutError:
            raise McpError(f"{server}.{tool} did not finish within {timeout:g} s.") from None
        except Exception as e:
            from mcp.shared.exceptions import MCPError

            if isinstance(e, MCPError) and e.error.code != CONNECTION_CLOSED:  # the server refused the call itself
                return ToolResult(f"{server}.{tool} failed: {e.error.message}", is_error=True)
            # The connection broke (the server crashed): the next call starts it again
            running.stop.set()
            if self._running.get(server) is running:
                del self._running[server]
                self._retired = [t for t in self._retired if not t.done()] + [running.task]
                self._failed.add(server)
            raise McpError(
                f'MCP server "{server}" failed during {tool}: {describe(e)}. It starts again at the next call.'
            ) from None
        texts, others = [], []
        for part in result.content:
            if getattr(part, "type", None) == "text":
                texts.append(part.text)
            else:
                others.append(getattr(part, "type", "part"))
        text = "\n".join(texts) + (f"\n[{', '.join(others)} not shown]" if others else "")
        return ToolResult(text, bool(result.is_error), result.structured_content)

    async def _stop_all(self) -> None:
        for running in self._running.values():
            running.stop.set()
        tasks = [r.task for r in self._running.values()] + self._retired
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=10)
            for task in pending:
                task.cancel()
        self._running.clear()


def describe(error: BaseException) -> str:
    """An error as one line; the SDK's task groups wrap the one that matters."""
    while getattr(error, "exceptions", None):  # an ExceptionGroup
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
