"""Which web origins may use the server from a browser.

Browsers keep other sites' pages from reading the HTTP API (no CORS headers unless origins are
listed), but they let any page open a WebSocket anywhere, sending its own `Origin`: the server
must refuse those itself, or a page on any site could generate through a visitor's browser. An
upgrade is accepted without an `Origin` (a client that is no browser), from the server's own
origin (the scheme, host and port the request came to), or from a listed origin; others get 403.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from streamsd.server.state import ApiError

log = logging.getLogger("streamsd")
ANY = "*"
DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
DEFAULT_METHODS = ("GET", "POST")
DEFAULT_HEADERS = (ANY,)


def normalise(origin: str) -> str | None:
    """`scheme://host[:port]` as a browser writes it (lowercase, the default port left out), or
    None when `origin` is no such thing (`null`, a path, a bare host)."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    if not parts.scheme or not parts.hostname or parts.username or parts.password:
        return None
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    scheme = parts.scheme.lower()
    return f"{scheme}://{host}" + (f":{port}" if port is not None and port != DEFAULT_PORTS.get(scheme) else "")


def _list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


@dataclass(frozen=True, slots=True)
class OriginPolicy:
    """Origins besides the server's own (`*`: any), and what a listed origin's page may send over
    CORS. No origins listed: CORS stays off."""

    origins: tuple[str, ...] = ()
    methods: tuple[str, ...] = DEFAULT_METHODS
    headers: tuple[str, ...] = DEFAULT_HEADERS

    @classmethod
    def parse(cls, origins: str | None, methods: str | None = None, headers: str | None = None) -> OriginPolicy:
        """From the comma lists of --allowed-origins, --allowed-methods and --allowed-headers."""
        listed = []
        for item in _list(origins or ""):
            canonical = ANY if item == ANY else normalise(item)
            if canonical is None:
                raise ValueError(f"--allowed-origins: {item!r} is not an origin (scheme://host[:port]) nor *")
            listed.append(canonical)
        if origins is not None and not listed:
            raise ValueError("--allowed-origins is empty")
        if (methods is not None or headers is not None) and not listed:
            raise ValueError("--allowed-methods and --allowed-headers need --allowed-origins (CORS is off without it)")
        method_list = [m.upper() for m in _list(methods)] if methods is not None else list(DEFAULT_METHODS)
        header_list = _list(headers) if headers is not None else list(DEFAULT_HEADERS)
        return cls(tuple(dict.fromkeys(listed)), tuple(method_list), tuple(header_list))

    def allows_socket(self, origin: str, scope: Scope) -> bool:
        if ANY in self.origins:
            return True
        canonical = normalise(origin)
        return canonical is not None and (canonical == own_origin(scope) or canonical in self.origins)

    def middleware(self) -> list[Middleware]:
        """CORS (with listed origins) outside the WebSocket origin check; both outside the key
        check, so that a preflight, which carries no key, is answered."""
        cors = [Middleware(CORSMiddleware, allow_origins=list(self.origins), allow_methods=list(self.methods),
                           allow_headers=list(self.headers))] if self.origins else []
        return [*cors, Middleware(WebSocketOriginGuard, policy=self)]


def own_origin(scope: Scope) -> str | None:
    """The origin a page served by this server has: the request's scheme (as uvicorn saw it, or
    as a trusted proxy's X-Forwarded-Proto said), its Host header."""
    host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
    scheme = {"ws": "http", "wss": "https"}.get(scope["scheme"], scope["scheme"])
    return normalise(f"{scheme}://{host}") if host else None


class WebSocketOriginGuard:
    def __init__(self, app: ASGIApp, policy: OriginPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            origin = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"origin"), None)
            if origin is not None and not self.policy.allows_socket(origin, scope):
                log.warning("refused a WebSocket from origin %r: not this server's origin (%s) nor in "
                            "--allowed-origins", origin, own_origin(scope))
                err = ApiError(403, f"WebSocket connections from the origin {origin!r} are not allowed",
                               code="origin_not_allowed")
                await WebSocket(scope, receive, send).send_denial_response(JSONResponse(err.body(), 403))
                return
        await self.app(scope, receive, send)
