"""MCP servers, for real: the tests' own server (tests/app/mcp_test_server.py, the `mcp` SDK's MCPServer) over stdio
and over Streamable HTTP, and a published one from PyPI (mcp-server-time), each a subprocess, reached through the
hub the app uses; and mcp.json read as Claude Desktop, LM Studio and Cursor write it."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.mcp_servers import McpError, McpHub, load_mcp_config

SERVER = str(Path(__file__).with_name("mcp_test_server.py"))

pytestmark = pytest.mark.timeout(300)


def test_mcp_json_in_the_shape_other_apps_write_it(tmp_path):
    path = tmp_path / "mcp.json"
    assert load_mcp_config(path) == {}  # none yet
    path.write_text(
        json.dumps(
            {
                "mcpServers": {
                    "files": {"command": "uvx", "args": ["mcp-server-filesystem", "/notes"], "env": {"A": "1"}},
                    "search": {"url": "https://example.com/mcp", "headers": {"Authorization": "Bearer x"}},
                }
            }
        )
    )
    servers = load_mcp_config(path)
    assert servers["files"].command == "uvx" and servers["files"].args == ("mcp-server-filesystem", "/notes")
    assert servers["files"].env == (("A", "1"),) and servers["files"].runs_a_command
    assert servers["search"].url == "https://example.com/mcp" and not servers["search"].runs_a_command
    assert servers["search"].headers == (("Authorization", "Bearer x"),)


@pytest.mark.parametrize(
    "text, says",
    [
        ("{not json", "could not be read as JSON"),
        (json.dumps({"servers": {}}), 'needs an object "mcpServers"'),
        (json.dumps({"mcpServers": {"x": {"args": []}}}), "needs a command"),
        (json.dumps({"mcpServers": {"x": {"command": "run", "args": "--all"}}}), "args must be a list of strings"),
        (json.dumps({"mcpServers": {"x": {"url": "ftp://host"}}}), "url must be an http"),
    ],
)
def test_a_bad_mcp_json_says_what_is_wrong(tmp_path, text, says):
    path = tmp_path / "mcp.json"
    path.write_text(text)
    with pytest.raises(McpError, match=says):
        load_mcp_config(path)


def hub_for(tmp_path, spec: dict) -> McpHub:
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": spec}))
    return McpHub(load_mcp_config(path), log_dir=tmp_path / "logs")


@pytest.fixture
def stdio_hub(tmp_path):
    (tmp_path / "notes.txt").write_text("The keeper is Ada.")
    hub = hub_for(tmp_path, {"test": {"command": sys.executable, "args": [SERVER, str(tmp_path)]}})
    yield hub
    hub.close()


def test_a_stdio_server_starts_on_first_use_lists_its_tools_and_runs_them(stdio_hub, tmp_path, capfd):
    tools = {t.name: t for t in stdio_hub.tools("test")}
    assert set(tools) == {"add", "read_file", "crash", "slow", "wait_for_ever"}
    assert tools["add"].description == "Add two numbers."
    assert tools["add"].input_schema["required"] == ["a", "b"]
    assert stdio_hub.call("test", "add", {"a": 2, "b": 3}).text == "5.0"
    assert stdio_hub.call("test", "read_file", {"name": "notes.txt"}).text == "The keeper is Ada."
    refused = stdio_hub.call("test", "read_file", {"name": "../../etc/passwd"})
    assert refused.is_error  # the tool's own error, for the model to see
    assert "crashing" not in capfd.readouterr().err  # nothing of the server's on the app's stderr


def test_a_server_that_crashes_mid_call_says_so_and_starts_again(stdio_hub, tmp_path):
    stdio_hub.tools("test")
    with pytest.raises(McpError, match='MCP server "test" failed during crash.*starts again at the next call'):
        stdio_hub.call("test", "crash", {}, timeout=30)
    assert stdio_hub.call("test", "add", {"a": 1, "b": 1}).text == "2.0"
    assert stdio_hub.restarts == {"test": 1}
    assert "crashing now" in (tmp_path / "logs" / "mcp-test.log").read_text()  # its stderr went to the log


def test_closing_the_hub_ends_the_servers_processes(tmp_path):
    import psutil

    hub = hub_for(tmp_path, {"test": {"command": sys.executable, "args": [SERVER, str(tmp_path)]}})
    hub.tools("test")

    def servers() -> list:
        return [p for p in psutil.Process().children(recursive=True) if SERVER in " ".join(p.cmdline())]

    assert len(servers()) == 1
    hub.close()
    deadline = time.time() + 20
    while servers() and time.time() < deadline:
        time.sleep(0.1)
    assert servers() == []


def test_a_call_the_server_refuses_is_the_tools_error_and_the_server_stays(stdio_hub):
    refused = stdio_hub.call("test", "no_such_tool", {})
    assert refused.is_error and "no_such_tool" in refused.text  # as the server says it
    assert stdio_hub.call("test", "add", {"a": 1, "b": 2}).text == "3.0" and stdio_hub.restarts == {}


def test_two_first_uses_at_once_start_one_server(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    import psutil

    hub = hub_for(tmp_path, {"test": {"command": sys.executable, "args": [SERVER, str(tmp_path)]}})
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda n: hub.call("test", "add", {"a": n, "b": 0}).text, range(4)))
        assert answers == ["0.0", "1.0", "2.0", "3.0"]
        servers = [p for p in psutil.Process().children(recursive=True) if SERVER in " ".join(p.cmdline())]
        assert len(servers) == 1
    finally:
        hub.close()


def test_a_tool_that_takes_too_long_is_given_up_on_and_the_server_stays(stdio_hub):
    with pytest.raises(McpError, match=r"test\.slow did not finish within 0\.5 s"):
        stdio_hub.call("test", "slow", {"seconds": 5}, timeout=0.5)
    assert stdio_hub.call("test", "add", {"a": 1, "b": 2}).text == "3.0"


def test_an_unknown_server_or_a_command_that_is_not_there_says_so(tmp_path):
    hub = hub_for(tmp_path, {"gone": {"command": str(tmp_path / "no-such-program")}})
    try:
        with pytest.raises(McpError, match='No MCP server "other" is configured'):
            hub.tools("other")
        with pytest.raises(McpError, match='MCP server "gone" could not be started'):
            hub.tools("gone")
    finally:
        hub.close()
    with pytest.raises(McpError, match="stopped with the app"):
        hub.tools("gone")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_streamable_http_server(tmp_path):
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, SERVER, str(tmp_path), str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    hub = hub_for(tmp_path, {"web": {"url": f"http://127.0.0.1:{port}/mcp", "headers": {"X-Test": "1"}}})
    try:
        deadline = time.time() + 60
        while True:  # until it listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.2)
        assert "add" in {t.name for t in hub.tools("web")}
        assert hub.call("web", "add", {"a": 20, "b": 22}).text == "42.0"
    finally:
        hub.close()
        server.kill()
        server.wait()


def test_a_published_server_from_pypi_mcp_server_time(tmp_path):
    pytest.importorskip("mcp_server_time")
    hub = hub_for(
        tmp_path, {"time": {"command": sys.executable, "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"]}}
    )
    try:
        assert "get_current_time" in {t.name for t in hub.tools("time")}
        now = json.loads(hub.call("time", "get_current_time", {"timezone": "Europe/Paris"}).text)
        assert now["timezone"] == "Europe/Paris" and now["datetime"][:4].isdigit()
    finally:
        hub.close()
