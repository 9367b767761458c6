"""`serve --stream-interval N`: streamed answers arrive N tokens a chunk (the first token at once, the
last chunk whatever is left), the same answers as unstreamed, over SSE and the WebSocket. The first
chunk holds the prompt step's one token: held back, it would hold N. `auto` sets N by the streams open."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import websockets

from streamsd.cli import build_parser
from tests.server_util import start_server

INTERVAL = 4
CHAT = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, close_draft_dir, tmp_path_factory):
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("logs"), "--draft-model", str(close_draft_dir),
                     "--num-speculative-tokens", "3", "--speculation-policy", "fixed",
                     "--stream-interval", str(INTERVAL))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _tokens(extra) -> list[dict]:
    return extra["streamsd"]["tokens"]


def test_sse_chunks_gather_the_interval_and_say_what_an_unstreamed_answer_says(client, model):
    kw = dict(model=model, messages=CHAT, max_tokens=23, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    sizes = [len(_tokens(c.choices[0].model_extra)) for c in chunks]
    assert sizes[0] == 1 and all(n >= INTERVAL for n in sizes[1:-1]), sizes
    assert sum(sizes) == 23 and len(chunks) <= 1 + -(-22 // INTERVAL), sizes
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    ids = [t["id"] for c in chunks for t in _tokens(c.choices[0].model_extra)]
    assert ids == [t["id"] for t in _tokens(full.choices[0].model_extra)]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_several_choices_each_gather_their_own(client, model):
    stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=13, n=2, temperature=1,
                                       seed=5, stream=True, extra_body={"ignore_eos": True})
    sizes: dict[int, list[int]] = {0: [], 1: []}
    for c in stream:
        for ch in c.choices:
            sizes[ch.index].append(len(_tokens(ch.model_extra)))
    for got in sizes.values():
        assert sum(got) == 13 and got[0] == 1 and all(n >= INTERVAL for n in got[1:-1]), sizes


def test_websocket_deltas_gather_the_interval_and_their_steps_add_up(server):
    async def scenario():
        async with websockets.connect(server.ws_url) as ws:
            await ws.send(json.dumps({"type": "generate", "id": "a", "prompt": "Once upon a time", "max_tokens": 17,
                                      "temperature": 0, "ignore_eos": True}))
            frames = []
            while (msg := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] == "delta":
                frames.append(msg)
            return frames, msg

    frames, done = asyncio.run(scenario())
    sizes = [len(f["tokens"]) for f in frames]
    assert sizes[0] == 1 and all(n >= INTERVAL for n in sizes[1:-1]) and sum(sizes) == 17, sizes
    spec = done["usage"]["speculative"]
    assert sum(f["step"]["drafted"] for f in frames) == spec["drafted"]
    assert sum(f["step"]["accepted"] for f in frames) == spec["accepted"]


@pytest.mark.parametrize("value", ["0", "-2", "x"])
def test_a_stream_interval_below_one_or_not_a_number_is_refused_at_the_command_line(value, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--stream-interval", value])
    assert exc.value.code == 2 and "--stream-interval" in capsys.readouterr().err


def test_auto_hands_every_token_over_alone_below_its_streams_and_gathers_above(tiny_model_dir):
    """"auto" gathers one token more for every STREAMS_PER_STEP streams open: 4 answers get every token
    alone; 2 x STREAMS_PER_STEP + 1 answers running together get chunks of at least 3 (the first at once),
    the same tokens as one by one."""
    from streamsd import LLM, SamplingParams
    from streamsd.config import STREAMS_PER_STEP
    from streamsd.engine.async_engine import AsyncEngine

    llm = LLM(str(tiny_model_dir), max_num_seqs=64)
    prompt = llm.core.text.encode_prompt("Once upon a time")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def answers(n: int) -> list[list[list[int]]]:
        engine = AsyncEngine(llm.core, stream_interval="auto")
        await engine.start()

        async def one() -> list[list[int]]:
            return [out.token_ids async for out in engine.generate(prompt, params)]

        try:
            return list(await asyncio.gather(*(one() for _ in range(n))))
        finally:
            await engine.close()

    alone = asyncio.run(answers(4))
    assert all([len(c) for c in chunks] == [1] * 12 for chunks in alone)
    want = [t for c in alone[0] for t in c]
    for chunks in asyncio.run(answers(2 * STREAMS_PER_STEP + 1)):
        sizes = [len(c) for c in chunks]
        assert sizes[0] == 1 and all(n >= 3 for n in sizes[1:-1]) and len(sizes) <= 5, sizes
        assert [t for c in chunks for t in c] == want


def test_auto_is_a_stream_interval_at_the_command_line():
    assert build_parser().parse_args(["serve", "--stream-interval", "auto"]).stream_interval == "auto"
