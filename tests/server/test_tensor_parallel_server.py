"""`streamsd serve --tensor-parallel-size 2`: a real server whose target is split over two ranks."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import openai
import pytest

from tests.server_util import Server, metric, spawned, start_server


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def server(tiny_model_dir, tmp_path):
    s = start_server(tiny_model_dir, tmp_path, "--tensor-parallel-size", "2", "--speculative-method", "ngram",
                     "--kv-cache-tokens", "1024", "--dtype", "float32")
    yield s
    s.stop(signal.SIGKILL)


def test_a_two_rank_server_answers_a_chat_request_and_stops_its_follower_on_sigterm(server: Server):
    ranks = spawned(server.proc.pid)
    assert len(ranks) == 1, ranks
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    # A SIGTERM that reaches every process of the server (systemd's control group, a process-group kill)
    # is rank 0's to act on: the follower keeps serving until rank 0 has drained and stops it.
    os.kill(ranks[0], signal.SIGTERM)
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Again"}],
                                           max_tokens=4, temperature=0)
    assert reply.choices[0].message.content is not None
    assert alive(ranks[0])
    assert server.stop(signal.SIGTERM) == 0
    assert not any(alive(p) for p in ranks), "a follower rank outlived the server"


def test_a_follower_rank_that_dies_ends_the_server_with_an_error_naming_it(server: Server):
    (follower,) = spawned(server.proc.pid)
    os.kill(follower, signal.SIGKILL)
    _ends_naming_rank_1(server)


def test_a_follower_rank_of_an_engine_process_that_dies_ends_the_server(tiny_model_dir, tmp_path):
    s = start_server(tiny_model_dir, tmp_path, "--tensor-parallel-size", "2", "--speculative-method", "ngram",
                     "--kv-cache-tokens", "1024", "--dtype", "float32", "--engine-process")
    try:
        (engine,) = spawned(s.proc.pid)
        (follower,) = spawned(engine)
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.completions.create(model=client.models.list().data[0].id, prompt="Hello", max_tokens=4)
        assert reply.usage is not None and reply.usage.completion_tokens > 0
        os.kill(follower, signal.SIGKILL)
        _ends_naming_rank_1(s)
    finally:
        s.stop(signal.SIGKILL)


def _ends_naming_rank_1(server: Server) -> None:
    try:
        code = server.proc.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail("the server kept running without its follower rank")
    assert code != 0
    assert "tensor-parallel rank 1 exited" in server.log.read_text()


@pytest.fixture(scope="module")
def untrained_head(tiny_model_dir, tmp_path_factory) -> Path:
    """An EAGLE-3 head over the whole vocabulary: it drafts through the target's embedding and lm_head."""
    import json

    import torch

    from streamsd.model.loader import load_model
    from streamsd.spec_decode.eagle.checkpoint import new_head, save_head

    torch.manual_seed(0)
    target, _ = load_model(str(tiny_model_dir), torch.device("cpu"), torch.float32)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    return save_head(new_head(target), tmp_path_factory.mktemp("head"), config, torch.float32)


def test_a_two_rank_server_drafts_with_an_eagle_head_and_answers_as_one_rank_decodes(tiny_model_dir, untrained_head,
                                                                                       tmp_path):
    from streamsd import LLM, SamplingParams

    prompt = "The capital of France is"
    with LLM(str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_tokens=1024) as one:
        expected = one.generate([prompt], [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)])[0]
    s = start_server(tiny_model_dir, tmp_path, "--tensor-parallel-size", "2", "--speculative-method", "eagle",
                     "--draft-model", str(untrained_head), "--num-speculative-tokens", "3",
                     "--speculation-policy", "fixed", "--kv-cache-tokens", "1024", "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert reply.choices[0].text == expected.outputs[0].text
        assert metric(s.url, "streamsd:spec_decode_num_draft_tokens_total") > 0
        assert s.stop(signal.SIGTERM) == 0
    finally:
        s.stop(signal.SIGKILL)
