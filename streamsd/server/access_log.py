"""One access line per HTTP request and per WebSocket connect, with no secret in it.

uvicorn writes HTTP lines to `uvicorn.access` and WebSocket handshakes to `uvicorn.error`; this
filter makes both obey the same switch, and rewrites query strings so that a key passed as
`?api_key=...` (the WebSocket's way to authenticate from a browser) never reaches a log.
"""

from __future__ import annotations

import logging
import re

SECRET_PARAM = re.compile(r"([?&](?:api[_-]?key|key|access[_-]?token|token)=)[^&#\s]*", re.IGNORECASE)
WEBSOCKET_LINE = '"WebSocket %s"'
CONNECTION_LINES = frozenset({"connection open", "connection closed"})  # the websockets library's own


def redact(text: str) -> str:
    return SECRET_PARAM.sub(r"\1REDACTED", text)


class AccessLogFilter(logging.Filter):
    """Redacts secrets from request lines; with `enabled` false drops the WebSocket connect lines
    too (uvicorn itself drops the HTTP ones)."""

    def __init__(self, enabled: bool):
        super().__init__()
        self.enabled = enabled

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.enabled and isinstance(record.msg, str) and (
                WEBSOCKET_LINE in record.msg or record.msg in CONNECTION_LINES):
            return False
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        return True


def install(enabled: bool) -> None:
    """On uvicorn's loggers; call after uvicorn.Config, which configures them."""
    log_filter = AccessLogFilter(enabled)
    for name in ("uvicorn.access", "uvicorn.error"):
        logging.getLogger(name).addFilter(log_filter)
