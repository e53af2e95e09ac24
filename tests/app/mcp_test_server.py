"""An MCP server for the tests, written with the `mcp` SDK (its MCPServer, the FastMCP of SDK 1.x): a calculator,
a reader of files in one folder, a tool that crashes the server, one that takes its time and one that hangs.

    python tests/app/mcp_test_server.py FOLDER [PORT]    # stdio, or Streamable HTTP on PORT
"""

import os
import sys
import time
from pathlib import Path

from mcp.server.mcpserver import MCPServer

folder = Path(sys.argv[1])
server = MCPServer("pagoda-test")


@server.tool()
def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


@server.tool()
def read_file(name: str) -> str:
    """Read a text file from the test folder."""
    path = (folder / name).resolve()
    if folder.resolve() not in path.parents:
        raise ValueError(f"{name} is outside the folder")
    return path.read_text()


@server.tool()
def crash() -> str:
    """End the server's process at once, as a crash would."""
    print("crashing now", file=sys.stderr, flush=True)
    os._exit(3)


@server.tool()
def slow(seconds: float) -> str:
    """Answer after `seconds`."""
    time.sleep(seconds)
    return "done"


PARENT = os.getppid()


@server.tool()
def wait_for_ever() -> str:
    """Never answer (a tool that hangs), for as long as the app that started the server lives: a test's app killed
    outright leaves no server behind, sleeping an hour."""
    while os.getppid() == PARENT:
        time.sleep(0.2)
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) > 2:
        server.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
