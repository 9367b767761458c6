"""What the soak sends: a small fixed prompt set with greedy settings, and malformed requests
(HTTP bodies and WebSocket frames) that a correct server must refuse with a 4xx or an `error` frame.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from streamsd.bench.client import RequestSpec

# Mixed endpoints and multi-byte text: a streamed reply must reassemble to exactly the
# non-streamed one, which catches detokenization that splits UTF-8 sequences across chunks.
SOAK_PROMPTS: tuple[tuple[str, str], ...] = (
    ("chat", "What is the capital of France?"),
    ("chat", "Write a short poem about tokens streaming to a browser."),
    ("completions", "Once upon a time"),
    ("completions", "def add(a, b):"),
    ("chat", "Über naïve café — 日本語, emoji 🚀 and accents é è ê."),
    ("completions", "1 2 3 4 5 6 7"),
)

SOAK_SEED = 1234


def soak_spec(index: int, model: str, max_tokens: int, speculative: bool | None = None) -> RequestSpec:
    """Prompt `index` as a greedy request with a fixed seed: its text is fully determined."""
    endpoint, text = SOAK_PROMPTS[index]
    return RequestSpec(endpoint, model, text, max_tokens, 0.0, SOAK_SEED, False, speculative)


@dataclass(frozen=True)
class BadHttp:
    """A malformed HTTP request: `body` is sent raw when bytes, else as JSON."""

    name: str
    route: str
    body: bytes | dict[str, Any]


def bad_http_requests(model: str, stream: bool) -> list[BadHttp]:
    chat = "/v1/chat/completions"
    ok_messages = [{"role": "user", "content": "Hi"}]

    def body(**overrides: Any) -> dict[str, Any]:
        return {"model": model, "messages": ok_messages, "max_tokens": 8, "stream": stream, **overrides}

    return [
        BadHttp("bad_json", chat, b'{"model": "x", "messages": [{"role": "user", '),
        BadHttp("temperature_out_of_range", chat, body(temperature=-1.0)),
        BadHttp("temperature_too_high", chat, body(temperature=7.5)),
        BadHttp("unknown_role", chat, body(messages=[{"role": "wizard", "content": "Hi"}])),
        BadHttp("max_tokens_wrong_type", chat, body(max_tokens="ten")),
        BadHttp("messages_wrong_type", chat, body(messages="Hi")),
        BadHttp("n_0", chat, body(n=0)),
        BadHttp("top_logprobs_too_many", chat, body(logprobs=True, top_logprobs=50)),
        BadHttp("prompt_wrong_type", "/v1/completions",
                {"model": model, "prompt": {"text": 1}, "max_tokens": 8, "stream": stream}),
    ]


# Just over the protocol's 1 MiB frame limit; built once, it is large.
OVERSIZED_FRAME = json.dumps({"type": "generate", "id": "big", "prompt": "x" * (1 << 20), "max_tokens": 1})


@dataclass(frozen=True)
class BadFrame:
    """A malformed WebSocket frame (text or binary) and what the server must do with it:
    `error` (an error frame, socket stays open), `close_1009` (oversized: close with 1009),
    `duplicate` (the frame is sent twice while live: one error, one stream)."""

    name: str
    frame: str | bytes
    expect: str = "error"


def bad_ws_frames(rid: str, valid_generate: str) -> list[BadFrame]:
    def generate(**fields: Any) -> str:
        base = {"type": "generate", "id": rid, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
        return json.dumps({**base, **fields})

    return [
        BadFrame("not_json", "{oops"),
        BadFrame("binary", b"\x00\xffbinary"),
        BadFrame("not_an_object", "[1, 2, 3]"),
        BadFrame("unknown_type", json.dumps({"type": "explode", "id": rid})),
        BadFrame("temperature_out_of_range", generate(temperature=-1.0)),
        BadFrame("unknown_role", generate(messages=[{"role": "wizard", "content": "Hi"}])),
        BadFrame("max_tokens_wrong_type", generate(max_tokens="ten")),
        BadFrame("n_2", generate(n=2)),
        BadFrame("oversized", OVERSIZED_FRAME, expect="close_1009"),
        BadFrame("duplicate_live_id", valid_generate, expect="duplicate"),
    ]


def pick_bad_http(rng: random.Random, model: str) -> BadHttp:
    return rng.choice(bad_http_requests(model, stream=rng.random() < 0.5))


def pick_bad_frame(rng: random.Random, rid: str, valid_generate: str) -> BadFrame:
    return rng.choice(bad_ws_frames(rid, valid_generate))
