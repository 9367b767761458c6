"""Structured output on the wire: `response_format` (OpenAI's JSON mode and JSON schema) and the
`guided_regex` extension -> the request's Constraint (state.compile_constraint compiles it off the
event loop). A shape the server does not know is a ParamError naming the field: a 400.
"""

from __future__ import annotations

import json
from typing import Any

from streamsd.request import Constraint, ParamError

RESPONSE_FORMAT = "response_format"
GUIDED_REGEX = "guided_regex"
# JSON mode: OpenAI's json_object is an object, whatever its keys.
ANY_OBJECT = json.dumps({"type": "object"})


def constraint_of(response_format: dict[str, Any] | None, guided_regex: str | None) -> Constraint | None:
    """The request's constraint, or None for free text."""
    if guided_regex is not None and response_format not in (None, {"type": "text"}):
        raise ParamError(GUIDED_REGEX, f"cannot be combined with {RESPONSE_FORMAT}")
    if guided_regex is not None:
        return Constraint("regex", guided_regex, GUIDED_REGEX)
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text" and response_format.keys() == {"type"}:
        return None
    if kind == "json_object" and response_format.keys() == {"type"}:
        return Constraint("json", ANY_OBJECT)
    if kind == "json_schema" and response_format.keys() == {"type", "json_schema"}:
        return Constraint("json", json.dumps(_schema(response_format["json_schema"])))
    raise _bad('must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
               '{"name": ..., "schema": {...}}}')


def _schema(spec: Any) -> dict[str, Any]:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise _bad("json_schema must be an object with a name")
    if not spec.keys() <= {"name", "description", "schema", "strict"}:
        raise _bad(f"json_schema has unknown fields: {sorted(spec.keys() - {'name', 'description', 'schema', 'strict'})}")
    if not isinstance(spec.get("strict", False), bool | None) or not isinstance(spec.get("description", ""), str):
        raise _bad("json_schema's strict must be a boolean and its description a string")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise _bad("json_schema's schema must be a JSON Schema object")
    return schema


def _bad(message: str) -> ParamError:
    return ParamError(RESPONSE_FORMAT, message)
