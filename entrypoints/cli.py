"""Pagoda's engine as a headless OpenAI-compatible server, and the API-key rule the app shares.

    python -m engine.serve --model PATH_OR_REPO [--host 127.0.0.1] [--port 8000] [--api-key KEY]
                           [--allowed-hosts NAMES] [--cors-origins ORIGINS] [--default-max-tokens N]

Serves /v1/chat/completions, /v1/completions, /v1/models and /metrics. Listening beyond
localhost needs an API key: give one, or one is generated and printed. Requests for another Host
or from another site's page are refused (entrypoints/http_guard.py). The engine's settings
are flags made from EngineConfig's fields (`--max-num-seqs`, `--kvcache-block-size`, ...), so a
new setting is a flag without being listed here.
"""
import argparse
import logging
import os
import secrets
import sys
import types
from dataclasses import MISSING, fields
from pathlib import Path

from engine.config import EngineConfig
from entrypoints.http_guard import AccessPolicy, add_access_options

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
# Where the headless server's defaults differ from the engine's: fewer sequence slots (a GPU
# captures a decode graph per batch size up to this many).
SERVE_DEFAULTS = {"max_num_seqs": 64}


def add_engine_settings(ap: argparse.ArgumentParser, defaults: dict | None = None) -> list[str]:
    """One flag per EngineConfig field (`max_num_seqs` becomes `--max-num-seqs`), with the field's help.
    Flags not given stay out of the namespace, so the engine's own defaults apply. Returns the field names."""
    defaults = defaults or {}
    group = ap.add_argument_group("engine settings (see engine/config.py)")
    names = []
    for f in fields(EngineConfig):
        if f.name == "model":
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
            extra["type"] = kind
            if f.metadata.get("choices"):
                extra["choices"] = f.metadata["choices"]
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=argparse.SUPPRESS, **extra)
        names.append(f.name)
    ap.set_defaults(**defaults)
    return names


def add_default_max_tokens(ap: argparse.ArgumentParser) -> None:
    from entrypoints.openai.server import DEFAULT_MAX_TOKENS

    ap.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                    help="tokens an API request without max_tokens may generate, at most (default "
                         f"{DEFAULT_MAX_TOKENS}; 0: the rest of the context)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m engine.serve",
                                 description="Pagoda's engine behind an OpenAI-compatible API.")
    ap.add_argument("--model", help="a local Hugging Face model folder or hub repo id "
                                    "(default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--served-model-name", help="the model id clients send (default: the folder or repo name)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=os.environ.get("PAGODA_API_KEY"),
                    help="key every /v1 request must send as a Bearer token (env PAGODA_API_KEY); "
                         "required, and generated if absent, when --host is not local")
    add_access_options(ap)
    add_default_max_tokens(ap)
    names = add_engine_settings(ap, SERVE_DEFAULTS)
    args = ap.parse_args(argv)
    if args.default_max_tokens < 0:
        ap.error("--default-max-tokens must be 0 (the rest of the context) or more")
    args.engine_settings = {name: getattr(args, name) for name in names if hasattr(args, name)}
    return args


def resolve_api_key(api_key: str | None, exposed: bool) -> str | None:
    """The key /v1 wants. Reachable beyond this machine, there is always one: the given key or a new one, printed."""
    if api_key or not exposed:
        return api_key or None
    api_key = "pagoda-" + secrets.token_urlsafe(24)
    print("The API is reachable from other machines, so every /v1 request needs this key "
          f"(pass --api-key to choose your own):\n  {api_key}", flush=True)
    return api_key


def default_model(model: str | None) -> tuple[str, str]:
    """(what to load, the name to show): the given folder, file or repo id, else the bundled model's
    GGUF file, served as it is."""
    if model:
        return model, Path(model.rstrip("/")).name or model
    from engine.loader.bundled import MODEL_NAME, bundled_gguf_path

    return str(bundled_gguf_path()), MODEL_NAME


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    api_key = resolve_api_key(args.api_key, exposed=args.host not in LOCAL_HOSTS)
    import uvicorn

    from engine import EngineThread
    from entrypoints.openai.server import create_app

    model, name = default_model(args.model)
    engine = EngineThread.load(model, **args.engine_settings)
    name = args.served_model_name or name
    policy = AccessPolicy.for_bind(args.host, args.allowed_hosts, args.cors_origins)
    app = create_app(engine, name, api_key, policy, args.default_max_tokens or None)
    print(f"Serving {name} at http://{args.host}:{args.port}/v1 (OpenAI-compatible)", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
