"""The OpenAI request fields the server knows and does not honour, in one table.

Each is accepted only at a value that asks for nothing (what a client sends to mean "off": `suffix: ""`,
`tools: []`), and refused otherwise with a 400 naming it, so that no request
is answered as if a field it set had been applied. A field leaves the table when it is implemented.
Fields the server does not know at all are refused by the wire types (protocol.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec


@dataclass(frozen=True, slots=True)
class Refusal:
    param: str
    neutral: tuple[Any, ...]
    message: str


_TOOLS = "tool and function calling is not supported"

# field, the values that ask for nothing, and why anything else is refused.
_REFUSALS = (
    # Not part of what this server does.
    Refusal("tools", (None, []), _TOOLS),
    Refusal("tool_choice", (None, "none"), _TOOLS),
    Refusal("functions", (None, []), _TOOLS),
    Refusal("function_call", (None, "none"), _TOOLS),
    Refusal("suffix", (None, ""), "suffix (text after an insertion) is not supported"),
)
UNSUPPORTED: dict[str, Refusal] = {r.param: r for r in _REFUSALS}


def unsupported_field(body: msgspec.Struct) -> Refusal | None:
    """The first field of `body` set to a value the server would not honour, with its refusal."""
    for name, value in msgspec.structs.asdict(body).items():
        refusal = UNSUPPORTED.get(name)
        if refusal is not None and not any(_same(value, n) for n in refusal.neutral):
            return refusal
    return None


def _same(value: Any, neutral: Any) -> bool:
    # `true` is not `1`; `0` and `0.0` are the same number.
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)
