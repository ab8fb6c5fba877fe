"""Who may call the HTTP API: the API key, CORS, and the checks that keep browsers out.

    app = Guard(app, Guarded.from_config(cfg))     # the outermost ASGI layer (server.create_app)

Every request goes through, in this order (each refusal is an OpenAI-shaped JSON error):

1. **Host** (all routes): the ``Host`` header must name this daemon (loopback names, an IP address,
   the listen host, the machine's host name when listening beyond loopback, ``http.allowed_hosts``),
   else 403. A DNS-rebinding page reaches us under *its* name, so it is refused even for reads.
2. **CORS preflight** (``OPTIONS`` with ``Access-Control-Request-Method``): 204 with the allow
   headers for an origin in ``http.cors_origins``, 403 for any other. No key needed.
3. **Origin** (state-changing methods, anything but GET/HEAD/OPTIONS): a request whose ``Origin``
   is neither listed nor the daemon's own gets 403: a page elsewhere cannot unload the model.
4. **Key** (all routes but ``/health``, the web page's files ``/ui`` and ``/ui/static/...``, and
   ``/metrics`` with ``api.metrics_public``): ``Authorization: Bearer KEY`` or ``x-api-key: KEY``,
   compared in constant time; else 401 with ``WWW-Authenticate``. The page's event stream
   ``/ui/events`` also opens with ``?token=`` a short-lived token from ``POST /ui/token`` (which
   needs the key): a browser's EventSource cannot send headers (`StreamTokens`).
5. **Content type** (state-changing methods): a body declared as anything but JSON
   (``application/json``, ``application/*+json``) gets 415. A body without ``Content-Type`` is
   read as JSON (non-browser clients often omit it; a browser sending one also sends ``Origin``).

Responses to a listed origin carry ``Access-Control-Allow-Origin`` (and ``-Credentials`` unless the
list is ``"*"``). The key is never logged: only whether one is configured.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import structlog

from .server import error_response

if TYPE_CHECKING:
    from ..config import Config

log = structlog.get_logger(__name__)

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
"""Methods that change nothing: no Origin or content-type check."""
OPEN_PATHS = frozenset({"/health", "/ui"})
"""Routes served without the key (the web page holds no data: it asks for the key)."""
OPEN_PREFIXES = ("/ui/static/",)
"""Path prefixes served without the key (the page's scripts, styles and the charting library)."""
STREAM_PATH = "/ui/events"
"""The route a `StreamTokens` token opens."""
ALLOW_METHODS = "GET, POST, OPTIONS"
"""What a preflight says the API accepts."""
ALLOW_HEADERS = "Authorization, Content-Type, X-API-Key, OpenAI-Organization, OpenAI-Project, X-Stainless-*"
"""Request headers a preflight allows when the browser asks for none in particular."""
MAX_AGE_S = 600
"""How long a browser may cache a preflight answer."""
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
"""Host names that always mean this machine."""


class StreamTokens:
    """Short-lived tokens that open the web page's event stream, whose EventSource cannot send the key.

    A token is ``EXPIRY.MAC``: the expiry (Unix seconds) and its HMAC-SHA256 under a secret drawn at
    start, so nothing is stored and a restart voids every token. It opens ``/ui/events`` only, until
    it expires (an open stream stays open); the page asks ``POST /ui/token`` (with the key) for a new
    one whenever it connects."""

    def __init__(self, ttl_s: float = 60.0, *, clock: Callable[[], float] = time.time) -> None:
        self.ttl_s = ttl_s
        """Seconds a token is accepted after it was issued."""
        self._clock = clock
        self._secret = secrets.token_bytes(32)

    def _mac(self, expiry: str) -> str:
        return hmac.new(self._secret, expiry.encode("ascii"), "sha256").hexdigest()

    def issue(self) -> str:
        """A new token."""
        expiry = str(int(self._clock() + self.ttl_s))
        return f"{expiry}.{self._mac(expiry)}"

    def valid(self, token: str) -> bool:
        """Whether `token` was issued here and has not expired."""
        expiry, _, mac = token.partition(".")
        if not (expiry.isascii() and expiry.isdigit() and len(expiry) <= 12) or int(expiry) < self._clock():
            return False
        return hmac.compare_digest(mac.encode("utf-8", "replace"), self._mac(expiry).encode("ascii"))


@dataclass(frozen=True)
class Guarded:
    """What the guard enforces, from the config."""

    key: bytes | None
    """The API key (UTF-8), or None: every route is open as before."""
    cors_origins: frozenset[str]
    """Origins allowed cross-origin (lowercase, no trailing slash); ``"*"`` means any."""
    hosts: frozenset[str] | None
    """Host names accepted in ``Host`` (lowercase, no port); None accepts any."""
    metrics_public: bool = False
    """Whether ``/metrics`` is served without the key."""
    tokens: StreamTokens = field(default_factory=StreamTokens)
    """Tokens that open the web page's event stream instead of the key."""

    @classmethod
    def from_config(cls, cfg: Config, hostname: str | None = None, tokens: StreamTokens | None = None) -> Guarded:
        """The rules of `cfg`; `hostname` (default: this machine's) is accepted when listening beyond loopback."""
        from ..config import parse_hostport

        key = cfg.api.key()
        host, _port = parse_hostport(cfg.http.listen)
        host = host.lower()
        wildcard = host in ("0.0.0.0", "::")
        names: set[str] | None = set(LOOPBACK_NAMES) | set(cfg.http.allowed_hosts)
        if "*" in cfg.http.allowed_hosts or (wildcard and key is not None):
            names = None  # with a key, a rebinding page cannot authenticate: any name will do
        else:
            assert names is not None
            names.add(host)
            if not _loopback(host):
                name = (hostname if hostname is not None else socket.gethostname()).lower()
                if name:
                    names |= {name, f"{name.split('.')[0]}.local", name.split(".")[0]}
        return cls(
            key=key.encode("utf-8") if key is not None else None,
            cors_origins=frozenset(cfg.http.cors_origins),
            hosts=frozenset(names) if names is not None else None,
            metrics_public=cfg.api.metrics_public,
            tokens=tokens or StreamTokens(),
        )

    def host_ok(self, host_header: str | None) -> bool:
        """Whether a ``Host`` header names this daemon (any IP address does: rebinding needs a name)."""
        if self.hosts is None:
            return True
        if not host_header:
            return False  # HTTP/1.1 requires Host; every real client sends one
        name = _host_name(host_header)
        return name is not None and (_is_ip(name) or name.rstrip(".") in self.hosts)

    def origin_listed(self, origin: str) -> bool:
        """Whether `origin` may call the API cross-origin."""
        return "*" in self.cors_origins or origin.rstrip("/").lower() in self.cors_origins

    def key_ok(self, headers: dict[bytes, bytes]) -> bool:
        """Whether the request carries the key (Bearer or x-api-key), compared in constant time."""
        assert self.key is not None
        given = headers.get(b"x-api-key")
        auth = headers.get(b"authorization")
        if auth is not None:
            scheme, _, value = auth.strip().partition(b" ")
            if scheme.lower() == b"bearer":
                given = value.strip()
        return given is not None and hmac.compare_digest(given, self.key)

    def token_ok(self, path: str, query: bytes) -> bool:
        """Whether the request is to the event stream with a valid ``token`` in its query."""
        if path != STREAM_PATH or not query:
            return False
        given = parse_qs(query.decode("latin-1"), max_num_fields=8).get("token", [])
        return len(given) == 1 and self.tokens.valid(given[0])

    def needs_key(self, path: str) -> bool:
        """Whether `path` is served only with the key."""
        if self.key is None or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return False
        return not (self.metrics_public and path == "/metrics")


def _host_name(host_header: str) -> str | None:
    """The name (or IP) of a Host header without its port; None when malformed."""
    value = host_header.strip().lower()
    if value.startswith("["):  # [v6]:port
        name, sep, rest = value[1:].partition("]")
        return name if sep and (rest == "" or (rest[:1] == ":" and rest[1:].isdigit())) else None
    name, sep, port = value.rpartition(":")
    if not sep:
        return value or None
    return name if port.isdigit() and ":" not in name else None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host in LOOPBACK_NAMES


def _json_type(content_type: bytes) -> bool:
    """``application/json`` or ``application/*+json``, with any parameters (charset)."""
    mime = content_type.split(b";", 1)[0].strip().lower()
    return mime == b"application/json" or (mime.startswith(b"application/") and mime.endswith(b"+json"))


def _empty_body(headers: dict[bytes, bytes]) -> bool:
    length = headers.get(b"content-length")
    if length is not None:
        return length.strip() == b"0"
    return b"transfer-encoding" not in headers


class Guard:
    """ASGI middleware enforcing `Guarded` in front of the app (HTTP requests; other scopes pass)."""

    def __init__(self, app: Any, rules: Guarded) -> None:
        self.app = app
        self.rules = rules

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rules = self.rules
        headers: dict[bytes, bytes] = {}
        for name, value in scope.get("headers") or ():
            headers.setdefault(name.lower(), value)
        method: str = scope["method"]
        path: str = scope.get("path", "")
        host = headers.get(b"host", b"").decode("latin-1")
        origin = headers[b"origin"].decode("latin-1") if b"origin" in headers else None

        async def refuse(
            status: int,
            message: str,
            code: str,
            type_: str = "invalid_request_error",
            extra: dict[str, str] | None = None,
        ) -> None:
            log.warning(
                "http_refused",
                status=status,
                code=code,
                method=method,
                path=path,
                origin=origin[:200] if origin is not None else None,
                host=host[:200],
            )
            response = error_response(status, message, type_, code, headers={**(extra or {}), **cors})
            await response(scope, receive, send)

        cors: dict[str, str] = {}
        if not rules.host_ok(host):
            await refuse(
                403,
                f"Host {host[:200]!r} is not an address of this daemon (DNS rebinding?); "
                "add the name to http.allowed_hosts if you reach the API by it",
                "host_not_allowed",
            )
            return
        listed = origin is not None and rules.origin_listed(origin)
        if listed:
            assert origin is not None
            cors = {"Access-Control-Allow-Origin": "*" if "*" in rules.cors_origins else origin, "Vary": "Origin"}
            if "*" not in rules.cors_origins:
                cors["Access-Control-Allow-Credentials"] = "true"
        if method == "OPTIONS" and origin is not None and b"access-control-request-method" in headers:
            if not listed:
                await refuse(403, f"origin {origin[:200]!r} is not in http.cors_origins", "origin_not_allowed")
                return
            asked = headers.get(b"access-control-request-headers", b"").decode("latin-1").strip()
            response = _preflight(cors, asked)
            await response(scope, receive, send)
            return
        if method not in SAFE_METHODS and origin is not None and not listed and not _same_origin(origin, host):
            await refuse(
                403,
                f"cross-origin {method} from {origin[:200]!r} refused: the origin is not in http.cors_origins",
                "origin_not_allowed",
            )
            return
        if (
            rules.needs_key(path)
            and not rules.key_ok(headers)
            and not rules.token_ok(path, scope.get("query_string", b""))
        ):
            given = b"authorization" in headers or b"x-api-key" in headers
            message = (
                "Incorrect API key provided."
                if given
                else "You didn't provide an API key. Send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
                "(the daemon's api.api_key or api.api_key_file)."
            )
            await refuse(
                401,
                message,
                "invalid_api_key",
                "invalid_request_error",
                {"WWW-Authenticate": 'Bearer realm="genie-supervisor"'},
            )
            return
        if (
            method not in SAFE_METHODS
            and b"content-type" in headers
            and not _json_type(headers[b"content-type"])
            and not _empty_body(headers)
        ):
            ctype = headers[b"content-type"].decode("latin-1")[:100]
            await refuse(415, f"Content-Type {ctype!r} is not JSON: send application/json", "unsupported_media_type")
            return
        if not cors:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: Any) -> None:
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                extra = [
                    (k.lower().encode("latin-1"), v.encode("latin-1"))
                    for k, v in cors.items()
                    if k.lower().encode("latin-1") not in names
                ]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_cors)


def _same_origin(origin: str, host: str) -> bool:
    """Whether `origin` is the daemon's own (the page was served under the Host it calls)."""
    return bool(host) and origin.rstrip("/").lower() in (f"http://{host.lower()}", f"https://{host.lower()}")


def _preflight(cors: dict[str, str], asked: str) -> Any:
    from fastapi.responses import Response

    headers = {
        **cors,
        "Access-Control-Allow-Methods": ALLOW_METHODS,
        "Access-Control-Allow-Headers": asked[:1000] or ALLOW_HEADERS,
        "Access-Control-Max-Age": str(MAX_AGE_S),
        "Vary": "Origin, Access-Control-Request-Method, Access-Control-Request-Headers",
    }
    return Response(status_code=204, headers=headers)


def guard(app: Any, cfg: Config | None, tokens: StreamTokens | None = None) -> Any:
    """`app` behind the guard of `cfg` (defaults when None), accepting `tokens` on the event stream;
    logs what is enforced, never the key."""
    from ..config import Config

    rules = Guarded.from_config(cfg if cfg is not None else Config(), tokens=tokens)
    log.info(
        "http_access",
        api_key=rules.key is not None,
        cors_origins=sorted(rules.cors_origins),
        hosts="any" if rules.hosts is None else sorted(rules.hosts),
        metrics_public=rules.metrics_public,
    )
    return Guard(app, rules)
