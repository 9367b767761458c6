"""A model's generation_config.json sampling defaults apply to every request field left out: over
the OpenAI routes, the WebSocket protocol, `streamsd generate` and the offline LLM API."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import openai
import pytest
from websockets.sync.client import connect

from streamsd import LLM, SamplingParams
from streamsd.cli import main
from tests.server_util import start_server

MESSAGES = [{"role": "user", "content": "hello there"}]


def _with_generation_config(src: Path, dst: Path, **sampling: float) -> Path:
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, **sampling}))
    return dst


@pytest.fixture(scope="module")
def greedy_by_default(tiny_model_dir, tmp_path_factory) -> Path:
    """The model asks for top_k 1: whatever the seed, a request that leaves top_k out decodes greedily."""
    return _with_generation_config(tiny_model_dir, tmp_path_factory.mktemp("tuned") / "m", temperature=0.7,
                                   top_k=1, repetition_penalty=1.3)


def test_defaults_are_read_from_the_generation_config(greedy_by_default):
    from streamsd.engine.generation_defaults import GenerationDefaults

    d = GenerationDefaults.read(greedy_by_default)
    assert (d.temperature, d.top_k, d.top_p, d.repetition_penalty) == (0.7, 1, None, 1.3)
    assert GenerationDefaults.read(greedy_by_default, "none") == GenerationDefaults()
    p = d.sampling_params(temperature=0.2, max_tokens=5)
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.max_tokens) == (0.2, 1, 1.0, 1.3, 5)
    assert d.sampling_params(repetition_penalty=1.0).repetition_penalty == 1.0  # an explicit value wins
    assert GenerationDefaults().sampling_params().temperature == 1.0
    odd = GenerationDefaults.from_dict({"temperature": 0.5, "top_p": 0.0, "top_k": -1, "do_sample": True,
                                        "repetition_penalty": 0.0})
    assert (odd.temperature, odd.top_p, odd.top_k) == (0.5, None, 0)  # top_p 0 is no distribution: ignored
    assert odd.repetition_penalty is None  # nor is a repetition penalty of 0


def test_offline_llm_samples_with_the_models_defaults(greedy_by_default, caplog):
    with caplog.at_level(logging.INFO, logger="streamsd"):
        llm = LLM(str(greedy_by_default), device="cpu", dtype="float32")
    assert any("repetition_penalty=1.3" in r.message and r.levelno == logging.INFO for r in caplog.records)
    defaults = llm.get_default_sampling_params(max_tokens=12, seed=3)
    assert (defaults.temperature, defaults.top_k, defaults.repetition_penalty, defaults.max_tokens) == (0.7, 1, 1.3, 12)
    greedy = llm.generate("hello", SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3))[0]
    assert llm.generate("hello")[0].outputs[0].token_ids == greedy.outputs[0].token_ids  # the model's: top_k 1, 1.3
    unpenalised = llm.generate("hello", SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].token_ids
    assert unpenalised != greedy.outputs[0].token_ids  # ("hello" repeats a token without the penalty)
    plain = LLM(str(greedy_by_default), device="cpu", dtype="float32", generation_config="none")
    p = plain.get_default_sampling_params()
    assert (p.temperature, p.top_k, p.repetition_penalty) == (1.0, 0, 1.0)


def test_server_requests_that_leave_sampling_out_take_the_models_defaults(greedy_by_default, tmp_path):
    server = start_server(greedy_by_default, tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
        greedy = client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=12, temperature=0)
        greedy_text = greedy.choices[0].message.content
        for seed in (1, 2):
            reply = client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=12, seed=seed)
            assert reply.choices[0].message.content == greedy_text
            done = client.completions.create(model=None, prompt="hello there", max_tokens=12, seed=seed)
            assert done.choices[0].text == client.completions.create(
                model=None, prompt="hello there", max_tokens=12, temperature=0).choices[0].text
        with connect(f"ws://127.0.0.1:{server.port}/v1/ws") as ws:
            ws.send(json.dumps({"type": "generate", "id": "a", "messages": MESSAGES, "max_tokens": 12, "seed": 5}))
            text = ""
            while (event := json.loads(ws.recv(timeout=60)))["type"] != "done":
                assert event["type"] == "delta", event
                text += event["text"]
        assert text == greedy_text
    finally:
        assert server.stop() == 0
    assert "repetition_penalty=1.3" in server.log.read_text()  # the model's defaults, said once at load


def test_generate_without_sampling_flags_samples_as_the_model_says(tiny_model_dir, tmp_path, capsys):
    hot = _with_generation_config(tiny_model_dir, tmp_path / "hot", temperature=1.0, top_p=0.95)
    assert main(["generate", "--model", str(hot), "--device", "cpu", "--dtype", "float32", "--prompt", "hello",
                 "--max-tokens", "12", "--seed", "7", "--speculative-method", "none"]) == 0
    printed = capsys.readouterr().out.rsplit("\n[", 1)[0]
    llm = LLM(str(hot), device="cpu", dtype="float32")
    sampled = llm.generate("hello", SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=7))[0]
    greedy = llm.generate("hello", SamplingParams(temperature=0, max_tokens=12))[0]
    assert sampled.outputs[0].text != greedy.outputs[0].text  # the check below tells the two apart
    assert printed == sampled.outputs[0].text
