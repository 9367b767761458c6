"""`streamsd serve --engine-process`: the engine in a process of its own, beside the one that serves
HTTP and WebSockets. The same answers as one process, bad input refused before the engine sees it,
hang-ups that free what they held, and a server that ends when its engine process does."""

from __future__ import annotations

import asyncio
import functools
import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
import websockets
from starlette.testclient import TestClient

from streamsd.config import EngineConfig
from streamsd.engine.core import build_engine_core
from streamsd.server.app import create_app
from streamsd.server.state import ServerState
from tests.server_util import Server, metric, spawned, start_server, wait_metric

PROMPTS = ["Once upon a time", "The capital of France is", "def fib(n):", "In the beginning"]
FLAGS = ("--num-speculative-tokens", "3", "--speculation-policy", "fixed", "--max-num-seqs", "4")


@pytest.fixture(scope="module")
def server(tiny_model_dir, close_draft_dir, tmp_path_factory):
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("logs"), "--engine-process",
                     "--draft-model", str(close_draft_dir), *FLAGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_answers_equal_those_of_one_process(server, client, tiny_model_dir, close_draft_dir, tmp_path):
    """Greedy answers, speculating with a draft model, token for token as the engine in the server's own
    process gives them."""
    one = start_server(tiny_model_dir, tmp_path, "--draft-model", str(close_draft_dir), *FLAGS)
    try:
        alone = openai.OpenAI(base_url=f"{one.url}/v1", api_key="unused", max_retries=0, timeout=60)
        for prompt in PROMPTS:
            kw = {"model": "target0", "prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 0,
                  "extra_body": {"ignore_eos": True}}
            ours, theirs = client.completions.create(**kw), alone.completions.create(**kw)
            assert ours.choices[0].logprobs.tokens == theirs.choices[0].logprobs.tokens
            assert ours.choices[0].text == theirs.choices[0].text
            assert ours.usage.completion_tokens == theirs.usage.completion_tokens == 24
    finally:
        one.stop()


def test_streamed_chat_reads_as_the_whole_answer_and_reports_its_speculation(client):
    kw = {"model": "target0", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 32,
          "temperature": 0, "seed": 1}
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.completion_tokens_details.accepted_prediction_tokens > 0  # the draft model's tokens, verified


def test_bad_input_is_refused_with_its_field_and_the_engine_keeps_serving(client):
    cases = [({"prompt": [[10**6]]}, "prompt"), ({"prompt": "hi", "max_tokens": 10**6}, "prompt"),
             ({"prompt": "hi", "extra_body": {"guided_regex": "[a-"}}, "guided_regex"),
             ({"prompt": "hi", "extra_body": {"stop_token_ids": [10**6]}}, "stop_token_ids")]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="target0", **{"max_tokens": 4, **fields})
        assert err.value.body["param"] == param, err.value.body
    ok = client.completions.create(model="target0", prompt="hi", max_tokens=6, temperature=0,
                                   extra_body={"guided_regex": "[ab]+"})
    assert ok.choices[0].text and set(ok.choices[0].text) <= {"a", "b"}


def test_hung_up_streams_are_aborted_and_free_their_kv(server, client):
    before = metric(server.url, "streamsd:generation_tokens_total")
    streams = [client.completions.create(model="target0", prompt=p, max_tokens=3000, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True}) for p in PROMPTS]
    for s in streams:
        next(iter(s))  # the first chunk: it runs
    assert wait_metric(server.url, "streamsd:num_requests_running", len(PROMPTS), 10) == len(PROMPTS)
    for s in streams:
        s.close()
    assert wait_metric(server.url, "streamsd:num_requests_running", 0, 5) == 0
    assert wait_metric(server.url, "streamsd:kv_cache_usage_perc", 0, 2) == 0
    assert metric(server.url, "streamsd:generation_tokens_total") - before < 2 * 3000
    assert metric(server.url, "streamsd:spec_decode_num_drafts_total") > 0
    assert metric(server.url, "streamsd:iteration_tokens_total_count") > 0


def test_websocket_generation_streams_tokens_and_ends_with_done(server):
    async def main() -> list[dict]:
        async with websockets.connect(server.ws_url) as ws:
            await ws.send(json.dumps({"type": "generate", "id": "a", "messages": [{"role": "user", "content": "hello"}],
                                      "max_tokens": 12, "temperature": 0}))
            events = []
            while not events or events[-1].get("type") not in ("done", "error"):
                events.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
            return events

    events = asyncio.run(main())
    assert events[-1]["type"] == "done", events[-1]
    assert sum(len(e.get("tokens", [])) for e in events if e.get("type") == "delta") == 12


def test_sigterm_ends_the_engine_process_with_the_server(tiny_model_dir, tmp_path):
    s = start_server(tiny_model_dir, tmp_path, "--engine-process")
    children = spawned(s.proc.pid)
    assert len(children) == 1, children
    assert s.stop() == 0
    deadline = time.monotonic() + 10
    while Path(f"/proc/{children[0]}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{children[0]}").exists(), "the engine process outlived its server"


def test_server_exits_non_zero_when_its_engine_process_dies(tiny_model_dir, tmp_path):
    s: Server = start_server(tiny_model_dir, tmp_path, "--engine-process")
    try:
        [child] = spawned(s.proc.pid)
        os.kill(child, signal.SIGKILL)
        rc = s.proc.wait(30)
    finally:
        s.stop(signal.SIGKILL)
    assert rc == 1
    assert "the engine process exited" in s.log.read_text()


def test_until_the_server_has_exited_requests_after_its_engine_process_died_get_503(tiny_model_dir):
    """Between the engine process's end and the server's own, /health says why and a request gets a
    503 naming it, not a 500 (the app alone: nothing here exits)."""
    state = ServerState(served_model_name="tiny")
    factory = functools.partial(build_engine_core, EngineConfig(model=str(tiny_model_dir), device="cpu"))
    with TestClient(create_app(state, factory, engine_process=True)) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        [child] = [p for p in mp.active_children() if p.name == "streamsd-engine"]
        os.kill(child.pid, signal.SIGKILL)
        while client.get("/health").json()["status"] != "failed" and time.monotonic() < deadline:
            time.sleep(0.05)
        health = client.get("/health")
        r = client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 4})
    assert health.status_code == 503 and "the engine process exited" in health.json()["error"]
    assert r.status_code == 503, r.text
    assert "the engine process exited" in r.json()["error"]["message"]


def test_a_burst_of_long_prompts_beside_running_streams_is_answered_whole(server):
    """Sixteen prompts of 3,000 token ids (hundreds of kilobytes through the pipe at once, more than it
    buffers) while four answers stream: every request is answered and every stream ends."""
    async def main() -> tuple[list[int], list[str]]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)

        async def streamed(prompt: str) -> str:
            last = ""
            async for chunk in await aclient.completions.create(model="target0", prompt=prompt, max_tokens=200,
                                                                 stream=True, extra_body={"ignore_eos": True}):
                last = chunk.choices[0].finish_reason or last
            return last

        async def long(i: int) -> int:
            ids = [(7 * i + j) % 300 + 3 for j in range(3000)]
            reply = await aclient.completions.create(model="target0", prompt=ids, max_tokens=4, temperature=0)
            assert reply.usage is not None
            return reply.usage.prompt_tokens

        streams = [asyncio.create_task(streamed(p)) for p in PROMPTS]
        counts = await asyncio.gather(*(long(i) for i in range(16)))
        return counts, await asyncio.gather(*streams)

    counts, ends = asyncio.run(main())
    assert counts == [3000] * 16
    assert ends == ["length"] * len(PROMPTS)


@pytest.mark.parametrize("flags", [(), ("--engine-process",)], ids=["one-process", "engine-process"])
def test_a_request_only_the_engine_can_refuse_gets_the_same_400(tiny_model_dir, close_draft_dir, tmp_path, flags):
    """Within the context window but, with its drafts' KV, more than the pool holds: a check the engine
    makes. Streamed or not, over HTTP or WebSocket, the answer is a 400 naming the prompt, and the
    engine goes on serving."""
    s = start_server(tiny_model_dir, tmp_path, "--kv-cache-tokens", "256", "--max-model-len", "256",
                     "--draft-model", str(close_draft_dir), "--num-speculative-tokens", "3", *flags)
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(model="target0", prompt=[5] * 200, max_tokens=56, stream=stream)
            assert err.value.body["param"] == "prompt" and "KV cache" in err.value.body["message"]

        async def over_websocket() -> dict:
            async with websockets.connect(s.ws_url) as ws:
                await ws.send(json.dumps({"type": "generate", "id": "a", "prompt": "x" * 200, "max_tokens": 56}))
                return json.loads(await asyncio.wait_for(ws.recv(), 30))

        event = asyncio.run(over_websocket())
        assert event["type"] == "error" and event["error"]["code"] == "invalid_request", event
        assert client.completions.create(model="target0", prompt=[5] * 100, max_tokens=5).usage.completion_tokens == 5
    finally:
        s.stop()


def test_a_full_queue_answers_429_with_retry_after(tiny_model_dir, tmp_path):
    """A queue of one: of a burst of eight, those past it are refused as overloaded, whether the server's
    count (requests still in the pipe included) or the engine's queue turns them away; none fails."""
    s = start_server(tiny_model_dir, tmp_path, "--engine-process", "--max-queue", "1", "--max-num-seqs", "2")
    try:
        async def flood() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as ac:
                long = {"prompt": "hi", "max_tokens": 300, "ignore_eos": True}
                return await asyncio.gather(*[ac.post("/v1/completions", json=long) for _ in range(8)])

        answers = asyncio.run(flood())
    finally:
        s.stop()
    codes = sorted(r.status_code for r in answers)
    assert set(codes) == {200, 429}, codes
    for r in answers:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "server_overloaded"
