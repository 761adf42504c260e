"""`qrun serve`: its arguments, and serving a model with uvicorn until interrupted."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from typing import Any
from urllib.parse import urlsplit

from qrun.async_llm import AsyncLLM
from qrun.errors import QrunError
from qrun.options import add_engine_arguments, engine_args_from
from qrun.replicas import ReplicaSpec, add_replica_arguments
from qrun.server.app import DEFAULT_MAX_QUEUE, build_app

log = logging.getLogger("qrun.server")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model folder, .gguf file, alias or hub id")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: loopback only; 0.0.0.0 or :: for every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("QRUN_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $QRUN_API_KEY, "
                             "which keeps the key out of the process list)")
    parser.add_argument("--cors-origins", type=cors_origins, default=None, metavar="ORIGINS",
                        help="comma-separated web origins (https://app.example) whose pages may call the API "
                             "from a browser, or * for any (default: none)")
    parser.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                        help="requests that may wait for an engine slot before new ones get 429")
    parser.add_argument("--served-model-name", default=None, help="model id reported by the API")
    add_engine_arguments(parser)
    add_replica_arguments(parser)
    parser.add_argument("--log-level", default="info")


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_queue < 0:
        raise QrunError(f"--max-queue={args.max_queue} must be >= 0")
    if args.api_key is None and not _is_loopback(args.host):
        log.warning("serving on %s without an API key: anyone who can reach this address can use the model; "
                    "pass --api-key or set QRUN_API_KEY", args.host)
    replicas = ReplicaSpec.from_args(args)
    replicas.check_ray_installed()
    if replicas.on_ray:
        from qrun.server.ray_deployment import serve_on_ray

        return serve_on_ray(args.model, engine_args_from(args), app_args_from(args), replicas, args.host, args.port)
    llm = AsyncLLM(args.model, **engine_args_from(args))
    try:
        app = build_app(llm, **app_args_from(args))
        # Our own per-request log line replaces uvicorn's access log.
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    finally:
        llm.shutdown()
    return 0


def app_args_from(args: argparse.Namespace) -> dict[str, Any]:
    """build_app's keyword arguments from the flags (for one process, and for each Ray replica)."""
    return {"api_key": args.api_key, "max_queue": args.max_queue,
            "model_name": args.served_model_name or str(args.model), "cors_origins": args.cors_origins}


def cors_origins(value: str) -> list[str]:
    """--cors-origins: comma-separated origins, each * or scheme://host[:port] as browsers send them."""
    origins = [origin.strip() for origin in value.split(",") if origin.strip()]
    if not origins:
        raise argparse.ArgumentTypeError("give at least one origin, such as https://app.example")
    for origin in origins:
        parts = urlsplit(origin)
        if origin != "*" and not (parts.scheme in ("http", "https") and parts.netloc
                                  and not (parts.path or parts.query or parts.fragment)):
            raise argparse.ArgumentTypeError(f"{origin!r} is not an origin: write scheme://host[:port] as a browser "
                                             "sends it, without a path (https://app.example), or *")
    return origins


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name, which may resolve to any interface
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qrun serve", description="serve an OpenAI-compatible HTTP API")
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))

