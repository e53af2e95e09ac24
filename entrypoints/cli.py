"""Pagoda's engine as a headless OpenAI-compatible server, and the API-key rule the app shares.

    python -m engine.serve --model PATH_OR_REPO [--host 127.0.0.1] [--port 8000] [--api-key KEY]
                           [--allowed-hosts NAMES] [--cors-origins ORIGINS] [--default-max-tokens N]
                           [--max-request-bytes N]

Serves /v1/chat/completions, /v1/completions, /v1/models and /metrics. Listening beyond
localhost needs an API key: give one, or one is generated and printed. Requests for another Host
or from another site's page are refused (entrypoints/http_guard.py). The engine's settings
are flags made from EngineConfig's fields (`--max-num-seqs`, `--kvcache-block-size`, ...), so a
new setting is a flag without being listed here.
"""

import argparse
import json
import logging
import os
import re
import secrets
import socket
import sys
import types
from dataclasses import MISSING, fields
from pathlib import Path

from engine.config import EngineConfig
from entrypoints.http_guard import AccessPolicy, add_access_options
from entrypoints.openai.limits import DEFAULT_MAX_TOKENS, MAX_REQUEST_BYTES

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
# Where the headless server's defaults differ from the engine's: fewer sequence slots (a GPU
# captures a decode graph per batch size up to this many).
SERVE_DEFAULTS = {"max_num_seqs": 64}


def json_object(text: str) -> dict:
    """A flag's JSON object, e.g. --speculative-config '{"method": "ngram"}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f'not JSON ({e}); give an object such as \'{{"method": "ngram"}}\'') from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f'give a JSON object such as \'{{"method": "ngram"}}\', not {text!r}')
    return value


def add_engine_settings(ap: argparse.ArgumentParser, defaults: dict | None = None) -> list[str]:
    """One flag per EngineConfig field (`max_num_seqs` becomes `--max-num-seqs`), with the field's help.
    Flags not given stay out of the namespace, so the engine's own defaults apply. Returns the field names."""
    defaults = defaults or {}
    group = ap.add_argument_group("engine settings (see engine/config.py)")
    names = []
    for f in fields(EngineConfig):
        if f.name in ("model", "runner"):  # an embedding model is served beside the chat one: --embedding-model
            continue
        default = defaults.get(f.name, f.default if f.default is not MISSING else None)
        kinds = set(f.type.__args__) - {type(None)} if isinstance(f.type, types.UnionType) else {f.type}
        (kind,) = kinds
        help_text = f.metadata.get("help", "")
        if "default" not in help_text:  # the ones whose default depends on the machine say so themselves
            help_text += f" (default: {default})"
        extra: dict = {"help": help_text}
        if kind is bool:
            extra["action"] = argparse.BooleanOptionalAction
        else:
            extra["type"] = json_object if kind is dict else kind
            if f.metadata.get("choices"):
                extra["choices"] = f.metadata["choices"]
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=argparse.SUPPRESS, **extra)
        names.append(f.name)
    ap.set_defaults(**defaults)
    return names


def add_api_options(ap: argparse.ArgumentParser) -> None:
    """The API's limits, shared by the headless server and the app; `check_api_options` checks them."""
    ap.add_argument(
        "--default-max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        metavar="N",
        help="tokens an API request without max_tokens may generate, at most (default "
        f"{DEFAULT_MAX_TOKENS}; 0: the rest of the context)",
    )
    ap.add_argument(
        "--max-request-bytes",
        type=int,
        default=MAX_REQUEST_BYTES,
        metavar="N",
        help=f"larger API request bodies are refused with a 413 (default {MAX_REQUEST_BYTES:,})",
    )

    ap.add_argument(
        "--embedding-model",
        metavar="MODEL",
        help="an embedding model (folder, GGUF file or hub repo id, such as Qwen/Qwen3-Embedding-0.6B) served beside "
        "the chat model for /v1/embeddings and /api/embed",
    )


def memory_size(text: str) -> int:
    """Bytes from "12GiB", "512MiB", "8G" or a plain number of bytes (K, M and G are powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?\s*", text.lower())
    if match is None or float(match[1]) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give one such as 12GiB, 512MiB or 8G")
    return int(float(match[1]) * 1024 ** " kmg".index(match[2] or " "))


def check_api_options(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.default_max_tokens < 0:
        ap.error("--default-max-tokens must be 0 (the rest of the context) or more")
    if args.max_request_bytes < 1024:
        ap.error("--max-request-bytes must be at least 1024")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m engine.serve", description="Pagoda's engine behind an OpenAI-compatible API."
    )
    ap.add_argument(
        "--model",
        action="append",
        help="a local Hugging Face model folder, GGUF file or hub repo id (default: the bundled "
        "SmolLM2-135M-Instruct). Give it again for more models served by name: the first loads at start, the "
        "others when a request names them",
    )
    ap.add_argument(
        "--ttl",
        type=float,
        metavar="SECONDS",
        help="with several --model: unload a model other than the first after it has been idle this long "
        "(default: never)",
    )
    ap.add_argument(
        "--memory-budget",
        type=memory_size,
        metavar="SIZE",
        help="with several --model: what the loaded models may hold together, weights and KV caches (such as "
        "12GiB; default: no bound but the machine's free memory)",
    )
    ap.add_argument("--served-model-name", help="the model id clients send (default: the folder or repo name)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument(
        "--api-key",
        default=os.environ.get("PAGODA_API_KEY"),
        help="key every /v1 request must send as a Bearer token (env PAGODA_API_KEY); "
        "required, and generated if absent, when --host is not local",
    )
    add_access_options(ap)
    add_api_options(ap)
    ap.add_argument(
        "--shutdown-grace",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="on Ctrl+C or SIGTERM, how long running requests may finish before they are aborted (default 5)",
    )
    ap.add_argument("--debug", action="store_true", help="show the traceback when the model cannot be loaded")
    names = add_engine_settings(ap, SERVE_DEFAULTS)
    args = ap.parse_args(argv)
    check_api_options(ap, args)
    args.engine_settings = {name: getattr(args, name) for name in names if hasattr(args, name)}
    return args


def resolve_api_key(api_key: str | None, exposed: bool) -> str | None:
    """The key /v1 wants. Reachable beyond this machine, there is always one: the given key or a new one, printed."""
    if api_key or not exposed:
        return api_key or None
    api_key = "pagoda-" + secrets.token_urlsafe(24)
    print(
        "The API is reachable from other machines, so every /v1 request needs this key "
        f"(pass --api-key to choose your own):\n  {api_key}",
        flush=True,
    )
    return api_key


def default_model(model: str | None) -> tuple[str, str]:
    """(what to load, the name to show): the given folder, file or repo id, else the bundled model's
    GGUF file, served as it is."""
    if model:
        return model, Path(model.rstrip("/")).name or model
    from engine.loader.bundled import MODEL_NAME, bundled_gguf_path

    return str(bundled_gguf_path()), MODEL_NAME


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a busy port is said at once, and "Serving"
    is printed only once the server can answer."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections wait in the kernel's queue until uvicorn accepts them
    except OSError as e:
        sock.close()
        raise SystemExit(
            f"Cannot listen on {host}:{port} ({e.strerror}). Is another server running there? Pass another --port."
        ) from None
    return sock


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    exposed = args.host not in LOCAL_HOSTS
    api_key = resolve_api_key(args.api_key, exposed=exposed)
    import uvicorn

    from entrypoints.embeddings import load_embedder
    from entrypoints.graceful_server import GracefulServer
    from entrypoints.model_registry import ModelRegistry
    from entrypoints.openai.errors import APIError
    from entrypoints.openai.server import create_app

    sock = bind(args.host, args.port)
    models = served_models(args)
    registry = ModelRegistry(models, {**args.engine_settings}, args.ttl, args.memory_budget)
    model, embedder = next(iter(models.values())), None
    try:
        registry.start()  # the first model, now; the others when a request names them
        if args.embedding_model:
            model = args.embedding_model
            embedder = load_embedder(model, args.engine_settings)
    except Exception as e:
        registry.shutdown()
        if args.debug:
            raise
        sock.close()
        why = e.__cause__ or e.message if isinstance(e, APIError) else e  # a load's own error, as the engine said it
        print(f"Cannot load {model}: {why}\n(--debug shows the traceback)", file=sys.stderr, flush=True)
        return 1
    policy = AccessPolicy.for_bind(args.host, args.allowed_hosts, args.cors_origins)
    app = create_app(
        registry, None, api_key, policy, args.default_max_tokens or None, args.max_request_bytes, exposed, embedder
    )
    engine = registry.entries[registry.default].engine
    server = GracefulServer(uvicorn.Config(app, log_level="warning"), engine, args.shutdown_grace)
    names = ", ".join(models) + (f", and {embedder.name} for embeddings" if embedder else "")
    print(f"Serving {names} at http://{args.host}:{args.port}/v1 (OpenAI-compatible)", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        registry.shutdown()
    return 0


def served_models(args: argparse.Namespace) -> dict[str, str]:
    """Name -> what loads it, for every --model (the first is the default, named by --served-model-name);
    the bundled model when none is given."""
    given = args.model or [None]
    models: dict[str, str] = {}
    for i, asked in enumerate(given):
        source, name = default_model(asked)
        name = args.served_model_name or name if i == 0 else name
        if name in models:
            raise SystemExit(f"two --model give the name {name!r}; serve each model once")
        models[name] = source
    return models


if __name__ == "__main__":
    sys.exit(main())
