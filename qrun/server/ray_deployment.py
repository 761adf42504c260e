"""`qrun serve --replicas N`: qrun's HTTP app (`build_app`, the same routes and answers as one
process) as a Ray Serve deployment, one engine per replica, behind Serve's HTTP proxy, which
spreads requests over the replicas.

    from ray import serve
    from qrun.server.ray_deployment import qrun_application

    serve.run(qrun_application("smollm2-135m", max_num_seqs=64, app_args={"api_key": "KEY"}, deployment_options={
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 8}, "ray_actor_options": {"num_gpus": 1}}))
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray import serve
from ray.serve.deployment import Application

from qrun.async_llm import AsyncLLM
from qrun.llm_engine import EngineConfig
from qrun.replicas import ReplicaSpec, connect, gpus_per_replica, model_for_replicas, replicas_failed
from qrun.server.app import DEFAULT_MAX_QUEUE, build_app

log = logging.getLogger("qrun.server")

APP_NAME = "qrun"
# Every answer names the replica that gave it, so a client can see how requests spread.
REPLICA_HEADER = "x-qrun-replica"


class ReplicaHeader:
    """ASGI middleware: adds REPLICA_HEADER to every HTTP response."""

    def __init__(self, app: Any, replica_id: str):
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica_id.encode())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


@serve.deployment
@serve.ingress()
class QrunDeployment:
    """One AsyncLLM and build_app's routes per replica. `app_args` are build_app's keyword
    arguments (api_key, max_queue, model_name, ...); `engine_args` EngineConfig's fields."""

    def __init__(self, model: str, app_args: dict[str, Any] | None = None, **engine_args: Any):
        self.llm = AsyncLLM(model, **engine_args)
        self.app_args = dict(app_args or {})

    def __serve_build_asgi_app__(self) -> Any:
        app = build_app(self.llm, **self.app_args)
        app.add_middleware(ReplicaHeader, replica_id=serve.get_replica_context().replica_id.unique_id)
        return app

    def __del__(self) -> None:
        if hasattr(self, "llm"):  # not if the constructor failed before the engine existed
            self.llm.shutdown()


def qrun_application(model: str, *, app_args: dict[str, Any] | None = None,
                     deployment_options: dict[str, Any] | None = None, **engine_args: Any) -> Application:
    """QrunDeployment serving `model`, for serve.run. `deployment_options` are Serve's
    (num_replicas, autoscaling_config, ray_actor_options, ...)."""
    slots = EngineConfig(model=model, **engine_args).max_num_seqs  # checks the engine args before replicas start
    max_queue = (app_args or {}).get("max_queue", DEFAULT_MAX_QUEUE)
    # Serve's default would hold each engine to 5 requests at a time. A replica admits what one
    # `qrun serve` admits, and one request more, so that one gets the server's own 429.
    options = {"max_ongoing_requests": slots + max_queue + 1, **(deployment_options or {})}
    return QrunDeployment.options(**options).bind(model, app_args, **engine_args)


def serve_on_ray(model: str, engine_args: dict[str, Any], app_args: dict[str, Any], replicas: ReplicaSpec,
                 host: str, port: int) -> int:
    """`qrun serve` with replicas on Ray, on host:port until interrupted."""
    ray = connect(replicas)
    application = qrun_application(
        model_for_replicas(model), app_args=app_args,
        deployment_options={"num_replicas": replicas.count, "ray_actor_options": {
            "num_cpus": replicas.cpus, "num_gpus": gpus_per_replica(replicas, ray)}},
        **engine_args)
    serve.start(http_options={"host": host, "port": port})
    try:
        try:
            serve.run(application, name=APP_NAME, route_prefix="/")  # returns once every replica is up
        except RuntimeError as err:  # it says only that the deployment failed; its status says why
            status = serve.status().applications.get(APP_NAME)
            serve.delete(APP_NAME)
            raise replicas_failed("\n".join(d.message for d in status.deployments.values()) if status
                                  else str(err)) from err
        log.info("serving %s on http://%s:%d with %d replicas", model, host, port, replicas.count)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.delete(APP_NAME)  # on a cluster of others the proxies stay, for their applications
    return 0
