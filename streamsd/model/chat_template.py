"""Rendering a chat template: the Jinja dialect Hugging Face chat templates are written in.

Templates come with models and are untrusted code, so they run in Jinja's immutable sandbox. What
they may call is what templates on the Hub expect: `raise_exception`, `strftime_now`, a `tojson`
that leaves non-ASCII text and HTML characters alone, `dict`, a `namespace` that refuses
underscore-prefixed names, the `{% generation %}` block (rendered as its body), loop controls; blocks
trimmed and left-stripped. The conversation reaches the template as plain JSON data (no caller
objects) without the keys whose value is None, and a message's reasoning under every name templates
read it by, as transformers' `apply_chat_template` passes them, so that a model renders the same
prompt here as there (tests/model/test_tokenizer.py compares the two).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The names a message's reasoning goes by; templates read the first, some (gpt-oss) the second.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's part for training masks; a
    prompt renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace without underscore-prefixed attributes (a way into Python's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature: `self` may be a key
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled once per process (a few milliseconds); thread-safe to render."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    return env.from_string(source)


def plain(value: Any) -> Any:
    """`value` rebuilt from JSON types only: what a sandboxed template may see of a caller's data."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, numpy scalars) carry methods of their own
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _message(m: Mapping[str, Any]) -> dict[str, Any]:
    """A message as the template sees it: no None values, the reasoning under each of its names."""
    msg = {k: plain(v) for k, v in m.items() if v is not None}
    reasoning = next((msg[k] for k in REASONING_FIELDS if k in msg), None)
    if reasoning is not None:
        msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
    return msg


def render(source: str, messages: Sequence[Mapping[str, Any]], special_tokens: Mapping[str, str],
           add_generation_prompt: bool) -> str:
    """The conversation rendered by the template `source`, with the tokenizer's named special tokens
    (`bos_token`, `eos_token`, ...) as variables. Raises ValueError for an empty conversation and
    Jinja's errors (a template's own `raise_exception` among them) for what the template refuses."""
    if not messages:
        raise ValueError("a chat needs at least one message")
    chat = [_message(m) for m in messages]
    return compile_template(source).render(messages=chat, tools=None, documents=None,
                                           add_generation_prompt=add_generation_prompt, **special_tokens)
