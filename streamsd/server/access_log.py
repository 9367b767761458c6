"""One access line per HTTP request and per WebSocket connect, with no secret in it.

uvicorn writes HTTP lines to `uvicorn.access` and WebSocket handshakes to `uvicorn.error`; this
filter makes both obey the same switch, and rewrites query strings so that a key never reaches a
log: the value of a parameter named like one (`api_key`, `token`, ...), and any value that is one
of the server's keys, whatever its parameter's name. Headers (`Authorization`, the WebSocket's
subprotocols) are never logged.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import unquote_plus

from streamsd.server.auth import ApiKeys

SECRET_NAME = re.compile(r"(?:api[_-]?key|key|access[_-]?token|token)", re.IGNORECASE)
QUERY_PARAM = re.compile(r"([?&][^=&#\s]*=)([^&#\s]*)")
WEBSOCKET_LINE = '"WebSocket %s"'
CONNECTION_LINES = frozenset({"connection open", "connection closed"})  # the websockets library's own


def redact(text: str, keys: ApiKeys | None = None) -> str:
    def value(m: re.Match[str]) -> str:
        name = m.group(1)[1:-1]
        secret = SECRET_NAME.fullmatch(name) or (keys is not None and keys.match(unquote_plus(m.group(2))))
        return m.group(1) + ("REDACTED" if secret else m.group(2))

    return QUERY_PARAM.sub(value, text) if "?" in text else text


class AccessLogFilter(logging.Filter):
    """Redacts secrets from request lines; with `enabled` false drops the WebSocket connect lines
    too (uvicorn itself drops the HTTP ones)."""

    def __init__(self, enabled: bool, keys: ApiKeys | None = None):
        super().__init__()
        self.enabled, self.keys = enabled, keys

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.enabled and isinstance(record.msg, str) and (
                WEBSOCKET_LINE in record.msg or record.msg in CONNECTION_LINES):
            return False
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a, self.keys) if isinstance(a, str) else a for a in record.args)
        return True


def install(enabled: bool, keys: ApiKeys | None = None) -> None:
    """On uvicorn's loggers; call after uvicorn.Config, which configures them."""
    log_filter = AccessLogFilter(enabled, keys)
    for name in ("uvicorn.access", "uvicorn.error"):
        logging.getLogger(name).addFilter(log_filter)
