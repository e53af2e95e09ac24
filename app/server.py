"""Starting the app: load the model, build the page, serve it locally, on the LAN or behind a share link."""

import argparse
import logging
import os
import secrets
import signal
import sys
import threading
import webbrowser
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

from engine.config import KV_CACHE_DTYPES
from entrypoints.cli import add_api_options, check_api_options, json_object
from entrypoints.documents import DEFAULT_MAX_FILE_MB
from entrypoints.http_guard import AccessPolicy, HTTPGuard, add_access_options

log = logging.getLogger("pagoda")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pagoda", description="Pagoda: a local chat app with its own inference engine.")
    ap.add_argument(
        "--model", help="a local Hugging Face model folder or hub repo id (default: the bundled SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--port", type=int, default=7860)
    ap.add_argument(
        "--listen",
        action="store_true",
        help="serve on the LAN (0.0.0.0), not only on 127.0.0.1; always behind a password",
    )
    ap.add_argument("--share", action="store_true", help="make a public Gradio link, always behind a password")
    ap.add_argument(
        "--auth",
        help="user:password required to open the page and call its API (generated and "
        "printed for --listen and --share if not given)",
    )
    ap.add_argument(
        "--api-key",
        default=os.environ.get("PAGODA_API_KEY"),
        help="key for the OpenAI-compatible API under /v1 (env PAGODA_API_KEY; generated and printed when "
        "--listen or --share makes it reachable from other machines)",
    )
    ap.add_argument("--no-browser", action="store_true", help="do not open a browser tab")
    ap.add_argument("--max-chats", type=int, default=16, help="chats that can stream at once (engine sequence slots)")
    ap.add_argument(
        "--max-file-mb",
        type=float,
        default=DEFAULT_MAX_FILE_MB,
        help=f"the largest file a chat takes as an attachment, in MB (default: {DEFAULT_MAX_FILE_MB})",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        help="how the model loaded at start stores its KV cache: auto (the model's dtype), int8 or fp8 (about twice "
        "the context in the same memory), int4 (about 3.5x) (default: as that model was last loaded, else auto)",
    )
    ap.add_argument(
        "--speculative-config",
        type=json_object,
        help='speculative decoding for the model loaded at start, as vLLM takes it, e.g. \'{"method": "ngram", '
        "\"num_speculative_tokens\": 4}': guesses from the chat's own text, checked in one step; replies stay the "
        "same (on a CPU it does not pay yet: see the README) (default: off)",
    )
    add_access_options(ap)
    add_api_options(ap)
    args = ap.parse_args(argv)
    check_api_options(ap, args)
    return args


def resolve_auth(args: argparse.Namespace) -> tuple[str, str] | None:
    """The login for the page and its API. A share link is public and the LAN is other people's machines: the
    chats, their system prompts and model load/connect never go out there without one."""
    if args.auth:
        user, sep, password = args.auth.partition(":")
        if not sep or not user or not password:
            raise SystemExit("--auth takes user:password, for example --auth alice:correct-horse")
        return user, password
    if args.share or args.listen:
        user, password = "pagoda", secrets.token_urlsafe(12)
        where = "Share link" if args.share else "LAN"
        print(f"{where} login (generated; pass --auth user:pass to choose your own): {user} / {password}", flush=True)
        return user, password
    return None


def guarded(policy: AccessPolicy) -> dict:
    """launch()'s app_kwargs that put HTTPGuard in front of all Gradio serves: the page, its API and /v1.

    Gradio adds its own middleware (a CORS one that answers any origin on a LAN address) outside any given to it,
    and builds the stack as the server starts. So the guard wraps the built stack in the app's lifespan, which
    runs before the server accepts its first connection."""

    from entrypoints.openai.request_log import RequestLog
    from entrypoints.openai.server import add_api_error_handlers

    @asynccontextmanager
    async def lifespan(app):
        # /v1's unknown paths and methods in OpenAI's error shape, as engine.serve answers them; the stack is built
        # afresh so that its exception middleware takes the handler
        add_api_error_handlers(app)
        stack = RequestLog(app.build_middleware_stack(), paths=("/v1",))
        app.middleware_stack = HTTPGuard(stack, policy)
        yield

    return {"lifespan": lifespan}


# How long a model an API request loaded beside the chats' model stays loaded when no request names it
# (LM Studio keeps such JIT-loaded models 60 minutes, Ollama 5): a laptop wants its memory back sooner.
API_MODEL_TTL = 600.0


def downloaded() -> dict[str, str]:
    """The models downloaded from the Models tab, by repo id: what an API request may name."""
    from app.download_jobs import DownloadManager

    return {m.repo_id: str(m.load_path) for m in DownloadManager().local_models()}


def serve_openai_api(
    demo, host, api_key: str | None, default_max_tokens: int | None, max_request_bytes: int, embedders=None
) -> None:
    """The engine's OpenAI-compatible API on the app's own port, so API calls and chats share one batch.
    `embedders`: the embedding model's source (entrypoints/embeddings.py), if one was asked for."""
    from entrypoints.anthropic.router import create_router as create_anthropic_router
    from entrypoints.model_registry import ModelRegistry
    from entrypoints.ollama.router import create_router as create_ollama_router
    from entrypoints.openai.api_router import create_router
    from entrypoints.openai.errors import APIError
    from entrypoints.openai.server import create_metrics_router
    from entrypoints.openai.serving import ServedModel
    from entrypoints.responses.router import create_router as create_responses_router

    def served() -> ServedModel | None:
        backend, engine = host.backend, host.engine
        if backend is not None and engine is None:  # only the embedded engine answers /v1
            raise APIError(
                503,
                f"Pagoda's chats are served by the remote server {backend.url} right now; "
                "send API requests to that server",
                type="server_error",
                code="model_not_loaded",
            )
        if engine is None and host.state.status == "loading":
            raise APIError(
                503,
                f"Loading {host.state.label}; try again when it is ready",
                type="server_error",
                code="model_not_loaded",
            )
        return ServedModel(engine, host.label) if engine is not None else None

    # The chats' model, and beside it any downloaded model a request names, loaded then and unloaded when idle
    models = ModelRegistry({}, {}, ttl=API_MODEL_TTL, pinned=served, discover=downloaded).start()
    # Gradio has already built its FastAPI app; routes added now are matched like its own.
    demo.server_app.include_router(
        create_router(models, api_key, default_max_tokens, max_request_bytes, embedders=embedders)
    )
    demo.server_app.include_router(create_responses_router(models, api_key, default_max_tokens, max_request_bytes))
    demo.server_app.include_router(create_anthropic_router(models, api_key, max_request_bytes))
    demo.server_app.include_router(
        create_ollama_router(models, api_key, default_max_tokens, max_request_bytes, embedders=embedders)
    )
    demo.server_app.include_router(create_metrics_router(models))
    log.info("OpenAI-compatible API at %s/v1%s", demo.local_url.rstrip("/"), " (API key required)" if api_key else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    auth = resolve_auth(args)
    from entrypoints.cli import resolve_api_key

    api_key = resolve_api_key(args.api_key, exposed=args.listen or args.share)

    from app.download_jobs import DownloadManager
    from app.last_model import LastModel, load_at_start
    from app.model_host import ModelHost
    from app.page.layout import build, launch_kwargs
    from app.page.models_tab import render_models_tab
    from app.store import ConversationStore, default_db_path
    from app.ui import PagodaUI

    store = ConversationStore(default_db_path())
    last_model = LastModel(store)
    host = ModelHost(remember=last_model.remember)
    downloaded = {m.repo_id: m.load_path for m in DownloadManager().local_models()}
    load_at_start(
        host, last_model, args.model, downloaded, args.max_chats, args.kv_cache_dtype, args.speculative_config
    )
    from app.mcp_servers import CONFIG_NAME

    ui = PagodaUI(
        store,
        host,
        max_concurrent_chats=args.max_chats,
        max_file_mb=args.max_file_mb,
        mcp_config=default_db_path().parent / CONFIG_NAME,
        # A page from another computer must not make this one run programs: stdio servers are off then
        mcp_commands_allowed=not (args.listen or args.share),
    )
    demo = build(ui, models_tab=render_models_tab)
    demo.queue(default_concurrency_limit=4)
    bind = "0.0.0.0" if args.listen else "127.0.0.1"
    policy = AccessPolicy.for_bind(bind, args.allowed_hosts, args.cors_origins)
    # No static-file workers (GRADIO_NUM_WORKERS) and no Node front (GRADIO_SSR_MODE): both would answer on
    # ports of their own, outside the guard.
    os.environ.pop("GRADIO_NUM_WORKERS", None)
    demo.launch(
        server_name=bind,
        server_port=args.port,
        share=args.share,
        auth=auth,
        prevent_thread_lock=True,
        show_error=True,
        app_kwargs=guarded(policy),
        ssr_mode=False,
        **launch_kwargs(),
    )
    if not isinstance(demo.server_app.middleware_stack, HTTPGuard):
        demo.close()
        host.unload()
        store.close()
        raise SystemExit(
            "Pagoda's Host and Origin checks did not install in front of Gradio's app (a Gradio "
            "version that builds its app differently?); not serving without them"
        )
    if getattr(demo, "share_url", None):
        policy.allow_host(urlsplit(demo.share_url).hostname)
    embedders = None
    if args.embedding_model:
        from entrypoints.embeddings import EmbedderLoad

        embedders = EmbedderLoad(args.embedding_model, {})
    serve_openai_api(demo, host, api_key, args.default_max_tokens or None, args.max_request_bytes, embedders)
    if not args.no_browser:  # opened here rather than by launch(), once the share link's host is allowed
        webbrowser.open(demo.share_url or demo.local_url)
    if args.share and not getattr(demo, "share_url", None):
        print(
            "Could not create the share link: Gradio's tunnel helper (frpc) is missing and could not be downloaded, "
            "or the share server is unreachable. Pagoda keeps running locally at "
            f"http://127.0.0.1:{args.port}.",
            flush=True,
        )
    wait_for_stop_signal(demo)
    # Ctrl-C or a SIGTERM: the replies streaming now are kept as interrupted, not marked "stopped" as if the user
    # had pressed Stop, and Pagoda exits within seconds. Gradio's own close is skipped: it waits up to 5 s for the
    # pages' open connections, which end with the process anyway.
    log.info("Shutting down: replies still being written are kept as interrupted.")
    ui.interrupt_replies()
    ui.close_tools()
    host.unload()
    store.close()
    return 0


def wait_for_stop_signal(demo) -> None:
    """Serve until Ctrl-C (SIGINT) or SIGTERM. A second one during the shutdown that follows ends it at once."""
    stop = threading.Event()
    handlers = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        while demo.is_running and not stop.wait(0.2):
            pass
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
