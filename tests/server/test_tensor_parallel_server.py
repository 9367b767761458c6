"""`streamsd serve --tensor-parallel-size 2`: a real server whose target is split over two ranks."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import openai
import pytest

from tests.server_util import Server, start_server


def followers(pid: int) -> list[int]:
    """The live processes `pid` spawned to run ranks (not multiprocessing's resource tracker)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and b"spawn_main" in cmdline:
            out.append(int(stat.parent.name))
    return out


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
    ranks = followers(server.proc.pid)
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
    (follower,) = followers(server.proc.pid)
    os.kill(follower, signal.SIGKILL)
    try:
        code = server.proc.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail("the server kept running without its follower rank")
    assert code != 0
    assert "tensor-parallel rank 1 exited" in server.log.read_text()
