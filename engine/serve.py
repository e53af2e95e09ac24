"""Pagoda's engine as a headless OpenAI-compatible server.

    python -m engine.serve --model PATH_OR_REPO [--host 127.0.0.1] [--port 8000] [--api-key KEY]

Serves /v1/chat/completions, /v1/completions, /v1/models and /metrics. Listening beyond
localhost needs an API key: give one, or one is generated and printed.
"""
import argparse
import logging
import os
import secrets
import sys
from pathlib import Path

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m engine.serve", description="Pagoda's engine behind an OpenAI-compatible API.")
    ap.add_argument("--model", help="a local Hugging Face model folder or hub repo id (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--served-model-name", help="the model id clients send (default: the folder or repo name)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=os.environ.get("PAGODA_API_KEY"),
                    help="key every /v1 request must send as a Bearer token (env PAGODA_API_KEY); "
                         "required, and generated if absent, when --host is not local")
    engine = ap.add_argument_group("engine settings")
    engine.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    engine.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    engine.add_argument("--max-model-len", type=int)
    engine.add_argument("--max-num-seqs", type=int, default=64)
    engine.add_argument("--max-num-batched-tokens", type=int)
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--tensor-parallel-size", type=int, default=1)
    engine.add_argument("--enforce-eager", action="store_true")
    return ap.parse_args(argv)


def resolve_api_key(api_key: str | None, exposed: bool) -> str | None:
    """The key /v1 wants. Reachable beyond this machine, there is always one: the given key or a new one, printed."""
    if api_key or not exposed:
        return api_key or None
    api_key = "pagoda-" + secrets.token_urlsafe(24)
    print("The API is reachable from other machines, so every /v1 request needs this key "
          f"(pass --api-key to choose your own):\n  {api_key}", flush=True)
    return api_key


def create_app(engine, model_name: str, api_key: str | None):
    """A FastAPI app serving one EngineThread."""
    from fastapi import FastAPI

    from engine.openai_server import ServedModel, create_metrics_router, create_router

    served = ServedModel(engine, model_name)
    app = FastAPI(title="Pagoda OpenAI-compatible API")
    app.include_router(create_router(lambda: served, api_key))
    app.include_router(create_metrics_router(lambda: served))
    return app


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    api_key = resolve_api_key(args.api_key, exposed=args.host not in LOCAL_HOSTS)
    import uvicorn

    from engine import LLM, EngineThread

    if args.model:
        model, name = args.model, Path(args.model.rstrip("/")).name
    else:
        from engine.bundled import MODEL_NAME, bundled_model_path

        model, name = str(bundled_model_path()), MODEL_NAME
    settings = {"device": args.device, "dtype": args.dtype, "max_model_len": args.max_model_len,
                "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                "gpu_memory_utilization": args.gpu_memory_utilization, "enforce_eager": args.enforce_eager,
                "tensor_parallel_size": args.tensor_parallel_size}
    engine = EngineThread(LLM(model, **settings))
    name = args.served_model_name or name
    app = create_app(engine, name, api_key)
    print(f"Serving {name} at http://{args.host}:{args.port}/v1 (OpenAI-compatible)", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
