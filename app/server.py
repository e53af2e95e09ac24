"""Starting the app: load the model, build the page, serve it locally, on the LAN or behind a share link."""
import argparse
import logging
import os
import secrets
import sys

log = logging.getLogger("pagoda")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pagoda", description="Pagoda: a local chat app with its own inference engine.")
    ap.add_argument("--model", help="a local Hugging Face model folder or hub repo id "
                                    "(default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--port", type=int, default=7860)
    ap.add_argument("--listen", action="store_true", help="serve on the LAN (0.0.0.0), not only on 127.0.0.1")
    ap.add_argument("--share", action="store_true", help="make a public Gradio link, always behind a password")
    ap.add_argument("--auth", help="user:password required to open the page (generated for --share if not given)")
    ap.add_argument("--api-key", default=os.environ.get("PAGODA_API_KEY"),
                    help="key for the OpenAI-compatible API under /v1 (env PAGODA_API_KEY; generated and printed when "
                    "--listen or --share makes it reachable from other machines)")
    ap.add_argument("--no-browser", action="store_true", help="do not open a browser tab")
    ap.add_argument("--max-chats", type=int, default=16, help="chats that can stream at once (engine sequence slots)")
    return ap.parse_args(argv)


def resolve_auth(args: argparse.Namespace) -> tuple[str, str] | None:
    """The login for the page. A share link is public, so it never goes out without one."""
    if args.auth:
        user, sep, password = args.auth.partition(":")
        if not sep or not user or not password:
            raise SystemExit("--auth takes user:password, for example --auth alice:correct-horse")
        return user, password
    if args.share:
        user, password = "pagoda", secrets.token_urlsafe(12)
        print(f"Share link login (generated; pass --auth user:pass to choose your own): {user} / {password}",
              flush=True)
        return user, password
    return None


def serve_openai_api(demo, host, api_key: str | None) -> None:
    """The engine's OpenAI-compatible API on the app's own port, so API calls and chats share one batch."""
    from entrypoints.openai.protocol import APIError
    from entrypoints.openai.server import ServedModel, create_metrics_router, create_router

    def served() -> ServedModel | None:
        backend, engine = host.backend, host.engine
        if backend is not None and engine is None:  # only the embedded engine answers /v1
            raise APIError(503, f"Pagoda's chats are served by the remote server {backend.url} right now; "
                                "send API requests to that server", type="server_error", code="model_not_loaded")
        if engine is None and host.state.status == "loading":
            raise APIError(503, f"Loading {host.state.label}; try again when it is ready", type="server_error",
                           code="model_not_loaded")
        return ServedModel(engine, host.label) if engine is not None else None

    # Gradio has already built its FastAPI app; routes added now are matched like its own.
    demo.server_app.include_router(create_router(served, api_key))
    demo.server_app.include_router(create_metrics_router(served))
    log.info("OpenAI-compatible API at %s/v1%s", demo.local_url.rstrip("/"), " (API key required)" if api_key else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    auth = resolve_auth(args)
    from entrypoints.cli import resolve_api_key

    api_key = resolve_api_key(args.api_key, exposed=args.listen or args.share)

    from app.model_host import ModelHost
    from app.page.models_tab import render_models_tab
    from app.store import ConversationStore, default_db_path
    from app.ui import PagodaUI, build, launch_kwargs

    store = ConversationStore(default_db_path())
    host = ModelHost()
    host.load_default(args.model, max_num_seqs=args.max_chats)
    ui = PagodaUI(store, host, max_concurrent_chats=args.max_chats)
    demo = build(ui, models_tab=render_models_tab)
    demo.queue(default_concurrency_limit=4)
    demo.launch(server_name="0.0.0.0" if args.listen else "127.0.0.1", server_port=args.port, share=args.share,
                auth=auth, inbrowser=not args.no_browser, prevent_thread_lock=True, show_error=True, **launch_kwargs())
    serve_openai_api(demo, host, api_key)
    if args.share and not getattr(demo, "share_url", None):
        print("Could not create the share link: Gradio's tunnel helper (frpc) is missing and could not be downloaded, "
              "or the share server is unreachable. Pagoda keeps running locally at "
              f"http://127.0.0.1:{args.port}.", flush=True)
    try:
        demo.block_thread()
    except KeyboardInterrupt:
        pass
    finally:
        host.unload()
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
