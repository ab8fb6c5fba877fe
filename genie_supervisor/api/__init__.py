"""The HTTP API: an app factory (`server.create_app`, given an `ApiDeps`) and routers, one module per concern.

`ops` (/health, /status, /v1/voice/events), `openai_routes` (/v1/chat/completions,
/v1/completions, /v1/models), `llama_routes` (/completion), `manage` (/running, /unload,
/metrics). `schemas` validates request bodies, `generation` runs a request through admission,
the model manager and a backend while watching the client, `metrics` is the Prometheus collector.
"""

from .deps import ApiDeps
from .server import HttpServer, create_app, error_response

__all__ = ["ApiDeps", "HttpServer", "create_app", "error_response"]
