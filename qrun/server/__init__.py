"""An OpenAI-compatible HTTP server over one shared AsyncLLM (`qrun serve`, `python -m qrun.server`).

Every HTTP request becomes one engine request per prompt, so concurrent clients are batched
continuously by the engine. Endpoints: /v1/models, /v1/completions, /v1/chat/completions
(streaming as server-sent events or not), /health and /metrics (Prometheus text format).

One concern a module: `protocol` (request bodies, OpenAI's error shape), `job` (one request's
engine work), `render` (response bodies and server-sent events), `metrics` (Prometheus), `app`
(admission, running jobs, the routes), `command` (the command line).
"""

from qrun.server.app import build_app
from qrun.server.command import add_serve_arguments, main, run_serve

__all__ = ["add_serve_arguments", "build_app", "main", "run_serve"]
