"""The prefix cache through the server: OpenAI's usage.prompt_tokens_details.cached_tokens (chat and
completions, streamed and not), the WebSocket `done` event's usage, and the prefix cache counters."""

from __future__ import annotations

import asyncio
import json

import openai
import websockets

from tests.server_util import metric, start_server
from tests.tiny import CORPUS

LONG = " ".join(CORPUS[:3])  # well over three KV blocks of tokens


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_repeated_long_prompt_reports_cached_tokens_and_moves_the_metrics(server):
    client = _client(server)
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": LONG}, {"role": "user", "content": "Summarise."}]
    queries0 = metric(server.url, "streamsd:prefix_cache_queries_total")
    hits0 = metric(server.url, "streamsd:prefix_cache_hits_total")
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached % 16 == 0 and cached < second.usage.prompt_tokens
    assert second.choices[0].message.content == first.choices[0].message.content
    assert metric(server.url, "streamsd:prefix_cache_queries_total") == queries0 + 2 * first.usage.prompt_tokens
    assert metric(server.url, "streamsd:prefix_cache_hits_total") == hits0 + cached

    # the same prompt streamed, with the usage chunk; and as a completion
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    client.completions.create(model=model, prompt=LONG, max_tokens=4, temperature=0)
    again = client.completions.create(model=model, prompt=LONG, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 32


def test_websocket_done_usage_reports_cached_tokens(server):
    async def generate(ws, rid: str) -> dict:
        await ws.send(json.dumps({"type": "generate", "id": rid, "prompt": LONG[::-1], "max_tokens": 6,
                                  "temperature": 0}))
        while True:
            msg = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if msg["type"] == "done" and msg["id"] == rid:
                return msg

    async def scenario():
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/v1/ws") as ws:
            return await generate(ws, "one"), await generate(ws, "two")

    one, two = asyncio.run(scenario())
    assert one["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert two["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32


def test_a_server_without_the_prefix_cache_computes_every_prompt(tiny_model_dir, tmp_path):
    s = start_server(tiny_model_dir, tmp_path, "--no-enable-prefix-caching")
    try:
        client = _client(s)
        model = client.models.list().data[0].id
        for _ in range(2):
            res = client.completions.create(model=model, prompt=LONG, max_tokens=4, temperature=0)
            assert res.usage.prompt_tokens_details.cached_tokens == 0
        assert metric(s.url, "streamsd:prefix_cache_hits_total") == 0
    finally:
        s.stop()
