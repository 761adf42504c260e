"""`qrun serve`: its arguments, and serving a model with uvicorn until interrupted."""

from __future__ import annotations

import argparse
import logging

from qrun.async_llm import AsyncLLM
from qrun.errors import QrunError
from qrun.options import add_engine_arguments, engine_args_from
from qrun.server.app import DEFAULT_MAX_QUEUE, build_app


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model folder, .gguf file, alias or hub id")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    parser.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                        help="requests that may wait for an engine slot before new ones get 429")
    parser.add_argument("--served-model-name", default=None, help="model id reported by the API")
    add_engine_arguments(parser)
    parser.add_argument("--log-level", default="info")


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_queue < 0:
        raise QrunError(f"--max-queue={args.max_queue} must be >= 0")
    llm = AsyncLLM(args.model, **engine_args_from(args))
    try:
        app = build_app(llm, api_key=args.api_key, max_queue=args.max_queue,
                        model_name=args.served_model_name or str(args.model))
        # Our own per-request log line replaces uvicorn's access log.
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    finally:
        llm.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qrun serve", description="serve an OpenAI-compatible HTTP API")
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))

