"""uvicorn's server with a shutdown that lets replies end with a last word.

On Ctrl+C or SIGTERM the replies still running may finish for `grace` seconds; then each that has not ends with an
event a client can read (a 503 error, then `[DONE]`; a whole reply gets the 503) instead of a cut connection.
uvicorn cancels what still runs a moment later: a client that reads nothing back cannot hold the shutdown.
"""

import asyncio
import socket

import uvicorn

from engine import EngineThread
from entrypoints.openai.reply import ServerStopping

# How long, after the grace period has ended the replies still running, their last events have to go out
LAST_WORDS_SECONDS = 2.0


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: EngineThread, grace: float):
        config.timeout_graceful_shutdown = grace + LAST_WORDS_SECONDS
        super().__init__(config)
        self.engine, self.grace = engine, grace

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        ending = asyncio.get_running_loop().call_later(self.grace, self.engine.abort_all, ServerStopping())
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()
