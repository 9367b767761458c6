"""API keys: several may be valid at once, each known by a name that is not the key itself (the
label its requests are counted under in /metrics). A key is presented as `Authorization: Bearer
KEY` (the scheme in any case, RFC 7235) or, on the WebSocket, in a subprotocol; every key is
compared in constant time, and all of them on each check, so that timing tells neither the key
nor which one matched."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# The WebSocket subprotocol a client offers to carry its key (`streamsd.bearer.` + the key in
# unpadded base64url, since a subprotocol admits no spaces nor separators) next to PROTOCOL, the
# one the server echoes: a browser fails a handshake whose answer names none of its offers, and
# the key's own protocol is never sent back.
PROTOCOL = "streamsd"
KEY_PROTOCOL_PREFIX = "streamsd.bearer."


def _digest(value: str) -> bytes:
    # Digests have one length, so compare_digest's time does not depend on the key's length either.
    return hashlib.sha256(value.encode()).digest()


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    digest: bytes


class ApiKeys:
    """The keys the server accepts; `match` returns the name of the one given, or None."""

    def __init__(self, keys: Sequence[ApiKey]):
        names = [k.name for k in keys]
        if len(set(names)) != len(names):
            raise ValueError(f"API key names must differ: {', '.join(sorted(n for n in names if names.count(n) > 1))}")
        if len({k.digest for k in keys}) != len(keys):
            raise ValueError("the same API key is given twice")
        self.keys = tuple(keys)

    @classmethod
    def parse(cls, specs: Iterable[str]) -> ApiKeys:
        """Each spec `KEY` or `NAME:KEY` (NAME letters, digits, `_.-`); an unnamed key is called
        `key-N`, N its position among all keys (from 1). A key that holds a colon itself is given
        with a name: the name ends at the first colon."""
        keys = []
        for i, spec in enumerate(specs, 1):
            name, sep, key = spec.partition(":")
            if not sep or not NAME.fullmatch(name):
                name, key = f"key-{i}", spec
            if not key:
                raise ValueError(f"API key {name} is empty")
            keys.append(ApiKey(name, _digest(key)))
        return cls(keys)

    @staticmethod
    def read_file(path: str | Path) -> list[str]:
        """One key (or NAME:KEY) per line; blank lines and lines starting with # are skipped."""
        lines = (line.strip() for line in Path(path).read_text().splitlines())
        return [line for line in lines if line and not line.startswith("#")]

    @property
    def names(self) -> list[str]:
        return [k.name for k in self.keys]

    def match(self, token: str | None) -> str | None:
        if token is None:
            return None
        digest, found = _digest(token), None
        for key in self.keys:
            if hmac.compare_digest(digest, key.digest) and found is None:
                found = key.name
        return found

    def bearer(self, header: str | None) -> str | None:
        scheme, _, token = (header or "").strip().partition(" ")
        return self.match(token.strip()) if scheme.lower() == "bearer" else None

    def subprotocol(self, offered: Sequence[str]) -> str | None:
        for protocol in offered:
            if protocol.startswith(KEY_PROTOCOL_PREFIX):
                encoded = protocol[len(KEY_PROTOCOL_PREFIX):]
                try:
                    token = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
                except (binascii.Error, UnicodeDecodeError):
                    continue
                if (name := self.match(token)) is not None:
                    return name
        return None
