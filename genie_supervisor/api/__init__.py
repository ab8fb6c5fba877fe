"""The HTTP API: an app factory (`server.create_app`) and routers, one module per concern.

`ops` holds the operations routes (/health, /status, /v1/voice/events); the OpenAI-compatible
routes live in their own modules and are added with ``app.include_router`` in `create_app`.
"""

from .server import HttpServer, create_app, error_response

__all__ = ["HttpServer", "create_app", "error_response"]
