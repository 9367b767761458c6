"""The API-key check both transports share: `Authorization: Bearer KEY`, the scheme matched without
regard to case (RFC 7235), the key compared in constant time."""

from __future__ import annotations

import hmac


def bearer_matches(header: str | None, key: str) -> bool:
    scheme, _, token = (header or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def key_matches(value: str | None, key: str) -> bool:
    return value is not None and hmac.compare_digest(value.encode(), key.encode())
